"""Is this server fit to take sessions (readiness), and is it still working at all (liveness)?

A server is ready to take sessions only while the shared-memory filesystem has
``min_free_shm_bytes`` free, the catalog database answers, every decode worker lives (and they
are not in a crash loop: dying before they get ready, see ``workers/respawn.py``), and the
server is not draining.
:class:`HealthMonitor` re-checks that every ``interval_s`` on a thread of its own and tells
a listener (the gRPC health service, ``api/health.py``) when the answer changes, logging
each change once with its reason. The catalog is probed on yet another thread: a database
that hangs (a stopped VM, a full disk) must not hang the monitor, so a probe still running
after ``catalog_timeout_s`` counts as a failure while it runs.

What is wrong without making the server unready goes in the report's ``notes``: an object
store that does not answer (sessions are then served from the node cache) is one. They are
logged when they change, and a SERVING answer carries them (``api/health.py``).

Liveness is narrower on purpose: a server that is merely unready (a database restart) must
not be killed and restarted for it. It is live while the monitor's own loop keeps turning and
the worker pool's dispatcher thread runs; a wedged server fails both.

No gRPC here: the check is domain logic, and ``batchd-server healthcheck`` reuses
:func:`shm_problem` without any server.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Final

from batchd_server.shm.space import ShmSpace, format_bytes, remedy

__all__ = ["HealthMonitor", "HealthReport", "Problem", "shm_problem"]

logger = logging.getLogger(__name__)

_LIVENESS_TICKS: Final = 5
"""Liveness fails when the monitor loop has not turned for this many intervals (and 10 s)."""
_LIVENESS_MIN_S: Final = 10.0


@dataclass(frozen=True)
class Problem:
    """One reason the server is not ready."""

    check: str
    """``shm``, ``catalog``, ``workers`` or ``draining``."""
    message: str
    """What is wrong and what to change, in one sentence."""


@dataclass(frozen=True)
class HealthReport:
    """The outcome of one round of checks; ready when there is no problem."""

    problems: tuple[Problem, ...] = ()
    notes: tuple[str, ...] = ()
    """What is wrong without making the server unready (an object store down)."""

    @property
    def ready(self) -> bool:
        return not self.problems

    @property
    def reason(self) -> str:
        """One line: what is wrong (``"healthy"`` when nothing is)."""
        return "; ".join(p.message for p in self.problems) or "healthy"

    @property
    def checks(self) -> frozenset[str]:
        return frozenset(p.check for p in self.problems)


def shm_problem(space: ShmSpace, min_free_bytes: int) -> str | None:
    """What is wrong when ``space`` has less than ``min_free_bytes`` free, else None.

    For example ``/dev/shm has 64.0 MiB free, batchd needs 1.0 GiB: set shm_size: 2gb in
    docker-compose.yml ...`` (one line, the remedy sized for the need).
    """
    if space.free_bytes >= min_free_bytes:
        return None
    return (
        f"{space.path} has {format_bytes(space.free_bytes)} free, batchd needs "
        f"{format_bytes(min_free_bytes)}: {remedy(space, min_free_bytes)} (or lower "
        "--min-free-shm if smaller sessions are all this server takes)"
    )


class _CatalogProbe:
    """Runs ``probe`` every ``interval_s`` on its own thread; remembers how the last one went."""

    def __init__(self, probe: Callable[[], None], *, interval_s: float, timeout_s: float) -> None:
        self._probe = probe
        self._interval_s = interval_s
        self._timeout_s = timeout_s
        self._lock = threading.Lock()
        self._started: float | None = None
        """When the probe now running began; None between probes."""
        self._error: str | None = "the catalog has not been probed yet"
        self._done = threading.Event()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="batchd-catalog-probe", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        # A probe stuck in the database driver cannot be interrupted; the thread is a daemon
        # and ends when the call returns.
        self._stop.set()

    def wait_first(self, timeout_s: float) -> None:
        self._done.wait(timeout_s)

    def _run(self) -> None:
        while not self._stop.is_set():
            with self._lock:
                self._started = time.monotonic()
            try:
                self._probe()
                error = None
            except Exception as e:  # whatever the driver raises: report it, keep probing
                error = str(e) or type(e).__name__
            with self._lock:
                self._started = None
                self._error = error
            self._done.set()
            self._stop.wait(self._interval_s)

    def problem(self) -> str | None:
        with self._lock:
            started, error = self._started, self._error
        if started is not None:
            running_s = time.monotonic() - started
            if running_s > self._timeout_s:
                return (
                    f"the catalog database has not answered a trivial query for "
                    f"{running_s:.0f} s (timeout {self._timeout_s:g} s); check that it is up "
                    "and reachable (BATCHD_DATABASE_URL)"
                )
        if error is not None:
            again = f"the health check probes it again every {self._interval_s:g} s"
            return f"{error.rstrip('.')} ({again})"
        return None


class HealthMonitor:
    """Checks readiness every ``interval_s``; calls ``on_change`` when it changes.

    Args:
        space: Reads the shared-memory filesystem's size and free bytes.
        min_free_shm_bytes: Ready only while at least this much is free.
        catalog_probe: One round trip to the catalog; raises when it fails.
        catalog_timeout_s: A probe running longer than this is a failure.
        workers_wanted: The decode workers the pool runs now (``--workers``, or the
            size the autoscaler chose within its range).
        workers_alive: How many of them live now.
        dispatcher_alive: Whether the worker pool's dispatcher thread runs (liveness).
        crash_loop: Why the workers are in a crash loop, or None (the default: never).
        notes: What is wrong without making the server unready (the default: nothing).
        interval_s: Seconds between rounds.
        on_change: Called with the new report after each change (and once at start), from
            the monitor's thread.
    """

    def __init__(
        self,
        *,
        space: Callable[[], ShmSpace],
        min_free_shm_bytes: int,
        catalog_probe: Callable[[], None],
        catalog_timeout_s: float,
        workers_wanted: Callable[[], int],
        workers_alive: Callable[[], int],
        dispatcher_alive: Callable[[], bool],
        interval_s: float,
        on_change: Callable[[HealthReport], None],
        crash_loop: Callable[[], str | None] = lambda: None,
        notes: Callable[[], list[str]] = list,
    ) -> None:
        self._notes = notes
        self._space = space
        self._min_free = min_free_shm_bytes
        self._catalog = _CatalogProbe(
            catalog_probe, interval_s=interval_s, timeout_s=catalog_timeout_s
        )
        self._catalog_timeout_s = catalog_timeout_s
        self._workers_wanted = workers_wanted
        self._workers_alive = workers_alive
        self._dispatcher_alive = dispatcher_alive
        self._crash_loop = crash_loop
        self._interval_s = interval_s
        self._on_change = on_change
        self._lock = threading.Lock()
        self._tick_lock = threading.Lock()
        """One round at a time: a stale round must not overwrite drain()'s report."""
        self._draining = False
        self._report: HealthReport | None = None
        self._last_tick = time.monotonic()
        self._stop = threading.Event()
        self._wake = threading.Event()
        self._thread = threading.Thread(target=self._run, name="batchd-health", daemon=True)

    def start(self) -> None:
        """Probe the catalog once (waiting up to its timeout), publish the first report, and
        keep checking in the background."""
        self._catalog.start()
        self._catalog.wait_first(self._catalog_timeout_s)
        self._tick()
        self._thread.start()

    def stop(self, timeout_s: float = 5.0) -> None:
        """Stop probing; wait at most ``timeout_s`` seconds for the probing thread (a daemon:
        one stuck in a probe is left to end with the process)."""
        self._stop.set()
        self._wake.set()
        self._catalog.stop()
        if self._thread.is_alive():
            self._thread.join(max(timeout_s, 0.0))

    def drain(self) -> None:
        """The server is shutting down: not ready from now on, reported at once."""
        with self._lock:
            self._draining = True
        self._tick()

    @property
    def draining(self) -> bool:
        with self._lock:
            return self._draining

    @property
    def report(self) -> HealthReport:
        """The latest report (a fresh one before the first round)."""
        with self._lock:
            report = self._report
        return report if report is not None else self.evaluate()

    def live(self) -> bool:
        """The process is not wedged: the monitor loop turns and the dispatcher runs."""
        stale_s = max(_LIVENESS_MIN_S, _LIVENESS_TICKS * self._interval_s)
        with self._lock:
            last = self._last_tick
        return time.monotonic() - last < stale_s and self._dispatcher_alive()

    def evaluate(self) -> HealthReport:
        """Run every check now (the catalog's from its probe thread's latest result)."""
        problems: list[Problem] = []
        if self.draining:
            problems.append(
                Problem(
                    "draining",
                    "the server is shutting down; clients should open their sessions on "
                    "another replica or after the restart",
                )
            )
        try:
            shm = shm_problem(self._space(), self._min_free)
        except OSError as e:
            shm = f"cannot inspect the shared-memory directory: {e}"
        if shm is not None:
            problems.append(Problem("shm", shm))
        catalog = self._catalog.problem()
        if catalog is not None:
            problems.append(Problem("catalog", catalog))
        alive, wanted = self._workers_alive(), self._workers_wanted()
        crash_loop = self._crash_loop()
        if crash_loop is not None:
            problems.append(Problem("workers", f"{alive} of {wanted} workers alive; {crash_loop}"))
        elif alive < wanted:
            problems.append(
                Problem(
                    "workers",
                    f"{alive} of {wanted} decode workers are alive; dead ones are "
                    "being replaced (if this lasts, the server log says why they die)",
                )
            )
        return HealthReport(tuple(problems), tuple(self._notes()))

    def _run(self) -> None:
        while not self._stop.is_set():
            self._wake.wait(self._interval_s)
            self._wake.clear()
            if self._stop.is_set():
                return
            try:
                self._tick()
            except Exception:  # a bug here must not stop the checks (and fail liveness)
                logger.exception("health check failed; carrying on")

    def _tick(self) -> None:
        with self._tick_lock:
            report = self.evaluate()
            with self._lock:
                previous = self._report
                self._report = report
                self._last_tick = time.monotonic()
            if previous is None or previous.notes != report.notes:
                for note in report.notes:
                    logger.warning("health: %s", note)
            if previous is not None and previous.checks == report.checks:
                return
            if report.ready:
                logger.info("health: SERVING%s", "" if previous is None else " again")
            else:
                logger.warning("health: NOT_SERVING: %s", report.reason)
            self._on_change(report)
