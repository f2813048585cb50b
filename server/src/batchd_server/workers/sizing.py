"""How many decode workers to run: ``--workers N`` (fixed) or ``--workers MIN..MAX`` (by demand).

A fixed count is what it always was. A range starts the pool at MIN and lets an
:class:`Autoscaler` thread move it, one worker at a time, between MIN and the least of MAX,
the CPUs the server may use and what memory affords (both as its cgroup limits them:
``host.py``):

- **Up** when, over the last :attr:`ScalingPolicy.grow_window_s`, the trainers stalled
  (the stall ratio the clients report, each client weighed once however many sessions and
  reports it has: ``metrics.stall.RecentStall``, at least :attr:`ScalingPolicy.stall_ratio`;
  with no client reporting, a stall is assumed), decode
  work waited for a worker in most samples (the pool's queue), and the machine had a core's
  worth of idle CPU (``/proc/stat``; under a cgroup CPU quota, no more than the quota its
  cgroup left unused, ``host.py``). All three: a stall with nothing queued is not the
  workers' fault (the network, the trainer's own input), and queued work with no idle core
  would only be shared out more thinly.
- **Down** when, over the last :attr:`ScalingPolicy.shrink_window_s` (longer, so a pause
  between epochs does not cost the next epoch a ramp), work hardly ever waited for a
  worker and the workers together were busy at most 3/4 of one fewer worker's time: one of
  them was not needed. A ready worker with no task is asked to exit; it abandons nothing,
  holding none.

Each decision is pure (:func:`decide`: signals in, a target and a reason out), so the rules
are tested without processes or clocks; :class:`Autoscaler` only samples the signals.
Every change is logged and counted (``batchd_worker_scaling_total{direction,reason}``),
and the signals it decided on are gauges, so a dashboard shows why the pool has the size
it has.
"""

from __future__ import annotations

import logging
import math
import os
import re
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Final, Protocol

from batchd_server.workers.host import HOST, Cgroups, available_memory, usable_cpus

__all__ = [
    "Autoscaler",
    "ScalingPolicy",
    "Signals",
    "WorkerRange",
    "available_cpus",
    "cpu_times",
    "decide",
    "parse_worker_range",
]

logger = logging.getLogger(__name__)

_RANGE_RE: Final = re.compile(r"\s*(\d+)\s*(?:\.\.\s*(\d+)\s*)?")


@dataclass(frozen=True)
class WorkerRange:
    """``--workers``: the fewest and the most decode workers (equal: a fixed count)."""

    min: int
    max: int

    def problem(self) -> str | None:
        """What is wrong with the range, or None."""
        if self.min < 1:
            return "must be >= 1"
        if self.max < self.min:
            return "must be MIN..MAX with MAX >= MIN"
        return None

    @property
    def fixed(self) -> bool:
        return self.min == self.max

    def __str__(self) -> str:
        return str(self.min) if self.fixed else f"{self.min}..{self.max}"


def available_cpus(cgroups: Cgroups = HOST) -> int:
    """The CPUs this process may keep busy: its affinity mask (a container's cpuset counts),
    or fewer when its cgroup's CPU quota says so (``host.py``)."""
    return usable_cpus(cgroups)


def parse_worker_range(text: str) -> WorkerRange:
    """``"4"`` → 4..4; ``"1..8"`` → 1..8.

    Raises:
        ValueError: neither a count nor ``MIN..MAX``.
    """
    match = _RANGE_RE.fullmatch(text)
    if match is None:
        raise ValueError(
            f"{text!r} is not a worker count; write a number (4) or a range MIN..MAX (1..8)"
        )
    low = int(match[1])
    workers = WorkerRange(low, int(match[2]) if match[2] is not None else low)
    problem = workers.problem()
    if problem is not None:
        raise ValueError(f"{text!r} {problem}")
    return workers


@dataclass(frozen=True)
class ScalingPolicy:
    """The thresholds of :func:`decide` and the windows the signals are averaged over."""

    tick_s: float = 0.25
    """How often the signals are sampled."""
    grow_window_s: float = 2.0
    """Demand must hold this long before a worker is added (and again before the next)."""
    shrink_window_s: float = 10.0
    """Idleness must hold this long before a worker is let go."""
    stall_ratio: float = 0.05
    """Trainers waiting at least this share of their time count as stalled."""
    queued_share: float = 0.5
    """Work must have waited for a worker in at least this share of the samples."""
    idle_cores: float = 0.5
    """A new worker needs at least this many idle cores."""
    shrink_queued_share: float = 0.1
    """Shrink only when work waited for a worker in at most this share of the samples (a
    task handed over between two dispatcher rounds is sometimes caught in the queue even
    when the workers idle most of the time)."""
    shrink_busy_share: float = 0.75
    """Shrink when the workers were busy at most this share of one fewer worker's time (so
    the remaining ones are not left just at their limit, which would grow the pool again)."""


