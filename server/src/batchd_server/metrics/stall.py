"""Whether the trainers wait for data: what clients report of each batch, and the stall ratio.

NOTE [ Client wait histogram ]
Whether the GPU starves is known only in the trainer: each client measures, per batch, how
long ``next()`` blocked (wait) and how long the loop worked before asking for it (step), and
sends those pairs with its acks (``Ack.batch_wait_s`` / ``batch_step_s``). Each pair is one
observation of ``batchd_client_wait_seconds`` and ``batchd_client_step_seconds`` and feeds
``batchd_data_stall_ratio`` (wait / (wait + step) over the last minute), per dataset.
Values are clamped (:func:`clamp_client_seconds`): a client cannot poison the aggregates.
A dataset no client reported on for a whole minute has no ratio: its window and its series
are dropped (:class:`StallRatios`), so finished jobs neither hold memory nor show a stale one.
"""

from __future__ import annotations

import contextlib
import itertools
import math
import threading
import time
from collections import deque
from collections.abc import Sequence
from typing import Final

from prometheus_client import Gauge, Histogram

from batchd_server.metrics.registry import CLIENT_BUCKETS, REGISTRY, dataset_label

__all__ = [
    "CLIENT_STEP_SECONDS",
    "CLIENT_WAIT_SECONDS",
    "DATA_STALL_RATIO",
    "MAX_CLIENT_SECONDS",
    "MAX_TIMINGS_PER_ACK",
    "RECENT_STALL",
    "STALL_RATIOS",
    "RecentStall",
    "StallRatios",
    "StallWindow",
    "clamp_client_seconds",
    "record_client_batch",
    "record_client_timings",
]

CLIENT_WAIT_SECONDS = Histogram(
    "batchd_client_wait_seconds",
    "Time a training loop's next() blocked for a batch, per batch, as clients report it.",
    ["dataset"],
    buckets=CLIENT_BUCKETS,
    registry=REGISTRY,
)
CLIENT_STEP_SECONDS = Histogram(
    "batchd_client_step_seconds",
    "Time a training loop spent between two batches (its step), per batch, as clients report it.",
    ["dataset"],
    buckets=CLIENT_BUCKETS,
    registry=REGISTRY,
)
DATA_STALL_RATIO = Gauge(
    "batchd_data_stall_ratio",
    "Share of training-loop time spent waiting for data over the last minute: "
    "wait / (wait + step). Near 0: the loader keeps up; near 1: the GPU starves.",
    ["dataset"],
    registry=REGISTRY,
)
MAX_CLIENT_SECONDS: Final = 3600.0
"""A client-reported duration is clamped to this: one batch never takes an hour to wait for."""


def clamp_client_seconds(value: float) -> float:
    """A duration a client reported, made safe to aggregate: NaN and negatives are 0, and
    infinities and absurd values are :data:`MAX_CLIENT_SECONDS`."""
    if math.isnan(value) or value <= 0.0:
        return 0.0
    return min(value, MAX_CLIENT_SECONDS)


class StallWindow:
    """The data-stall ratio ``wait / (wait + step)`` over the last ``window_s`` seconds.

    Pure bookkeeping: the caller passes the clock, so it is tested without sleeping.
    Thread-safe.
    """

    def __init__(self, window_s: float = 60.0) -> None:
        if not window_s > 0:
            raise ValueError(f"window_s={window_s} must be > 0")
        self.window_s = window_s
        self._entries: deque[tuple[float, float, float]] = deque()
        self._wait_s = 0.0
        self._step_s = 0.0
        self._lock = threading.Lock()

    def add(self, now: float, wait_s: float, step_s: float) -> None:
        """One batch: the loop waited ``wait_s`` for it and then stepped for ``step_s``."""
        wait_s, step_s = clamp_client_seconds(wait_s), clamp_client_seconds(step_s)
        with self._lock:
            self._entries.append((now, wait_s, step_s))
            self._wait_s += wait_s
            self._step_s += step_s
            self._expire(now)

    def empty(self, now: float) -> bool:
        """Whether no batch of the window ending at ``now`` is left."""
        with self._lock:
            self._expire(now)
            return not self._entries

    def ratio(self, now: float) -> float | None:
        """The ratio over the window ending at ``now``; None when it holds no time at all."""
        with self._lock:
            self._expire(now)
            if not self._entries:
                # Re-sum from nothing: floating-point residue must not outlive the entries.
                self._wait_s = self._step_s = 0.0
                return None
            total = self._wait_s + self._step_s
            return None if total <= 0.0 else min(1.0, max(0.0, self._wait_s / total))

    def _expire(self, now: float) -> None:
        horizon = now - self.window_s
        while self._entries and self._entries[0][0] <= horizon:
            _, wait_s, step_s = self._entries.popleft()
            self._wait_s -= wait_s
            self._step_s -= step_s


