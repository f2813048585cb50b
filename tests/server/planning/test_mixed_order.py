"""The mixed order of NOTE [ Mixed order ] as a pure function: shares over every prefix,
exactly-once within each source's pass, determinism per (seed, epoch), the epoch's end,
dealing to ranks and resuming from a global cursor; and the mix's own validation."""

from __future__ import annotations

import dataclasses
from collections import Counter
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from batchd.errors import FailedPrecondition, InvalidArgument
from batchd_server.planning.mixing import (
    MixOptions,
    MixSourceOptions,
    mix_counts,
    mix_token,
    mixed_order,
    parse_mix_token,
    plan_mix_epoch,
    source_starts,
)
from batchd_server.planning.sampling import SamplerOptions, rest_of_order

PROPERTY = settings(max_examples=150, deadline=None)


def _mix(weights: list[float], stop: int = 0) -> MixOptions:
    sources = tuple(MixSourceOptions(dataset=f"d{i}", weight=w) for i, w in enumerate(weights))
    return MixOptions(sources=sources, stop_samples=stop)


@st.composite
def mixes(draw: st.DrawFn) -> dict[str, Any]:
    count = draw(st.integers(1, 5))
    sizes = draw(st.lists(st.integers(1, 60), min_size=count, max_size=count))
    weights = draw(
        st.lists(
            st.floats(0.01, 100, allow_nan=False, allow_infinity=False),
            min_size=count,
            max_size=count,
        )
    )
    stop = draw(st.one_of(st.just(0), st.integers(1, 300)))
    return {
        "sizes": sizes,
        "mix": _mix(weights, stop),
        "seed": draw(st.integers(0, 1 << 32)),
        "epoch": draw(st.integers(0, 4)),
        "shuffle": draw(st.booleans()),
    }


def _order(m: dict[str, Any], **kw: Any) -> np.ndarray:
    args = {"seed": m["seed"], "epoch": m["epoch"], "shuffle": m["shuffle"], **kw}
    mix = m["mix"]
    return mixed_order(m["sizes"], mix.units, stop_samples=mix.stop_samples, **args)


def _sources(order: np.ndarray, sizes: list[int]) -> np.ndarray:
    return np.searchsorted(source_starts(sizes)[1:], order, side="right")


@PROPERTY
@given(mixes())
def test_every_prefix_keeps_each_sources_share_within_a_bound(m: dict[str, Any]) -> None:
    """After t samples, source s has served within (S + 1) / 2 of t * share_s (under 1 with
    two sources)."""
    order, units = _order(m), np.array(m["mix"].units)
    count = len(units)
    served = np.zeros((order.size, count))
    served[np.arange(order.size), _sources(order, m["sizes"])] = 1
    expected = np.arange(1, order.size + 1)[:, None] * (units / units.sum())[None, :]
    worst = np.abs(served.cumsum(axis=0) - expected).max()
    assert worst <= (count + 1) / 2
    if count == 2:
        assert worst < 1


@PROPERTY
@given(mixes())
def test_each_source_serves_each_row_once_per_pass_and_the_epoch_has_its_counts(
    m: dict[str, Any],
) -> None:
    """Within a source, item j is a row of pass j // n, and no row repeats within a pass;
    stop="first" serves the first source to run out whole and nothing twice."""
    sizes, mix = m["sizes"], m["mix"]
    order = _order(m)
    counts = mix_counts(sizes, mix.units, mix.stop_samples)
    assert order.size == sum(counts) == (mix.stop_samples or order.size)
    sources = _sources(order, sizes)
    starts = source_starts(sizes)
    for s, n in enumerate(sizes):
        rows = order[sources == s] - starts[s]
        assert rows.size == counts[s]
        assert ((rows >= 0) & (rows < n)).all()
        for first in range(0, rows.size, n):
            one_pass = rows[first : first + n]
            assert len(set(one_pass.tolist())) == one_pass.size
    if mix.stop_samples == 0:
        assert len(set(order.tolist())) == order.size
        assert any(c == n for c, n in zip(counts, sizes, strict=True))


