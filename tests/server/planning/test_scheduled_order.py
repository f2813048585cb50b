"""The schedule math of a mix: weights by global step ("step" and "linear"), each global
batch's composition by carried credits, and plans that stay a pure function of the options,
so a resume before, at or after a change (at any world size) replays the same entries."""

from __future__ import annotations

import itertools
from collections import Counter

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from batchd._wire.schedule import WeightSchedule, apportion
from batchd.errors import InvalidArgument
from batchd_server.planning.mixing import (
    SHARE_RESOLUTION,
    MixOptions,
    MixSourceOptions,
    mix_counts,
    plan_mix_epoch,
)
from batchd_server.planning.sampling import SamplerOptions
from batchd_server.planning.schedule import batch_counts

R = SHARE_RESOLUTION
BASE = (0.7, 0.3)
TWO_CHANGES = ((10, (0.5, 0.5)), (20, (0.3, 0.7)))


def _mix(base: tuple[float, ...], points, interpolate: str = "step", stop: int = 0) -> MixOptions:  # type: ignore[no-untyped-def]
    sources = tuple(MixSourceOptions(dataset=f"d{i}", weight=w) for i, w in enumerate(base))
    schedule = WeightSchedule(base, tuple(points), interpolate)
    return MixOptions(sources=sources, stop_samples=stop, schedule=schedule)


