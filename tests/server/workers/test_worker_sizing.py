"""``--workers MIN..MAX``: the parsing and the autoscaler's rules, decided on signals alone
(``sizing.decide`` is pure); the pool's growing and shrinking with real processes is in
``test_pool_dispatch.py``, and through a served epoch in ``tests/e2e/test_autoscale.py``."""

from __future__ import annotations

import dataclasses

import pytest

from batchd_server.config import ServerConfig
from batchd_server.workers.sizing import (
    ScalingPolicy,
    Signals,
    WorkerRange,
    cpu_times,
    decide,
    memory_ceiling,
    parse_worker_range,
)

POLICY = ScalingPolicy()
RANGE = WorkerRange(1, 4)
DEMAND = Signals(size=2, busy=2.0, queued_share=1.0, idle_cores=1.5, stall_ratio=0.4, ceiling=4)
"""Trainers stall, work waits for a worker all the time, a core and a half idle."""
QUIET = Signals(size=3, busy=1.0, queued_share=0.0, idle_cores=2.0, stall_ratio=0.0, ceiling=4)
"""One of three workers busy, nothing queued, nobody waiting."""


@pytest.mark.parametrize(
    ("text", "expected"),
    [("4", WorkerRange(4, 4)), ("1..8", WorkerRange(1, 8)), (" 2 .. 3 ", WorkerRange(2, 3))],
)
def test_a_count_or_a_range_parses(text: str, expected: WorkerRange) -> None:
    assert parse_worker_range(text) == expected


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("0", "'0' must be >= 1"),
        ("3..2", "'3..2' must be MIN..MAX with MAX >= MIN"),
        ("two", "not a worker count; write a number"),
        ("1..", "not a worker count"),
        ("1-4", "not a worker count"),
    ],
)
def test_a_bad_count_says_what_to_write(text: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        parse_worker_range(text)


def test_a_plain_count_from_python_is_a_fixed_range() -> None:
    config = ServerConfig(workers=3)  # type: ignore[arg-type]
    assert config.workers == WorkerRange(3, 3) and config.workers.fixed
    assert str(config.workers) == "3" and str(WorkerRange(1, 2)) == "1..2"


def test_demand_with_idle_cores_adds_one_worker() -> None:
    assert decide(DEMAND, RANGE, POLICY, window="grow") == (3, "stall")
    # No client reports timings (an old client): queued work and idle cores suffice.
    unknown = dataclasses.replace(DEMAND, stall_ratio=None)
    assert decide(unknown, RANGE, POLICY, window="grow") == (3, "stall")


@pytest.mark.parametrize(
    ("change", "why"),
    [
        ({"stall_ratio": 0.01}, "trainers do not wait: more workers would not help them"),
        ({"queued_share": 0.2}, "work rarely waits for a worker: the workers keep up"),
        ({"idle_cores": 0.3}, "no idle core: another worker would only share the same CPUs"),
        ({"size": 4}, "at MAX"),
        ({"ceiling": 2}, "at what the CPUs and memory afford"),
    ],
)
def test_no_growth_without_every_reason(change: dict[str, float], why: str) -> None:
    assert decide(dataclasses.replace(DEMAND, **change), RANGE, POLICY, window="grow") is None, why


def test_the_grow_window_never_shrinks_and_the_shrink_window_never_grows() -> None:
    assert decide(QUIET, RANGE, POLICY, window="grow") is None
    assert decide(DEMAND, RANGE, POLICY, window="shrink") is None


def test_an_unneeded_worker_is_let_go_but_never_below_min() -> None:
    assert decide(QUIET, RANGE, POLICY, window="shrink") == (2, "idle")
    assert decide(QUIET, WorkerRange(3, 4), POLICY, window="shrink") is None
    # Busy beyond 3/4 of one fewer worker: the rest would be at their limit; stay.
    busy = dataclasses.replace(QUIET, busy=1.8)
    assert decide(busy, RANGE, POLICY, window="shrink") is None
    # Work waiting for a worker in more than a tenth of the window: still needed.
    queued = dataclasses.replace(QUIET, queued_share=0.3)
    assert decide(queued, RANGE, POLICY, window="shrink") is None


def test_a_size_the_machine_no_longer_affords_shrinks_even_when_busy() -> None:
    squeezed = dataclasses.replace(DEMAND, size=3, ceiling=2)
    assert decide(squeezed, RANGE, POLICY, window="shrink") == (2, "limits")


def test_cpu_times_and_memory_ceiling_read_this_machine() -> None:
    times = cpu_times()
    assert times is not None and 0 <= times[0] <= times[1]
    assert cpu_times(frozenset({10_000})) is None  # no such CPU
    assert memory_ceiling(2, 0) > 1_000
    # A worker as large as a petabyte: no more fit than those running.
    assert memory_ceiling(2, 1 << 50) == 2
