"""A pool of long-lived decode processes shared by every session of the server.

Why processes are spawned, not forked: grpcio is not fork-safe, and a replacement worker is
started while the gRPC server runs. ``spawn`` starts a fresh interpreter (fork + exec), so no
lock or thread of the server leaks into a worker. The initial workers are started before any
gRPC object exists all the same, so the server is not "ready" (listening) before they
are.

One dispatcher thread owns every pipe: it hands each worker up to ``tasks_per_worker``
tasks (so a worker never idles waiting for the next tiny task), reads results, and watches
the workers' sentinels. A worker that dies is replaced and the tasks it held are put back at
the head of the queue: a killed worker costs a delay, never a lost or duplicated batch (a
task rewrites its whole slot, so redoing it is harmless). A task that has killed
``max_deaths_per_task`` workers fails instead of killing more.
"""

from __future__ import annotations

import collections
import contextlib
import itertools
import logging
import multiprocessing as mp
import os
import signal
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from multiprocessing.connection import Connection, wait
from multiprocessing.process import BaseProcess
from typing import Any

from batchd_server.errors import DataLoss, FailedPrecondition, Unavailable
from batchd_server.logs import current_log_format
from batchd_server.workers.fair_queue import FairQueue
from batchd_server.workers.task import BatchResult, BatchTask
from batchd_server.workers.worker import WorkerError, worker_main

__all__ = ["WorkerPool"]

logger = logging.getLogger(__name__)


@dataclass
class _Pending:
    task_id: int
    task: BatchTask
    future: Future[BatchResult]
    deaths: int = 0
    submitted_at: float = field(default_factory=time.monotonic)


@dataclass
class _Worker:
    index: int
    process: BaseProcess
    conn: Connection
    outstanding: dict[int, _Pending] = field(default_factory=dict)
    ready: bool = False


