"""Elastic resume in the sampler: the rest of an epoch, planned from the global number of
entries consumed, for a world size other than the one that started the epoch."""

from __future__ import annotations

import dataclasses
from collections import Counter
from typing import Any

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from batchd._wire.epoch import rest_of_epoch
from batchd_server.planning.sampling import (
    SAMPLING_MODES,
    EpochStart,
    SamplerOptions,
    num_batches,
    plan_epoch,
)

PROPERTY = settings(max_examples=200, deadline=None)
PERMUTING_MODES = ("uniform", "bucketed")


def _columns(n: int) -> dict[str, Any]:
    rng = np.random.default_rng(n)
    return {
        "weights": rng.choice([0.5, 1.0, 3.0], size=n),
        "labels": rng.integers(-1, 5, size=n),
        "lengths": rng.integers(0, 1000, size=n).astype(np.int32),
    }


def _served(
    n: int, options: SamplerOptions, epoch: int, *, batches: int | None = None, **kw: Any
) -> list[int]:
    """Positions every rank serves in its first ``batches`` batches (default: all)."""
    out: list[int] = []
    for rank in range(options.world_size):
        at = EpochStart(epoch, **kw)
        plan = plan_epoch(n, dataclasses.replace(options, rank=rank), at, **_columns(n))
        count = plan.num_batches if batches is None else batches
        out.extend(int(p) for k in range(count) for p in plan.batch(k))
    return out


@st.composite
def elastic(draw: st.DrawFn, modes: tuple[str, ...] = PERMUTING_MODES) -> dict[str, Any]:
    n = draw(st.integers(1, 200))
    options = SamplerOptions(
        batch_size=draw(st.integers(1, 8)),
        shuffle=draw(st.booleans()),
        seed=draw(st.integers(0, 1 << 32)),
        world_size=draw(st.integers(1, 4)),
        drop_last=draw(st.booleans()),
        mode=draw(st.sampled_from(modes)),
        bucket_batches=draw(st.integers(1, 3)),
    )
    whole = num_batches(n, options)
    return {
        "n": n,
        "options": options,
        "epoch": draw(st.integers(0, 5)),
        "k": draw(st.integers(0, max(whole - 1, 0))),
        "m": draw(st.integers(1, 4)),
    }


def _check_rest_once(n: int, options: SamplerOptions, counts: Counter[int], m: int) -> None:
    """Each sample served once; padding (no drop_last) repeats fewer than ``m``; drop_last
    leaves out fewer than a global batch of the new world size."""
    assert set(counts) <= set(range(n))
    if options.drop_last:
        assert max(counts.values(), default=1) == 1, "a sample served twice"
        assert n - len(counts) < options.batch_size * m, "more left out than a global batch"
    else:
        assert set(counts) == set(range(n)), "a sample never served"
        assert sum(counts.values()) - n < m, "more padding than world_size - 1"


@PROPERTY
@given(elastic())
def test_state_of_n_ranks_resumed_on_m_ranks_serves_the_rest_of_the_epoch_once(
    case: dict[str, Any],
) -> None:
    """N ranks serve k batches; M ranks serve the rest from k*B*N: each sample once."""
    n, options, epoch, k, m = case["n"], case["options"], case["epoch"], case["k"], case["m"]
    if num_batches(n, options) == 0:
        return
    before = _served(n, options, epoch, batches=k)
    consumed = k * options.batch_size * options.world_size
    resumed = dataclasses.replace(options, world_size=m)
    after = _served(n, resumed, epoch, start=consumed, order_world_size=options.world_size)
    _check_rest_once(n, options, Counter(before + after), m)
    per_rank = {
        plan_epoch(
            n,
            dataclasses.replace(resumed, rank=r),
            EpochStart(epoch, consumed, options.world_size),
            **_columns(n),
        ).num_batches
        for r in range(m)
    }
    expected = rest_of_epoch(
        n, consumed, batch_size=options.batch_size, world_size=m, drop_last=options.drop_last
    )[1]
    assert per_rank == {expected}, "ranks got unequal batch counts"


@PROPERTY
@given(elastic(), st.integers(1, 4), st.data())
def test_resuming_twice_n_to_m_to_l_still_serves_each_sample_once(
    case: dict[str, Any], l_ranks: int, data: st.DataObject
) -> None:
    """A job resumed on M, stopped again and resumed on L: still each sample once."""
    n, options, epoch, k, m = case["n"], case["options"], case["epoch"], case["k"], case["m"]
    if num_batches(n, options) == 0:
        return
    first = _served(n, options, epoch, batches=k)
    c1 = k * options.batch_size * options.world_size
    on_m = dataclasses.replace(options, world_size=m)
    order_ws = options.world_size
    left = num_batches(n, on_m, start=c1)
    k2 = data.draw(st.integers(0, max(left - 1, 0)))
    if left == 0:
        return
    second = _served(n, on_m, epoch, batches=k2, start=c1, order_world_size=order_ws)
    c2 = c1 + k2 * options.batch_size * m
    on_l = dataclasses.replace(options, world_size=l_ranks)
    third = _served(n, on_l, epoch, start=c2, order_world_size=order_ws)
    _check_rest_once(n, options, Counter(first + second + third), l_ranks)


@PROPERTY
@given(elastic(modes=SAMPLING_MODES))
def test_a_plan_from_whole_global_batches_is_the_tail_of_the_epochs_plan(
    case: dict[str, Any],
) -> None:
    """Same world size: the plan from k global batches is batches k.. of the whole plan."""
    n, options, epoch, k = case["n"], case["options"], case["epoch"], case["k"]
    consumed = k * options.batch_size * options.world_size
    for rank in range(options.world_size):
        mine = dataclasses.replace(options, rank=rank)
        whole = plan_epoch(n, mine, EpochStart(epoch), **_columns(n))
        rest = plan_epoch(n, mine, EpochStart(epoch, consumed), **_columns(n))
        assert rest.num_batches == max(whole.num_batches - k, 0)
        assert rest.positions.tolist() == whole.positions[k * options.batch_size :].tolist()


def test_a_start_past_the_epoch_leaves_no_batches() -> None:
    """Everything consumed (the saving job was in its padded last batch): nothing is left."""
    options = SamplerOptions(batch_size=4, world_size=3)
    assert num_batches(10, options, start=12) == 0
    assert plan_epoch(10, options, EpochStart(0, 12)).positions.size == 0
