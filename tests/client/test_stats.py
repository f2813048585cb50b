"""The Loader's clock: what it counts as wait and step, and what it hands the server."""

from __future__ import annotations

import math

import pytest

from batchd._stats import MAX_PENDING_TIMINGS, BatchTiming, LoopClock


class FakeClock:
    """A clock the test moves by hand."""

    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_wait_is_time_in_next_and_step_is_time_between_batches() -> None:
    """Wait runs from asking to getting a batch; step from getting one to asking again."""
    t = FakeClock()
    clock = LoopClock(t)
    clock.iteration_started()
    t.now += 0.5  # the first batch: opening the stream counts as waiting
    clock.handed(rows=4)
    t.now += 2.0  # the training step
    clock.asked()
    t.now += 0.25
    clock.handed(rows=3)
    assert clock.take_pending() == [BatchTiming(0.5, 0.0), BatchTiming(0.25, 2.0)]
    assert clock.take_pending() == []
    stats = clock.stats()
    assert (stats.batches, stats.samples) == (2, 7)
    assert stats.wait_s == 0.75 and stats.step_s == 2.0
    assert stats.stall_ratio == 0.75 / 2.75
    assert stats.time_to_first_batch_s == 0.5
    assert stats.wait_p50_s == 0.375 and stats.step_p99_s is not None


def test_a_new_iteration_does_not_count_the_pause_before_it_as_a_step() -> None:
    """Time between two epochs (evaluation, checkpointing) is neither wait nor step."""
    t = FakeClock()
    clock = LoopClock(t)
    clock.iteration_started()
    clock.handed(rows=1)
    t.now += 60.0
    clock.iteration_started()
    t.now += 0.1
    clock.handed(rows=1)
    last = clock.take_pending()[-1]
    assert last.step_s == 0.0 and last.wait_s == pytest.approx(0.1)
    assert clock.stats().time_to_first_batch_s == 0.0


def test_a_clock_going_backwards_never_gives_negative_or_nan_times() -> None:
    """A clock that jumps back yields zeros, not negative durations."""
    t = FakeClock()
    clock = LoopClock(t)
    clock.iteration_started()
    t.now -= 5.0
    clock.handed(rows=1)
    t.now = math.nan
    clock.asked()
    clock.handed(rows=1)
    assert all(x.wait_s >= 0 and x.step_s >= 0 for x in clock.take_pending())
    assert clock.stats().wait_s == 0.0


def test_pending_timings_are_bounded_when_the_server_is_not_told() -> None:
    """A loop that never acks cannot grow the pending list without bound."""
    clock = LoopClock(FakeClock())
    clock.iteration_started()
    for _ in range(MAX_PENDING_TIMINGS + 10):
        clock.handed(rows=1)
    assert len(clock.take_pending()) == MAX_PENDING_TIMINGS
    assert clock.stats().batches == MAX_PENDING_TIMINGS + 10


def test_stats_before_any_batch_say_none_rather_than_zero() -> None:
    """No batch yet: percentiles, ratio and first-batch time are None."""
    stats = LoopClock().stats()
    assert stats.batches == 0 and stats.stall_ratio is None
    assert stats.wait_p50_s is None and stats.time_to_first_batch_s is None