@dataclass(frozen=True)
class Signals:
    """What one window of samples says, averaged (see :class:`Autoscaler`)."""

    size: int
    """Workers the pool runs now (its target)."""
    busy: float
    """Workers with a task, on average."""
    queued_share: float
    """Share of samples in which a task waited for a worker."""
    idle_cores: float
    """Idle CPUs on average (0 when unknown)."""
    stall_ratio: float | None
    """The trainers' stall ratio over the window; None when no client reported."""
    ceiling: int
    """The most workers allowed now: MAX, the CPUs and what memory affords."""


def decide(
    signals: Signals, bounds: WorkerRange, policy: ScalingPolicy, *, window: str
) -> tuple[int, str] | None:
    """A new target and its reason, or None to stay. ``window`` says which window the
    signals cover: ``"grow"`` decides only growth, ``"shrink"`` only shrinking."""
    size = signals.size
    if window == "grow":
        if size >= min(bounds.max, signals.ceiling):
            return None
        stalled = signals.stall_ratio is None or signals.stall_ratio >= policy.stall_ratio
        if (
            stalled
            and signals.queued_share >= policy.queued_share
            and signals.idle_cores >= policy.idle_cores
        ):
            return size + 1, "stall"
        return None
    if size > signals.ceiling and size > bounds.min:
        return size - 1, "limits"
    spare = signals.busy <= (size - 1) * policy.shrink_busy_share
    if size > bounds.min and spare and signals.queued_share <= policy.shrink_queued_share:
        return size - 1, "idle"
    return None


def cpu_times(cpus: frozenset[int] | None = None) -> tuple[float, float] | None:
    """(idle, total) jiffies summed over ``cpus`` (all when None), from ``/proc/stat``;
    None where it cannot be read."""
    try:
        with open("/proc/stat", encoding="ascii") as f:
            lines = f.read().splitlines()
    except OSError:
        return None
    idle = total = 0.0
    for line in lines:
        name, _, rest = line.partition(" ")
        if not name.startswith("cpu") or name == "cpu":
            continue
        if cpus is not None and int(name[3:]) not in cpus:
            continue
        values = [float(v) for v in rest.split()]
        idle += values[3] + (values[4] if len(values) > 4 else 0.0)  # idle + iowait
        total += sum(values[:8])  # guest time is already in user
    return (idle, total) if total > 0 else None


