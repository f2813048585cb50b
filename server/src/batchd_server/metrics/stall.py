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
    "TimingAllowance",
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


def clamp_client_seconds(value: float, batches: int = 1) -> float:
    """A duration a client reported (of ``batches`` batches), made safe to aggregate: NaN
    and negatives are 0, and infinities and absurd values are :data:`MAX_CLIENT_SECONDS`
    per batch."""
    if math.isnan(value) or value <= 0.0:
        return 0.0
    return min(value, MAX_CLIENT_SECONDS * batches)


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

    def add(self, now: float, wait_s: float, step_s: float, *, batches: int = 1) -> None:
        """One batch (or ``batches``, summed): the loop waited ``wait_s`` for it and then
        stepped for ``step_s``."""
        wait_s = clamp_client_seconds(wait_s, batches)
        step_s = clamp_client_seconds(step_s, batches)
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

    def add(
        self, dataset: str, wait_s: float, step_s: float, *, now: float, batches: int = 1
    ) -> None:
        """One batch of ``dataset`` (a label value; or ``batches``, summed): the loop waited,
        then stepped."""
        with self._lock:
            window = self._windows.get(dataset)
            if window is None:
                window = self._windows[dataset] = StallWindow(self.window_s)
            window.add(now, wait_s, step_s, batches=batches)
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
    """The stall ratio of the clients over the last few seconds: the demand the worker
    autoscaler reacts to (a minute, as the gauge shows, is too slow to act on).

    Each client counts once: its own ratio over the window (whatever its sessions and
    reports), and the signal is the mean of the clients' ratios, so one client that opens
    many sessions or reports many batches does not steer the pool for everyone. A client
    with no report in the window is dropped. Thread-safe."""

    def __init__(self, window_s: float = 5.0) -> None:
        self.window_s = window_s
        self._windows: dict[str, StallWindow] = {}
        self._lock = threading.Lock()

    def add(
        self, wait_s: float, step_s: float, *, now: float, client: str = "", batches: int = 1
    ) -> None:
        """``client``'s ``batches``: its loop waited ``wait_s`` and stepped ``step_s`` in all."""
        with self._lock:
            window = self._windows.get(client)
            if window is None:
                window = self._windows[client] = StallWindow(self.window_s)
        window.add(now, wait_s, step_s, batches=batches)

    def ratio(self, now: float) -> float | None:
        """The mean of the clients' ratios over the window ending at ``now``; None with no
        reports."""
        with self._lock:
            windows = list(self._windows.items())
        ratios = []
        for client, window in windows:
            ratio = window.ratio(now)
            if ratio is not None:
                ratios.append(ratio)
            elif window.empty(now):
                with self._lock:
                    if self._windows.get(client) is window:
                        del self._windows[client]
        return sum(ratios) / len(ratios) if ratios else None

    def current(self) -> float | None:
        """The ratio over the window ending now (``time.monotonic``); None with no reports."""
        return self.ratio(time.monotonic())

    def __len__(self) -> int:
        with self._lock:
            return len(self._windows)


RECENT_STALL: Final = RecentStall()


def record_client_batch(
    dataset: str, wait_s: float, step_s: float, *, now: float, client: str = ""
) -> None:
    """One batch as ``client`` reported it (see NOTE [ Client wait histogram ])."""
    record_client_timings(dataset, [wait_s], [step_s], now=now, client=client)


MAX_TIMINGS_PER_ACK: Final = 4096
"""Batch timings one ack may carry; more is a broken client, and the rest are ignored."""


class TimingAllowance:
    """How many batch timings a session's client may still report: one per batch delivered
    to it and not reported on yet (at most :data:`MAX_TIMINGS_PER_ACK` saved up). A client
    reports each batch its loop took once, so an honest one is never cut; timings beyond
    what was delivered are dropped, which bounds what one ack costs the server to the
    batches it was sent. Thread-safe: the stream delivers, the ack reader takes."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._left = 0

    def delivered(self, batches: int = 1) -> None:
        """``batches`` more went out to the client."""
        with self._lock:
            self._left = min(self._left + batches, MAX_TIMINGS_PER_ACK)

    def take(self, reported: int) -> int:
        """How many of ``reported`` timings to accept now (and count as reported)."""
        with self._lock:
            accepted = max(0, min(reported, self._left))
            self._left -= accepted
            return accepted


def record_client_timings(
    dataset: str,
    waits: Sequence[float],
    steps: Sequence[float],
    *,
    now: float,
    client: str = "",
    allowance: TimingAllowance | None = None,
) -> int:
    """The per-batch timings of one ack of ``client``'s (pairs up to the shorter list, at
    most MAX_TIMINGS_PER_ACK, and with ``allowance`` at most what it allows: a session's
    acks pass its stream's); how many were accepted. The windows get one entry per ack
    (their ratio is a ratio of sums), the histograms one observation per batch."""
    count = min(len(waits), len(steps), MAX_TIMINGS_PER_ACK)
    if allowance is not None:
        count = allowance.take(count)
    if count <= 0:
        return 0
    dataset = dataset_label(dataset)
    wait_hist = CLIENT_WAIT_SECONDS.labels(dataset=dataset)
    step_hist = CLIENT_STEP_SECONDS.labels(dataset=dataset)
    wait_total = step_total = 0.0
    for wait_s, step_s in itertools.islice(zip(waits, steps, strict=False), count):
        wait_s, step_s = clamp_client_seconds(wait_s), clamp_client_seconds(step_s)
        wait_hist.observe(wait_s)
        step_hist.observe(step_s)
        wait_total += wait_s
        step_total += step_s
    STALL_RATIOS.add(dataset, wait_total, step_total, now=now, batches=count)
    RECENT_STALL.add(wait_total, step_total, now=now, client=client, batches=count)
    return count
