"""How long the training loop waits for data, measured where it waits: in the trainer.

Per batch the Loader records two durations: ``wait`` -- how long ``next()`` blocked before
the batch was there, and ``step`` -- how long the loop worked between taking the previous
batch and asking for this one (its training step). Their ratio is the one number that says
whether the GPU starves: ``wait / (wait + step)``. The Loader keeps a summary for
:meth:`batchd.Loader.stats` and sends each batch's pair to the server with its acks, where
it becomes ``batchd_client_wait_seconds``, ``batchd_client_step_seconds`` and
``batchd_data_stall_ratio``.
"""

from __future__ import annotations

import math
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Final

import numpy as np
import numpy.typing as npt

from batchd._accounting import SourceStats

__all__ = ["MAX_PENDING_TIMINGS", "BatchTiming", "LoaderStats", "LoopClock"]

MAX_PENDING_TIMINGS: Final = 4096
"""Timings kept for the server at most; older ones are dropped (counted in the stats)."""
_HISTORY: Final = 10_000
"""Batches the percentiles are taken over (the most recent)."""


@dataclass(frozen=True)
class BatchTiming:
    """One batch's ``wait_s`` and ``step_s``, in seconds."""

    wait_s: float
    step_s: float


@dataclass(frozen=True)
class LoaderStats:
    """What :meth:`batchd.Loader.stats` returns: the training loop's view of its data.

    Durations in seconds; percentiles over the most recent 10,000 batches (None before the
    first batch).
    """

    batches: int
    samples: int
    wait_s: float
    """Total time ``next()`` blocked waiting for a batch."""
    step_s: float
    """Total time the loop spent between taking a batch and asking for the next."""
    wait_p50_s: float | None
    wait_p90_s: float | None
    wait_p99_s: float | None
    step_p50_s: float | None
    step_p90_s: float | None
    step_p99_s: float | None
    stall_ratio: float | None
    """``wait_s / (wait_s + step_s)``: near 0 the loader keeps up, near 1 the GPU starves."""
    time_to_first_batch_s: float | None
    """From the first ``iter()`` to the first batch in the loop's hands."""
    server_wait_s: float = 0.0
    """How long the Loader waited for its server to answer at all before its first session
    (``wait_for_server_s``: a pool scaled to zero starting, a server still starting)."""
    sources: tuple[SourceStats, ...] = ()
    """A mix's sources: samples and tokens each served, against what its weights (and
    schedule) expect (``batchd._accounting``); ``()`` without a mix."""


def _finite(seconds: float) -> float:
    return seconds if math.isfinite(seconds) and seconds > 0.0 else 0.0


class LoopClock:
    """Records each batch's wait and step; not thread-safe (the iterating thread owns it)."""

    def __init__(self, clock: Callable[[], float] = time.perf_counter) -> None:
        self._now = clock
        self._started: float | None = None
        self._asked_at = 0.0
        self._first_batch_s: float | None = None
        self._handed_at: float | None = None
        """When the previous batch went to the loop; None at the start of an iteration."""
        self._step_s = 0.0
        """The step in progress (set when the loop asks for a batch)."""
        self._wait_s = 0.0
        self._total_step_s = 0.0
        self._batches = 0
        self._samples = 0
        self._waits: deque[float] = deque(maxlen=_HISTORY)
        self._steps: deque[float] = deque(maxlen=_HISTORY)
        self._pending: list[BatchTiming] = []

    def iteration_started(self) -> None:
        """A new ``iter()`` asks for its first batch; the time before it is not a step."""
        now = self._now()
        if self._started is None:
            self._started = now
        self._handed_at = None
        self._step_s = 0.0
        self._asked_at = now

    def asked(self) -> None:
        """The loop asks for the next batch: the step that began when it got the previous
        one ends, and the wait for this one begins."""
        now = self._now()
        self._step_s = 0.0 if self._handed_at is None else now - self._handed_at
        self._asked_at = now

    def handed(self, rows: int) -> None:
        """A batch of ``rows`` goes to the loop: the wait since it asked ends."""
        now = self._now()
        wait_s, step_s = _finite(now - self._asked_at), _finite(self._step_s)
        self._batches += 1
        self._samples += rows
        self._wait_s += wait_s
        self._waits.append(wait_s)
        self._steps.append(step_s)
        if self._first_batch_s is None and self._started is not None:
            self._first_batch_s = now - self._started
        if len(self._pending) < MAX_PENDING_TIMINGS:
            self._pending.append(BatchTiming(wait_s, step_s))
        self._total_step_s += step_s
        self._handed_at = now
        self._step_s = 0.0

    def take_pending(self) -> list[BatchTiming]:
        """The timings not yet sent to the server; the list starts empty again."""
        pending, self._pending = self._pending, []
        return pending

    @property
    def wait_s(self) -> float:
        return self._wait_s

    @property
    def batches(self) -> int:
        return self._batches

    def stats(self) -> LoaderStats:
        step_s = self._total_step_s
        waits = np.asarray(self._waits, dtype=np.float64)
        steps = np.asarray(self._steps, dtype=np.float64)

        def pct(values: npt.NDArray[np.float64], q: float) -> float | None:
            return float(np.percentile(values, q)) if values.size else None

        total = self._wait_s + step_s
        return LoaderStats(
            batches=self._batches,
            samples=self._samples,
            wait_s=self._wait_s,
            step_s=step_s,
            wait_p50_s=pct(waits, 50),
            wait_p90_s=pct(waits, 90),
            wait_p99_s=pct(waits, 99),
            step_p50_s=pct(steps, 50),
            step_p90_s=pct(steps, 90),
            step_p99_s=pct(steps, 99),
            stall_ratio=self._wait_s / total if total > 0 else None,
            time_to_first_batch_s=self._first_batch_s,
        )