class WorkerPool:
    """``workers`` decode processes; :meth:`submit` returns a future of the batch's result.

    Args:
        workers: Processes to keep alive.
        tasks_per_worker: Tasks handed to a worker before it answers (hides pipe latency
            for tiny batches).
        max_deaths_per_task: Worker deaths one task may cause before it fails with
            :class:`DataLoss` (a sample that crashes the decoder every time).
        start_timeout_s: How long :meth:`start` waits for the workers to be ready.
        on_restart: Called (from the dispatcher thread) after each replacement.
        on_result: Called (from the dispatcher thread) with each task, its result, the
            seconds it waited before a worker began it, and the seconds from submit to
            result; for metrics, so it must be quick and must not raise.
    """

    def __init__(
        self,
        workers: int,
        *,
        tasks_per_worker: int = 2,
        max_deaths_per_task: int = 3,
        start_timeout_s: float = 120.0,
        on_restart: Callable[[], None] | None = None,
        on_result: Callable[[BatchTask, BatchResult, float, float], None] | None = None,
    ) -> None:
        if workers < 1:
            raise ValueError(f"workers={workers} must be >= 1")
        self.size = workers
        self._tasks_per_worker = tasks_per_worker
        self._max_deaths = max_deaths_per_task
        self._start_timeout_s = start_timeout_s
        self._on_restart = on_restart
        self._on_result = on_result
        self._ctx = mp.get_context("spawn")
        self._workers: list[_Worker] = []
        # Round-robin across sessions (fair_queue.py), so no session waits behind another's
        # whole ring.
        self._queue: FairQueue[_Pending] = FairQueue(lambda p: p.task.spec.session_id)
        self._dispatched: collections.deque[tuple[str, int]] = collections.deque(maxlen=4096)
        self._forget: list[str] = []
        self._lock = threading.Lock()
        self._wake_r, self._wake_w = os.pipe2(os.O_CLOEXEC | os.O_NONBLOCK)
        self._ids = itertools.count()
        self._stopping = False
        self._thread: threading.Thread | None = None
        self.restarts = 0
        """Workers replaced after dying, since start."""

    # -- lifecycle ------------------------------------------------------------------------

    def start(self) -> None:
        """Start the workers and wait until each has imported its code and said ready.

        Raises:
            FailedPrecondition: a worker died or did not get ready in time.
        """
        assert self._thread is None, "start() twice"
        for index in range(self.size):
            self._workers.append(self._spawn(index))
        pending = {w.conn: w for w in self._workers}
        deadline = time.monotonic() + self._start_timeout_s
        while pending:
            left = deadline - time.monotonic()
            ready = wait([*pending, *(w.process.sentinel for w in pending.values())], max(left, 0))
            if not ready:
                self._kill_all()
                raise FailedPrecondition(
                    f"{len(pending)} of {self.size} decode workers were not ready after "
                    f"{self._start_timeout_s:g} s; the machine may be overloaded"
                )
            for obj in ready:
                worker = pending.get(obj)  # type: ignore[call-overload]
                if worker is None or not _recv_ready(worker):
                    self._kill_all()
                    raise FailedPrecondition(
                        "a decode worker exited while starting; run with --log-level debug "
                        "and check that batchd-server is installed completely"
                    )
                del pending[obj]  # type: ignore[arg-type]
        self._thread = threading.Thread(target=self._dispatch, name="batchd-pool", daemon=True)
        self._thread.start()
        logger.info("started %d decode workers", self.size)

    def stop(self, timeout_s: float = 5.0) -> None:
        """Stop the workers: ask, join, terminate, kill. Pending tasks fail. Idempotent."""
        with self._lock:
            if self._stopping:
                return
            self._stopping = True
        self._wake()
        if self._thread is not None:
            self._thread.join(timeout_s)
        for worker in self._workers:
            with contextlib.suppress(OSError):
                worker.conn.send(None)
        deadline = time.monotonic() + timeout_s
        for worker in self._workers:
            worker.process.join(max(0.0, deadline - time.monotonic()))
        self._kill_all()
        error = Unavailable("the batchd server is shutting down")
        for pending in [*self._queue, *(p for w in self._workers for p in w.outstanding.values())]:
            if not pending.future.done():
                pending.future.set_exception(error)
        self._queue.clear()
        for worker in self._workers:
            worker.conn.close()
        os.close(self._wake_r)
        os.close(self._wake_w)

    def _kill_all(self) -> None:
        # Terminate every survivor first and then wait for them together: shutdown must
        # never wait for one worker after another.
        alive = [w.process for w in self._workers if w.process.is_alive()]
        for process in alive:
            process.terminate()
        deadline = time.monotonic() + 1.0
        for process in alive:
            process.join(max(0.0, deadline - time.monotonic()))
        for process in alive:
            if process.is_alive():
                process.kill()
                process.join()

    # -- use ------------------------------------------------------------------------------

    @property
    def alive(self) -> int:
        """Workers whose process is running."""
        return sum(w.process.is_alive() for w in self._workers)

    @property
    def dispatcher_alive(self) -> bool:
        """The thread that feeds the workers runs (every session hangs without it)."""
        return self._thread is not None and self._thread.is_alive()

    def outstanding(self) -> int:
        """Tasks handed to workers and not answered yet."""
        with self._lock:
            return sum(len(w.outstanding) for w in self._workers)

    def dispatched(self) -> list[tuple[str, int]]:
        """(session id, batch index) of the latest tasks handed to workers, oldest first
        (at most 4096): the order the pool served its sessions in."""
        with self._lock:
            return list(self._dispatched)

    def pids(self) -> list[int]:
        """The workers' process ids (for tests and diagnostics)."""
        return [w.process.pid for w in self._workers if w.process.pid is not None]

    def submit(self, task: BatchTask) -> Future[BatchResult]:
        """Queue ``task``; the future resolves with its :class:`BatchResult`.

        A future cancelled before a worker took the task is never run.
        """
        future: Future[BatchResult] = Future()
        with self._lock:
            if self._stopping:
                raise Unavailable("the batchd server is shutting down")
            self._queue.append(_Pending(next(self._ids), task, future))
        self._wake()
        return future

    def forget_session(self, session_id: str) -> None:
        """Tell every worker to drop its handles on a closed session."""
        with self._lock:
            self._forget.append(session_id)
        self._wake()

    # -- the dispatcher thread --------------------------------------------------------------

    def _wake(self) -> None:
        # BlockingIOError: the pipe is full, so the dispatcher is waking anyway.
        with contextlib.suppress(OSError):
            os.write(self._wake_w, b"x")

    def _spawn(self, index: int) -> _Worker:
        parent, child = self._ctx.Pipe(duplex=True)
        process = self._ctx.Process(
            target=worker_main,
            args=(
                child,
                os.getpid(),
                logging.getLogger("batchd_server").getEffectiveLevel(),
                current_log_format(),
            ),
            name=f"batchd-worker-{index}",
            daemon=True,
        )
        process.start()
        child.close()
        return _Worker(index, process, parent)

    def _dispatch(self) -> None:
        while True:
            try:
                if not self._dispatch_once():
                    return
            except Exception:
                # Nothing may end this thread but stop(): without it every session hangs.
                logger.exception("the worker pool's dispatcher hit a bug; carrying on")

    def _dispatch_once(self) -> bool:
        """One round: hand out tasks, wait for results or deaths. False once stopping."""
        with self._lock:
            if self._stopping:
                return False
            forget, self._forget = self._forget, []
            self._assign()
        for worker in self._workers:
            for session_id in forget:
                _send(worker, ("forget", session_id))
        watched: list[Any] = [self._wake_r]
        for worker in self._workers:
            watched += [worker.conn, worker.process.sentinel]
        for obj in wait(watched, timeout=1.0):
            if obj == self._wake_r:
                _drain(self._wake_r)
                continue
            for worker in list(self._workers):
                if obj is worker.conn:
                    self._receive(worker)
                elif obj == worker.process.sentinel:
                    self._replace(worker)
        return True

    def _assign(self) -> None:
        """Give queued tasks to the least busy workers (caller holds the lock)."""
        while self._queue:
            worker = min(self._workers, key=lambda w: len(w.outstanding))
            if len(worker.outstanding) >= self._tasks_per_worker or not worker.process.is_alive():
                return
            pending = self._queue.popleft()
            # A task redone after a worker died is running already.
            if not pending.future.running() and not pending.future.set_running_or_notify_cancel():
                continue
            worker.outstanding[pending.task_id] = pending
            self._dispatched.append((pending.task.spec.session_id, pending.task.batch_index))
            if not _send(worker, ("task", pending.task_id, pending.task)):
                return  # dead: the sentinel will fire and the task will be redone

    def _receive(self, worker: _Worker) -> None:
        try:
            message = worker.conn.recv()
        except (EOFError, OSError):
            return  # died; its sentinel handles it
        if message == ("ready",):
            worker.ready = True
            return
        task_id, result = message
        with self._lock:
            pending = worker.outstanding.pop(task_id, None)
        if pending is None or pending.future.done():
            return
        if isinstance(result, WorkerError):
            logger.error(
                "decode worker failed on batch %d of session %s: %s",
                pending.task.batch_index,
                pending.task.spec.session_id,
                result.traceback,
            )
            pending.future.set_exception(
                DataLoss(
                    f"batch {pending.task.batch_index} failed inside a decode worker "
                    f"({result.type_name}: {result.message}); the server log has the traceback"
                )
            )
        else:
            if self._on_result is not None:
                now = time.monotonic()
                queued_s = max(0.0, result.times.started_at - pending.submitted_at)
                try:
                    self._on_result(pending.task, result, queued_s, now - pending.submitted_at)
                except Exception:  # metrics must never cost a batch
                    logger.exception("recording a batch's timings failed")
            pending.future.set_result(result)

    def _replace(self, worker: _Worker) -> None:
        worker.process.join(0)
        code = worker.process.exitcode
        how = f"signal {signal.Signals(-code).name}" if code and code < 0 else f"exit code {code}"
        with self._lock:
            if self._stopping:
                return
            held = sorted(worker.outstanding.values(), key=lambda p: p.task_id)
            worker.outstanding = {}
            for pending in reversed(held):
                pending.deaths += 1
                if pending.deaths >= self._max_deaths:
                    pending.future.set_exception(
                        DataLoss(
                            f"batch {pending.task.batch_index} of session "
                            f"{pending.task.spec.session_id} killed {pending.deaths} decode "
                            "workers; a sample in it crashes the decoder. Find it with "
                            "on_error='raise' and batch_size=1, then un-verify it"
                        )
                    )
                else:
                    self._queue.appendleft(pending)
        logger.warning(
            "decode worker %d (pid %s) died (%s) holding %d batch(es); starting a new one "
            "and redoing them",
            worker.index,
            worker.process.pid,
            how,
            len(held),
        )
        worker.conn.close()
        replacement = self._spawn(worker.index)
        self._workers[self._workers.index(worker)] = replacement
        self.restarts += 1
        if self._on_restart is not None:
            self._on_restart()


def _send(worker: _Worker, message: object) -> bool:
    try:
        worker.conn.send(message)
        return True
    except (BrokenPipeError, OSError):
        return False


def _recv_ready(worker: _Worker) -> bool:
    try:
        return bool(worker.conn.poll(0) and worker.conn.recv() == ("ready",))
    except (EOFError, OSError):
        return False


def _drain(fd: int) -> None:
    try:
        while os.read(fd, 4096):
            pass
    except BlockingIOError:
        pass