def test_step_weights_are_the_last_point_at_or_before_the_step_and_the_base_before() -> None:
    """ "step": base before step 10, the first point's weights from 10 to 19, the last's on."""
    schedule = WeightSchedule(BASE, TWO_CHANGES, "step")
    assert schedule.shares_at(0) == pytest.approx(BASE)
    assert schedule.shares_at(9) == pytest.approx(BASE)
    assert schedule.shares_at(10) == pytest.approx((0.5, 0.5))
    assert schedule.shares_at(19) == pytest.approx((0.5, 0.5))
    assert schedule.shares_at(20) == pytest.approx((0.3, 0.7))
    assert schedule.shares_at(10**9) == pytest.approx((0.3, 0.7))
    assert schedule.units_at(10, R) == (R // 2, R // 2)
    assert sum(schedule.units_at(3, R)) == R


def test_linear_weights_are_the_line_between_consecutive_points() -> None:
    """ "linear": base before the first point, halfway between the points at step 15."""
    schedule = WeightSchedule(BASE, TWO_CHANGES, "linear")
    assert schedule.shares_at(9) == pytest.approx(BASE)
    assert schedule.shares_at(10) == pytest.approx((0.5, 0.5))
    assert schedule.shares_at(15) == pytest.approx((0.4, 0.6))
    assert schedule.shares_at(20) == pytest.approx((0.3, 0.7))
    units = schedule.units_at(15, R)
    assert sum(units) == R and abs(units[0] / R - 0.4) < 1e-6


def test_apportion_is_exact_and_gives_a_zero_weight_nothing() -> None:
    """Integer shares sum to the seats, each within one of its quota, 0 for a weight of 0."""
    assert apportion([1, 1, 1], 10) == (4, 3, 3)
    assert apportion([0.7, 0.3], 10) == (7, 3)
    assert apportion([0.0, 2.0, 1.0], 7) == (0, 5, 2)


@pytest.mark.parametrize(
    ("points", "interpolate", "message"),
    [
        (((10, (0.5, 0.5)), (10, (0.3, 0.7))), "step", "steps must increase strictly"),
        (((20, (0.5, 0.5)), (10, (0.3, 0.7))), "step", "step 10 follows step 20"),
        (((-1, (0.5, 0.5)),), "step", "step -1 must be an integer from 0"),
        (((10, (0.5, -0.1)),), "step", "has weight -0.1; weights must be finite numbers >= 0"),
        (((10, (0.5, float("nan"))),), "step", "has weight nan"),
        (((10, (0.0, 0.0)),), "step", "weighs every source 0"),
        (((10, (1.0,)),), "step", "has 1 weights; the mix has 2 sources"),
        (((10, (0.5, 0.5)),), "cubic", "interpolate='cubic' must be one of step, linear"),
        ((), "step", "needs at least one"),
    ],
)
def test_a_bad_schedule_is_refused_with_a_message_naming_what_is_wrong(
    points: tuple[tuple[int, tuple[float, ...]], ...], interpolate: str, message: str
) -> None:
    """Steps out of order, negative or NaN weights, all zeros, the wrong number of weights
    and unknown interpolations are refused, each with the value at fault."""
    with pytest.raises(InvalidArgument, match=message):
        WeightSchedule(BASE, points, interpolate)


def test_a_schedule_whose_base_is_not_the_sources_weights_is_refused() -> None:
    """The base of the schedule is the mix's own weights."""
    sources = (MixSourceOptions(dataset="a", weight=1.0), MixSourceOptions(dataset="b", weight=1.0))
    with pytest.raises(InvalidArgument, match="base weights"):
        MixOptions(sources=sources, schedule=WeightSchedule(BASE, TWO_CHANGES))


def _windows(counts: np.ndarray, bounds: list[int]) -> list[np.ndarray]:
    """Each window's share of each source, from batch ``bounds[i]`` to ``bounds[i + 1]``."""
    shares = []
    for a, b in itertools.pairwise(bounds):
        totals = counts[a:b].sum(axis=0)
        shares.append(totals / totals.sum())
    return shares


@pytest.mark.parametrize("global_batch", [1, 7, 64])
def test_each_window_of_a_step_schedule_keeps_its_weights_within_3_percent(
    global_batch: int,
) -> None:
    """Two changes: every window's shares are within 3% of the weights in force there, and
    every global batch has exactly its entries."""
    schedule = WeightSchedule(BASE, ((100, (0.5, 0.5)), (250, (0.2, 0.8))))
    counts = batch_counts(
        schedule, length=400 * global_batch, global_batch=global_batch, first_step=0, resolution=R
    )
    assert (counts.sum(axis=1) == global_batch).all()
    wanted = [BASE, (0.5, 0.5), (0.2, 0.8)]
    for shares, weights in zip(_windows(counts, [0, 100, 250, 400]), wanted, strict=True):
        assert np.abs(shares - np.array(weights)).max() <= 0.03, (shares, weights)


def test_each_window_of_a_linear_schedule_keeps_the_weights_in_force_within_3_percent() -> None:
    """Along a ramp from 0.7 to 0.1 over 300 steps, every 10 batches' shares are within 3% of
    the mean of the weights in force over them."""
    schedule = WeightSchedule(BASE, ((0, (0.7, 0.3)), (300, (0.1, 0.9))), "linear")
    counts = batch_counts(schedule, length=400 * 16, global_batch=16, first_step=0, resolution=R)
    for first in range(0, 400, 10):
        got = counts[first : first + 10].sum(axis=0) / (10 * 16)
        wanted = np.mean([schedule.shares_at(b) for b in range(first, first + 10)], axis=0)
        assert np.abs(got - wanted).max() <= 0.03, (first, got, wanted)


def test_a_source_weighed_zero_in_a_window_gets_nothing_there() -> None:
    """A 0 weight from step 5 to 9 keeps the source out of those batches entirely."""
    schedule = WeightSchedule((0.5, 0.5), ((5, (1.0, 0.0)), (10, (0.5, 0.5))))
    counts = batch_counts(schedule, length=15 * 9, global_batch=9, first_step=0, resolution=R)
    assert (counts[5:10, 1] == 0).all() and (counts[5:10, 0] == 9).all()
    assert counts[10:, 1].sum() > 0


@settings(max_examples=60, deadline=None)
@given(
    base=st.lists(st.floats(0.05, 10.0), min_size=2, max_size=4),
    data=st.data(),
    global_batch=st.integers(1, 40),
    interpolate=st.sampled_from(["step", "linear"]),
)
def test_every_source_stays_within_two_samples_of_its_scheduled_share(
    base: list[float], data: st.DataObject, global_batch: int, interpolate: str
) -> None:
    """Property: after every global batch, each source's count since the epoch's start is
    within 2 samples of the sum of its shares in force (so no window drifts)."""
    count = len(base)
    steps = sorted(set(data.draw(st.lists(st.integers(0, 60), min_size=1, max_size=4))))
    points = []
    for step in steps:
        weights = data.draw(st.lists(st.floats(0.0, 10.0), min_size=count, max_size=count))
        if not any(w > 0 for w in weights):
            weights[0] = 1.0
        points.append((step, tuple(weights)))
    schedule = WeightSchedule(tuple(base), tuple(points), interpolate)
    batches = 80
    counts = batch_counts(
        schedule,
        length=batches * global_batch,
        global_batch=global_batch,
        first_step=0,
        resolution=R,
    )
    target = np.cumsum(
        [np.array(schedule.units_at(b, R)) * global_batch / R for b in range(batches)], axis=0
    )
    assert np.abs(np.cumsum(counts, axis=0) - target).max() <= 2.0
    assert (counts >= 0).all()


def _sources_of(positions: np.ndarray, sizes: list[int]) -> np.ndarray:
    return (positions >= sizes[0]).astype(np.int64)


SIZES = [3000, 1000]


def test_a_scheduled_epoch_has_the_base_weights_length_and_each_pass_once() -> None:
    """The epoch is as long as the base weights make it; a source the schedule favours runs
    out and begins a new pass, and no row repeats within a pass."""
    mix = _mix(BASE, TWO_CHANGES)
    options = SamplerOptions(batch_size=50, seed=3)
    plan = plan_mix_epoch(SIZES, mix, options, 0)
    length = sum(mix_counts(SIZES, mix.units, 0))
    assert plan.positions.size == length
    small = [int(p) - SIZES[0] for p in plan.positions if p >= SIZES[0]]
    assert len(small) > SIZES[1], "the schedule favours the small source past its rows"
    for start in range(0, len(small), SIZES[1]):
        one_pass = small[start : start + SIZES[1]]
        assert len(set(one_pass)) == len(one_pass)
    big = [int(p) for p in plan.positions if p < SIZES[0]]
    assert len(set(big)) == len(big)


@pytest.mark.parametrize("interpolate", ["step", "linear"])
@pytest.mark.parametrize("resume_at", [5, 10, 15, 20, 33])
def test_a_plan_from_before_at_or_after_a_change_is_the_tail_of_the_whole_epoch(
    interpolate: str, resume_at: int
) -> None:
    """Resuming at batch 5, 10 (a change), 15, 20 (another) or 33 replays the same batches,
    with or without drop_last."""
    mix = _mix(BASE, TWO_CHANGES, interpolate)
    drop_last = resume_at % 2 == 1
    options = SamplerOptions(batch_size=25, seed=9, world_size=2, rank=1, drop_last=drop_last)
    whole = plan_mix_epoch(SIZES, mix, options, 2)
    rest = plan_mix_epoch(SIZES, mix, options, 2, start=resume_at * 25 * 2)
    assert np.array_equal(rest.positions, whole.positions[resume_at * 25 :])


def test_an_elastic_resume_serves_the_same_entries_as_the_order_it_began() -> None:
    """Saved at 4 ranks after 12 global batches, resumed on 3: the 3 ranks' rest together is
    exactly the 4-rank order's rest (padding aside); the order keeps its world size."""
    mix = _mix(BASE, TWO_CHANGES)
    # The 4-rank order itself: one rank dealt the order built for 4.
    whole = plan_mix_epoch(
        SIZES, mix, SamplerOptions(batch_size=10, seed=1), 0, order_world_size=4
    ).positions
    four = [
        plan_mix_epoch(SIZES, mix, SamplerOptions(batch_size=10, seed=1, rank=r, world_size=4), 0)
        for r in range(4)
    ]
    assert np.array_equal(four[2].batch(7), whole[7 * 40 + 20 : 7 * 40 + 30]), "rank 2's run"
    consumed = 12 * 10 * 4
    three = [
        plan_mix_epoch(
            SIZES,
            mix,
            SamplerOptions(batch_size=10, seed=1, rank=r, world_size=3),
            0,
            start=consumed,
            order_world_size=4,
        )
        for r in range(3)
    ]
    rest = Counter(int(x) for p in three for x in p.positions)
    expected = Counter(int(x) for x in whole[consumed:])
    assert expected <= rest and sum((rest - expected).values()) < 3, "padding at most 2"


def test_the_step_counter_goes_on_across_epochs() -> None:
    """Epoch 1 begins at step len(epoch 0) = 41: with one change at step 30, epoch 0 changes
    at its batch 30 and all of epoch 1 has the changed weights."""
    mix = _mix((0.5, 0.5), ((30, (0.25, 0.75)),))
    options = SamplerOptions(batch_size=50, seed=0)
    first = plan_mix_epoch(SIZES, mix, options, 0)
    second = plan_mix_epoch(SIZES, mix, options, 1)
    assert first.num_batches == second.num_batches == 41
    early = _sources_of(first.positions, SIZES)
    assert early[: 30 * 50].mean() == pytest.approx(0.5, abs=0.01)
    assert early[30 * 50 :].mean() == pytest.approx(0.75, abs=0.01)
    assert _sources_of(second.positions, SIZES).mean() == pytest.approx(0.75, abs=0.01)


def test_the_same_options_give_the_same_scheduled_plan() -> None:
    """Deterministic in (seed, epoch, schedule); another seed reorders it."""
    mix = _mix(BASE, TWO_CHANGES, "linear")
    options = SamplerOptions(batch_size=32, seed=5)
    a = plan_mix_epoch(SIZES, mix, options, 1).positions
    b = plan_mix_epoch(SIZES, mix, options, 1).positions
    other = plan_mix_epoch(SIZES, mix, SamplerOptions(batch_size=32, seed=6), 1).positions
    assert np.array_equal(a, b) and not np.array_equal(a, other)


def test_an_absurd_order_world_size_is_refused_not_planned() -> None:
    """A stream's order_world_size comes from the client: out of range, it is refused."""
    mix = _mix(BASE, TWO_CHANGES)
    options = SamplerOptions(batch_size=50, seed=0)
    with pytest.raises(InvalidArgument, match="order_world_size=100000 must be from 1 to 65536"):
        plan_mix_epoch(SIZES, mix, options, 0, order_world_size=100_000)


def test_an_epoch_of_too_many_global_batches_is_refused_with_the_remedy() -> None:
    """stop=2**23 in global batches of 1: refused, naming the batch size and stop."""
    mix = _mix(BASE, TWO_CHANGES, stop=1 << 23)
    with pytest.raises(InvalidArgument, match="use a larger batch_size, a smaller stop"):
        plan_mix_epoch(SIZES, mix, SamplerOptions(batch_size=1, seed=0), 0)