@PROPERTY
@given(mixes(), st.data())
def test_the_order_is_a_function_of_the_options_and_another_epoch_or_seed_changes_it(
    m: dict[str, Any], data: st.DataObject
) -> None:
    order = _order(m)
    assert np.array_equal(_order(m), order)
    # Which source serves each entry does not depend on the seed or the epoch.
    other = _order(m, epoch=m["epoch"] + 1)
    assert np.array_equal(_sources(other, m["sizes"]), _sources(order, m["sizes"]))
    if m["shuffle"] and max(m["sizes"]) >= 8 and order.size >= 16:
        assert not np.array_equal(other, order)
        assert not np.array_equal(_order(m, seed=m["seed"] + 1), order)


def test_the_mixed_order_of_a_fixed_seed_and_epoch_never_changes() -> None:
    """Pinned: a change here reorders the epochs of every mixed job, resumed ones included."""
    mix = _mix([0.75, 0.25])
    order = mixed_order([6, 3], mix.units, seed=3, epoch=1, shuffle=True, stop_samples=0)
    assert order.tolist() == [0, 5, 7, 2, 4, 1, 6, 3]
    assert _sources(order, [6, 3]).tolist() == [0, 0, 1, 0, 0, 0, 1, 0]


def test_weights_three_to_one_give_batches_of_exactly_three_to_one() -> None:
    """0.75/0.25 over 3,000 and 1,000 rows: every run of 4 is three of one, one of the other,
    and the epoch serves both sources whole."""
    mix = _mix([0.75, 0.25])
    assert mix_counts([3000, 1000], mix.units, 0) == (3000, 1000)
    order = mixed_order([3000, 1000], mix.units, seed=0, epoch=0, shuffle=True, stop_samples=0)
    sources = _sources(order, [3000, 1000]).reshape(-1, 4)
    assert (sources.sum(axis=1) == 1).all()


@PROPERTY
@given(
    mixes(),
    st.integers(1, 6),
    st.integers(1, 4),
    st.booleans(),
    st.integers(0, 30),
    st.integers(1, 4),
)
def test_plans_deal_the_order_and_resume_from_any_global_cursor(
    m: dict[str, Any],
    batch_size: int,
    world_size: int,
    drop_last: bool,
    k: int,
    resume_world: int,
) -> None:
    """Rank r's batch k is the r-th run of global batch k (padded as for one split), grouped
    by source and within S + 1 samples of each source's share; after k global batches, any
    world size serves exactly the rest of the order (padding aside)."""
    sizes, mix = m["sizes"], m["mix"]
    options = SamplerOptions(
        batch_size=batch_size,
        shuffle=m["shuffle"],
        seed=m["seed"],
        world_size=world_size,
        drop_last=drop_last,
    )
    order = _order(m)
    padded = rest_of_order(order, options)
    per_rank = padded.size // world_size
    whole_batches = per_rank // batch_size
    global_batch = batch_size * world_size
    shares = np.array(mix.units) / sum(mix.units)
    starts = source_starts(sizes)
    plans = [
        plan_mix_epoch(sizes, mix, dataclasses.replace(options, rank=r), m["epoch"])
        for r in range(world_size)
    ]
    whole = min(k, plans[0].num_batches)
    before: list[int] = []
    for rank, plan in enumerate(plans):
        for b in range(plan.num_batches):
            batch = plan.batch(b)
            grouped = np.searchsorted(starts[1:], batch, side="right")
            assert (np.diff(grouped) >= 0).all(), "a batch's rows are grouped by source"
            if b < whole_batches:
                first = b * global_batch + rank * batch_size
                dealt = padded[first : first + batch_size]
            else:
                short = per_rank - whole_batches * batch_size
                first = whole_batches * global_batch + rank * short
                dealt = padded[first : first + short]
            assert Counter(batch.tolist()) == Counter(dealt.tolist())
            if (b + 1) * global_batch <= order.size:  # no padding in it
                counts = np.bincount(grouped, minlength=len(sizes))
                bound = 2 if len(sizes) == 2 else len(sizes) + 1
                assert (np.abs(counts - shares * batch.size) < bound).all(), (counts, shares)
            if b < whole:
                before += batch.tolist()
    consumed = whole * batch_size * world_size
    resumed = dataclasses.replace(options, world_size=resume_world, drop_last=False)
    after: list[int] = []
    for rank in range(resume_world):
        plan = plan_mix_epoch(
            sizes, mix, dataclasses.replace(resumed, rank=rank), m["epoch"], start=consumed
        )
        after += plan.positions.tolist()
    served = Counter(before + after)
    if consumed <= order.size:
        assert Counter(order.tolist()) - served == Counter(), "an entry of the epoch was lost"
        assert sum(served.values()) - order.size < resume_world, "padding past world_size - 1"