def _affinity() -> frozenset[int] | None:
    try:
        return frozenset(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover - not Linux
        return None


def memory_ceiling(workers: int, rss_bytes: int, cgroups: Cgroups = HOST) -> int:
    """Workers the memory affords: those running plus as many more as the memory still
    available holds twice over (a worker's RSS grows with the batch it decodes). Available
    is the host's ``MemAvailable``, or less when the cgroup's memory limit is closer
    (``host.py``): a container's workers must not grow into its OOM killer."""
    if rss_bytes <= 0:
        return 1 << 30
    available = available_memory(cgroups)
    if available is None:
        return 1 << 30
    return workers + available // (2 * rss_bytes)


class SizedPool(Protocol):
    """What the autoscaler needs of ``WorkerPool``."""

    size: int

    def load(self) -> tuple[int, int]:
        """(workers with a task, tasks waiting for a worker)."""
        ...

    def largest_rss_bytes(self) -> int: ...

    def resize(self, size: int) -> None: ...


class Autoscaler:
    """Samples the pool, the CPUs and the stall ratio every ``policy.tick_s``; moves the
    pool's size by one when :func:`decide` says so (see the module docs).

    Args:
        pool: The worker pool.
        bounds: ``--workers`` MIN..MAX.
        cpus: The CPUs the server may use (its affinity mask).
        stall_ratio: The trainers' current stall ratio over a recent window, or None.
        on_change: Called with (direction, reason) after each change, for metrics.
        on_signals: Called with each window's :class:`Signals`, for metrics.
        cgroups: Where the process's CPU quota and use are read (``host.py``).
    """

    def __init__(
        self,
        pool: SizedPool,
        bounds: WorkerRange,
        *,
        cpus: int,
        stall_ratio: Callable[[], float | None],
        policy: ScalingPolicy | None = None,
        on_change: Callable[[str, str], None] | None = None,
        on_signals: Callable[[Signals], None] | None = None,
        cgroups: Cgroups = HOST,
    ) -> None:
        self.pool = pool
        self.bounds = bounds
        self.cpus = cpus
        self.policy = policy or ScalingPolicy()
        self._stall_ratio = stall_ratio
        self._on_change = on_change
        self._on_signals = on_signals
        self._affinity = _affinity()
        self._quota = cgroups.cpu_quota()
        """The cgroup's CPU quota: idle cores are what is left of it, when it is lower than
        the idle time of the CPUs the process may run on."""
        self._cgroups = cgroups
        self._used: tuple[float, float] | None = None
        """(when, the cgroup's CPU seconds) at the last tick, when there is a quota."""
        self._samples: deque[tuple[float, int, bool, float]] = deque()
        """(when, busy workers, work queued, idle cores) per tick."""
        self._changed_at = time.monotonic()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="batchd-autoscale", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(max(1.0, 4 * self.policy.tick_s))

    def _quota_left(self, now: float) -> float:
        """CPUs' worth of the cgroup's quota its processes left unused since the last tick
        (``inf`` without a quota, or before a second reading): on a node whose other pods
        leave cores idle, a container at its quota has none to grow into."""
        if self._quota is None:
            return math.inf
        used = self._cgroups.cpu_used_s()
        last, self._used = self._used, (None if used is None else (now, used))
        if used is None or last is None or now <= last[0]:
            return math.inf
        return max(0.0, self._quota - (used - last[1]) / (now - last[0]))

    def _run(self) -> None:
        last = cpu_times(self._affinity)
        while not self._stop.wait(self.policy.tick_s):
            try:
                last = self._tick(last)
            except Exception:  # a bug must not stop sizing, nor take the server down
                logger.exception("the worker autoscaler hit a bug; carrying on")

    def _tick(self, last: tuple[float, float] | None) -> tuple[float, float] | None:
        now = time.monotonic()
        times = cpu_times(self._affinity)
        idle = 0.0
        if times is not None and last is not None and times[1] > last[1]:
            idle = (times[0] - last[0]) / (times[1] - last[1]) * self.cpus
        idle = min(idle, self._quota_left(now))
        busy, queued = self.pool.load()
        self._samples.append((now, busy, queued > 0, idle))
        horizon = now - max(self.policy.grow_window_s, self.policy.shrink_window_s)
        while self._samples and self._samples[0][0] < horizon:
            self._samples.popleft()
        for window, seconds in (
            ("grow", self.policy.grow_window_s),
            ("shrink", self.policy.shrink_window_s),
        ):
            if now - self._changed_at < seconds:
                continue  # the window still holds samples from before the last change
            signals = self._signals(now - seconds)
            if window == "grow" and self._on_signals is not None:
                self._on_signals(signals)
            decision = decide(signals, self.bounds, self.policy, window=window)
            if decision is not None:
                self._apply(*decision, signals)
                break
        return times

    def _signals(self, since: float) -> Signals:
        window = [s for s in self._samples if s[0] >= since] or [(0.0, 0, False, 0.0)]
        size = self.pool.size
        ceiling = min(self.cpus, memory_ceiling(size, self.pool.largest_rss_bytes()))
        return Signals(
            size=size,
            busy=sum(s[1] for s in window) / len(window),
            queued_share=sum(s[2] for s in window) / len(window),
            idle_cores=sum(s[3] for s in window) / len(window),
            stall_ratio=self._stall_ratio(),
            ceiling=max(1, ceiling),
        )

    def _apply(self, target: int, reason: str, signals: Signals) -> None:
        direction = "up" if target > signals.size else "down"
        logger.info(
            "decode workers %d -> %d (%s: %.1f busy, work queued in %.0f%% of samples, "
            "%.1f idle cores, stall ratio %s; --workers %s)",
            signals.size,
            target,
            reason,
            signals.busy,
            100 * signals.queued_share,
            signals.idle_cores,
            "unknown" if signals.stall_ratio is None else f"{signals.stall_ratio:.2f}",
            self.bounds,
        )
        self.pool.resize(target)
        self._changed_at = time.monotonic()
        if self._on_change is not None:
            self._on_change(direction, reason)