class StallRatios:
    """A :class:`StallWindow` per ``dataset`` label, each setting its series of ``gauge``.

    A window that holds no batch (nobody reported on its dataset for ``window_s``) is
    dropped with its series, looked for at most once per ``window_s`` (of the callers'
    clock): memory follows the datasets being trained on, not every one ever served.
    Thread-safe.
    """

    def __init__(self, gauge: Gauge, window_s: float = 60.0) -> None:
        self._gauge = gauge
        self.window_s = window_s
        self._windows: dict[str, StallWindow] = {}
        self._lock = threading.Lock()
        self._swept: float | None = None

    def __len__(self) -> int:
        with self._lock:
            return len(self._windows)

    def add(self, dataset: str, wait_s: float, step_s: float, *, now: float) -> None:
        """One batch of ``dataset`` (a label value): the loop waited, then stepped."""
        with self._lock:
            window = self._windows.get(dataset)
            if window is None:
                window = self._windows[dataset] = StallWindow(self.window_s)
            window.add(now, wait_s, step_s)
            ratio = window.ratio(now)
            if ratio is not None:
                self._gauge.labels(dataset=dataset).set(ratio)
            # Either way round: a caller's clock that jumps back must not stop the sweeps.
            if self._swept is None or abs(now - self._swept) >= self.window_s:
                self._swept = now
                self._sweep(now)

    def _sweep(self, now: float) -> None:
        for dataset in [d for d, w in self._windows.items() if w.empty(now)]:
            del self._windows[dataset]
            with contextlib.suppress(KeyError):  # never set: no time in the window at all
                self._gauge.remove(dataset)


STALL_RATIOS: Final = StallRatios(DATA_STALL_RATIO)
"""The process's stall windows, behind ``batchd_data_stall_ratio``."""


class RecentStall:
    """The stall ratio of every client together over the last few seconds: the demand the
    worker autoscaler reacts to (a minute, as the gauge shows, is too slow to act on)."""

    def __init__(self, window_s: float = 5.0) -> None:
        self._window = StallWindow(window_s)

    def add(self, wait_s: float, step_s: float, *, now: float) -> None:
        self._window.add(now, wait_s, step_s)

    def current(self) -> float | None:
        """The ratio over the window ending now (``time.monotonic``); None with no reports."""
        return self._window.ratio(time.monotonic())


RECENT_STALL: Final = RecentStall()


def record_client_batch(dataset: str, wait_s: float, step_s: float, *, now: float) -> None:
    """One batch as a client reported it (see NOTE [ Client wait histogram ])."""
    dataset = dataset_label(dataset)
    wait_s, step_s = clamp_client_seconds(wait_s), clamp_client_seconds(step_s)
    CLIENT_WAIT_SECONDS.labels(dataset=dataset).observe(wait_s)
    CLIENT_STEP_SECONDS.labels(dataset=dataset).observe(step_s)
    STALL_RATIOS.add(dataset, wait_s, step_s, now=now)
    RECENT_STALL.add(wait_s, step_s, now=now)


MAX_TIMINGS_PER_ACK: Final = 4096
"""Batch timings one ack may carry; more is a broken client, and the rest are ignored."""


def record_client_timings(
    dataset: str, waits: Sequence[float], steps: Sequence[float], *, now: float
) -> None:
    """The per-batch timings of one ack (pairs up to the shorter list, at most
    MAX_TIMINGS_PER_ACK)."""
    for wait_s, step_s in itertools.islice(zip(waits, steps, strict=False), MAX_TIMINGS_PER_ACK):
        record_client_batch(dataset, wait_s, step_s, now=now)