def test_stop_n_lets_a_small_source_start_a_new_pass_in_a_new_order() -> None:
    mix = _mix([1, 1], stop=40)
    assert mix_counts([100, 6], mix.units, 40) == (20, 20)
    order = mixed_order([100, 6], mix.units, seed=1, epoch=0, shuffle=True, stop_samples=40)
    small = order[_sources(order, [100, 6]) == 1] - 100
    passes = [small[i : i + 6].tolist() for i in range(0, 18, 6)]
    assert all(sorted(p) == list(range(6)) for p in passes)
    assert len({tuple(p) for p in passes}) > 1, "every pass has its own order"


def test_without_shuffle_each_source_serves_its_rows_in_order() -> None:
    mix = _mix([2, 1])
    order = mixed_order([4, 2], mix.units, seed=9, epoch=5, shuffle=False, stop_samples=0)
    assert order.tolist() == [0, 4, 1, 2, 5, 3]


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (lambda: MixOptions(sources=()), "the mix has no source"),
        (lambda: _mix([1.0, 0.0]), "weight=0.0"),
        (lambda: _mix([float("nan")]), "weights must be finite numbers > 0"),
        (lambda: _mix([-2.0]), "weights must be finite numbers > 0"),
        (lambda: _mix([1.0], stop=-1), "stop_samples=-1 must be 0"),
        (lambda: _mix([1.0] * 65), "at most 64"),
        (
            lambda: MixOptions(
                sources=(
                    MixSourceOptions(dataset="a", weight=1.0),
                    MixSourceOptions(dataset="a", split="train", weight=2.0),
                )
            ),
            "lists 'a:train' twice",
        ),
    ],
)
def test_a_bad_mix_is_an_invalid_argument_naming_the_problem(make: Any, message: str) -> None:
    with pytest.raises(InvalidArgument, match=message):
        make()


def test_a_source_without_rows_is_a_failed_precondition_and_weighted_sampling_refused() -> None:
    with pytest.raises(FailedPrecondition, match="source 1 of the mix has no verified samples"):
        mix_counts([5, 0], (1, 1), 0)
    weighted = SamplerOptions(batch_size=2, mode="weighted")
    with pytest.raises(InvalidArgument, match="cannot be used with a mix"):
        plan_mix_epoch([5, 5], _mix([1, 1]), weighted, 0)


def test_a_mix_token_round_trips_and_other_tokens_are_refused() -> None:
    pins = [("v1", "s1.10.10"), ("2024-01 (new)", "s1.99.3")]
    token = mix_token(pins)
    assert token.startswith("m1.")
    assert parse_mix_token(token, 2) == pins
    with pytest.raises(InvalidArgument, match="a mix of 2 sources, this mix has 3"):
        parse_mix_token(token, 3)
    for bad in ("s1.10.10", "m1.!!!", "m1." + "e30", ""):
        with pytest.raises(InvalidArgument, match="is not the snapshot of a mix"):
            parse_mix_token(bad, 2)
