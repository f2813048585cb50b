"""A decode worker as the pool holds it, and the pool's record of a task; starting one worker
and ending many.

A :class:`Worker` is one process with its pipe, the thread that writes to that pipe
(``sender.py``), the small shared array in which it says where it is (``deadline.py``), and
the dispatcher's bookkeeping: the tasks it holds, whether it said ready, since when it is
busy, and, for a dead worker whose replacement waits for its backoff, when that starts.

:func:`end_processes` escalates, as a shutdown of child processes must: ask, terminate, kill,
reap, each step for all of them before the next, never waiting on one process before signalling
the others (the caller has asked already, so it starts at terminate). All of it runs within the
deadline the caller derives from its grace, plus :data:`REAP_S` for SIGKILL to land. A process
that does not go even then (stuck in the kernel) is left with a warning rather than hanging
shutdown.
"""

from __future__ import annotations

import collections
import logging
import os
import time
from concurrent.futures import Future
from dataclasses import dataclass, field
from multiprocessing.connection import Connection, wait
from multiprocessing.context import SpawnContext
from multiprocessing.process import BaseProcess
from typing import Any, Final

from batchd_server.logs import current_log_format
from batchd_server.workers.sender import WorkerSender
from batchd_server.workers.task import BatchResult, BatchTask
from batchd_server.workers.worker import worker_main

__all__ = ["REAP_S", "Pending", "Worker", "end_processes", "left", "spawn_worker", "wait_ready"]

logger = logging.getLogger(__name__)

REAP_S: Final = 0.5
"""How long :func:`end_processes` waits past its deadline for killed workers to be reaped."""


@dataclass
class Pending:
    """A task submitted to the pool and not answered yet."""

    task_id: int
    task: BatchTask
    future: Future[BatchResult]
    deaths: int = 0
    submitted_at: float = field(default_factory=time.monotonic)
    hung_at: collections.Counter[int] = field(default_factory=collections.Counter)
    """Positions (-1: a batch-wide step) at which workers hung on this task, and how often."""


@dataclass
class Worker:
    index: int
    process: BaseProcess
    conn: Connection
    """Read by the dispatcher only; written by ``sender``, which also closes it."""
    sender: WorkerSender
    progress: Any
    """``RawArray("q", 2)`` shared with the worker: the task id it runs, the position."""
    outstanding: dict[int, Pending] = field(default_factory=dict)
    ready: bool = False
    busy_since: float | None = None
    """When the worker began its oldest outstanding task (it runs them in order)."""
    respawn_at: float | None = None
    """A dead worker whose replacement waits for its backoff to pass: when it starts."""

    def received_ready(self) -> bool:
        """The worker's first message, read now if it is there, is ``("ready",)``."""
        try:
            return bool(self.conn.poll(0) and self.conn.recv() == ("ready",))
        except (EOFError, OSError):
            return False


def spawn_worker(ctx: SpawnContext, index: int) -> Worker:
    """Start worker ``index`` (it says ready on its pipe once it imported its code).

    Raises:
        OSError: the system refused a process, a pipe or memory (EAGAIN, EMFILE, ENOMEM).
    """
    parent, child = ctx.Pipe(duplex=True)
    try:
        progress = ctx.RawArray("q", 2)
        process = ctx.Process(
            target=worker_main,
            args=(
                child,
                os.getpid(),
                logging.getLogger("batchd_server").getEffectiveLevel(),
                current_log_format(),
                progress,
            ),
            name=f"batchd-worker-{index}",
            daemon=True,
        )
        process.start()
    except BaseException:
        parent.close()
        raise
    finally:
        child.close()
    return Worker(index, process, parent, WorkerSender(parent, f"batchd-send-{index}"), progress)


def wait_ready(workers: list[Worker], timeout_s: float) -> str | None:
    """Wait until each of ``workers`` said ready (and mark it so); what went wrong, or None.

    Returns:
        Why not all got ready: one exited while starting, or the time ran out.
    """
    pending = {w.conn: w for w in workers}
    deadline = time.monotonic() + timeout_s
    while pending:
        watched: list[Any] = [*pending, *(w.process.sentinel for w in pending.values())]
        ready = wait(watched, left(deadline))
        if not ready:
            return (
                f"{len(pending)} of {len(workers)} decode workers were not ready after "
                f"{timeout_s:g} s; the machine may be overloaded"
            )
        for obj in ready:
            worker = pending.get(obj)  # type: ignore[call-overload]
            if worker is None or not worker.received_ready():
                return (
                    "a decode worker exited while starting; run with --log-level debug and "
                    "check that batchd-server is installed completely"
                )
            worker.ready = True
            del pending[obj]  # type: ignore[arg-type]
    return None


def end_processes(processes: list[BaseProcess], deadline: float) -> None:
    """Terminate every one of ``processes`` that runs, kill those left halfway to
    ``deadline``, and reap them until :data:`REAP_S` past it."""
    # Every survivor is signalled first and then waited for together: shutdown must never
    # wait for one worker after another.
    alive = [p for p in processes if p.is_alive()]
    for process in alive:
        process.terminate()
    now = time.monotonic()
    kill_at = now + max(0.0, deadline - now) / 2
    for process in alive:
        process.join(left(kill_at))
    alive = [p for p in alive if p.is_alive()]
    for process in alive:
        process.kill()
    reap_until = max(deadline, time.monotonic()) + REAP_S
    for process in alive:
        process.join(left(reap_until))
        if process.is_alive():
            logger.warning(
                "decode worker pid %s has not exited after SIGKILL (stuck in the kernel: a "
                "hung file system?); leaving it",
                process.pid,
            )


def left(until: float) -> float:
    """Seconds from now to the ``time.monotonic()`` value ``until``, at least 0."""
    return max(0.0, until - time.monotonic())
