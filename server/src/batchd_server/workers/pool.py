"""A pool of long-lived decode processes shared by every session of the server.

Why processes are spawned, not forked: grpcio is not fork-safe, and a replacement worker is
started while the gRPC server runs. ``spawn`` starts a fresh interpreter (fork + exec), so no
lock or thread of the server leaks into a worker. The initial workers are started before any
gRPC object exists all the same, so the server is not "ready" (listening) before they
are.

One dispatcher thread owns every pipe: it hands each ready worker up to
``tasks_per_worker`` tasks (so a worker never idles waiting for the next tiny task), reads
results, and watches the workers' sentinels. A worker that dies is replaced and the tasks it
held are put back at the head of the queue: a killed worker costs a delay, never a lost or
duplicated batch (a task rewrites its whole slot, so redoing it is harmless). A task that
has killed ``max_deaths_per_task`` workers fails instead of killing more.

Every wait has a deadline. A task that runs longer than ``task_timeout_s`` on its worker
gets the worker killed and replaced, and is redone as ``deadline.py`` says (a sample that
hangs twice becomes a bad sample of kind ``timeout``). Replacements start with backoff when
deaths come in bursts, and workers that keep dying before they are ready put the pool in a
crash loop that health reports and that fails tasks instead of queueing them forever
(``respawn.py``).
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
from batchd_server.workers.deadline import BATCH_STEP, HungBatch, after_timeout
from batchd_server.workers.fair_queue import FairQueue
from batchd_server.workers.respawn import RespawnPolicy
from batchd_server.workers.task import BatchResult, BatchTask
from batchd_server.workers.worker import WorkerError, worker_main

__all__ = ["DEFAULT_TASK_TIMEOUT_S", "WorkerPool"]

logger = logging.getLogger(__name__)

DEFAULT_TASK_TIMEOUT_S = 60.0
_MAX_WAIT_S = 1.0
"""The dispatcher looks at deadlines and due respawns at least this often."""


@dataclass
class _Pending:
    task_id: int
    task: BatchTask
    future: Future[BatchResult]
    deaths: int = 0
    submitted_at: float = field(default_factory=time.monotonic)
    hung_at: collections.Counter[int] = field(default_factory=collections.Counter)
    """Positions (-1: a batch-wide step) at which workers hung on this task, and how often."""


@dataclass
class _Worker:
    index: int
    process: BaseProcess
    conn: Connection
    progress: Any
    """``RawArray("q", 2)`` shared with the worker: the task id it runs, the position."""
    outstanding: dict[int, _Pending] = field(default_factory=dict)
    ready: bool = False
    busy_since: float | None = None
    """When the worker began its oldest outstanding task (it runs them in order)."""
    respawn_at: float | None = None
    """A dead worker whose replacement waits for its backoff to pass: when it starts."""


class WorkerPool:
    """``workers`` decode processes; :meth:`submit` returns a future of the batch's result.

    Args:
        workers: Processes to keep alive.
        tasks_per_worker: Tasks handed to a worker before it answers (hides pipe latency
            for tiny batches).
        max_deaths_per_task: Worker deaths one task may cause before it fails with
            :class:`DataLoss` (a sample that crashes the decoder every time).
        start_timeout_s: How long :meth:`start` waits for the workers to be ready.
        task_timeout_s: A task running longer than this on its worker gets the worker
            killed and is redone (see ``deadline.py``).
        on_restart: Called (from the dispatcher thread) after each replacement.
        on_timeout: Called (from the dispatcher thread) for each worker killed for a task
            past its deadline.
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
        task_timeout_s: float = DEFAULT_TASK_TIMEOUT_S,
        on_restart: Callable[[], None] | None = None,
        on_timeout: Callable[[], None] | None = None,
        on_result: Callable[[BatchTask, BatchResult, float, float], None] | None = None,
    ) -> None:
        if workers < 1:
            raise ValueError(f"workers={workers} must be >= 1")
        if not task_timeout_s > 0:
            raise ValueError(f"task_timeout_s={task_timeout_s} must be > 0")
        self.size = workers
        self._tasks_per_worker = tasks_per_worker
        self._max_deaths = max_deaths_per_task
        self._start_timeout_s = start_timeout_s
        self.task_timeout_s = task_timeout_s
        self._on_restart = on_restart
        self._on_timeout = on_timeout
        self._on_result = on_result
        self._respawn = RespawnPolicy()
        self._doomed: list[BaseProcess] = []
        """Workers killed for a deadline, not yet reaped (one stuck in the kernel may
        take a while to go)."""
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
                worker.ready = True
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
        for process in self._doomed:
            process.join(max(0.0, deadline - time.monotonic()))
            if process.is_alive():
                logger.warning(
                    "decode worker pid %s, killed for a task past its deadline, has not "
                    "exited yet (stuck in the kernel: a hung file system?)",
                    process.pid,
                )
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
    def crash_loop(self) -> str | None:
        """Why the workers are in a crash loop (see ``respawn.py``), or None."""
        return self._respawn.crash_loop

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
            self._refuse_if_crash_looping()
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
        progress = self._ctx.RawArray("q", 2)
        process = self._ctx.Process(
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
        child.close()
        return _Worker(index, process, parent, progress)

    def _dispatch(self) -> None:
        while True:
            try:
                if not self._dispatch_once():
                    return
            except Exception:
                # Nothing may end this thread but stop(): without it every session hangs.
                logger.exception("the worker pool's dispatcher hit a bug; carrying on")

    def _live(self) -> list[_Worker]:
        """Workers with a process (not a slot waiting for its replacement's backoff)."""
        return [w for w in self._workers if w.respawn_at is None]

    def _dispatch_once(self) -> bool:
        """One round: hand out tasks, wait for results, deaths, deadlines. False once
        stopping."""
        with self._lock:
            if self._stopping:
                return False
            forget, self._forget = self._forget, []
            self._assign()
        for worker in self._live():
            for session_id in forget:
                _send(worker, ("forget", session_id))
        watched: list[Any] = [self._wake_r]
        for worker in self._live():
            watched += [worker.conn, worker.process.sentinel]
        for obj in wait(watched, timeout=self._wait_s()):
            if obj == self._wake_r:
                _drain(self._wake_r)
                continue
            for worker in self._live():
                if obj is worker.conn:
                    self._receive(worker)
                elif obj == worker.process.sentinel:
                    self._died(worker)
        now = time.monotonic()
        for worker in self._live():
            started = worker.busy_since
            if started is not None and worker.outstanding and now - started >= self.task_timeout_s:
                self._timed_out(worker)
        for worker in list(self._workers):
            if worker.respawn_at is not None and now >= worker.respawn_at:
                self._start_replacement(worker)
        self._doomed = [p for p in self._doomed if p.is_alive()]
        return True

    def _wait_s(self) -> float:
        """Until the next task deadline or due replacement, at most ``_MAX_WAIT_S``."""
        now = time.monotonic()
        due = now + _MAX_WAIT_S
        for worker in self._workers:
            if worker.respawn_at is not None:
                due = min(due, worker.respawn_at)
            elif worker.busy_since is not None:
                due = min(due, worker.busy_since + self.task_timeout_s)
        return max(0.0, due - now)

    def _assign(self) -> None:
        """Give queued tasks to the least busy ready workers (caller holds the lock)."""
        while self._queue:
            ready = [w for w in self._workers if w.ready and w.respawn_at is None]
            if not ready:
                return
            worker = min(ready, key=lambda w: len(w.outstanding))
            if len(worker.outstanding) >= self._tasks_per_worker or not worker.process.is_alive():
                return
            pending = self._queue.popleft()
            # A task redone after a worker died is running already.
            if not pending.future.running() and not pending.future.set_running_or_notify_cancel():
                continue
            if not worker.outstanding:
                worker.busy_since = time.monotonic()
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
            self._respawn.ready()
            return
        task_id, result = message
        with self._lock:
            pending = worker.outstanding.pop(task_id, None)
            # Tasks run in the order they were sent: the next one begins now.
            worker.busy_since = time.monotonic() if worker.outstanding else None
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

    def _timed_out(self, worker: _Worker) -> None:
        """``worker``'s oldest task passed its deadline: kill it, redo its tasks elsewhere."""
        head = next(iter(worker.outstanding.values()))
        # The worker is stuck, so what it last wrote stands still.
        task_id, position = int(worker.progress[0]), int(worker.progress[1])
        if task_id != head.task_id:
            position = BATCH_STEP
        worker.process.kill()
        self._doomed.append(worker.process)
        failed: HungBatch | None = None
        with self._lock:
            if self._stopping:
                return
            held = list(worker.outstanding.values())
            worker.outstanding = {}
            head.hung_at[position] += 1
            try:
                head.task = after_timeout(
                    head.task, head.hung_at, position, timeout_s=self.task_timeout_s
                )
            except HungBatch as e:
                failed, held = e, held[1:]
            for pending in reversed(held):  # the others were not begun: no blame
                self._queue.appendleft(pending)
        if failed is not None and not head.future.done():
            head.future.set_exception(failed)
        where = "a step of the whole batch" if position == BATCH_STEP else f"position {position}"
        logger.warning(
            "decode worker %d (pid %s) ran batch %d of session %s for more than %g s (at %s "
            "of the split); killed it and starting a new one; %s",
            worker.index,
            worker.process.pid,
            head.task.batch_index,
            head.task.spec.session_id,
            self.task_timeout_s,
            where,
            "the batch failed" if failed is not None else "redoing the batch",
        )
        worker.conn.close()
        if self._on_timeout is not None:
            self._on_timeout()
        self._start_replacement(worker)

    def _died(self, worker: _Worker) -> None:
        # Its sentinel fires as it exits, a moment before it can be reaped for the exit code.
        worker.process.join(1.0)
        code = worker.process.exitcode
        how = f"signal {signal.Signals(-code).name}" if code and code < 0 else f"exit code {code}"
        with self._lock:
            if self._stopping:
                return
            held = sorted(worker.outstanding.values(), key=lambda p: p.task_id)
            worker.outstanding = {}
            worker.busy_since = None
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
        was_looping = self._respawn.crash_loop is not None
        delay = self._respawn.died(before_ready=not worker.ready, how=how)
        logger.warning(
            "decode worker %d (pid %s) died (%s)%s holding %d batch(es); %s",
            worker.index,
            worker.process.pid,
            how,
            "" if worker.ready else " before it was ready",
            len(held),
            f"starting a new one in {delay:g} s" if delay else "starting a new one",
        )
        worker.conn.close()
        if self._respawn.crash_loop is not None and not was_looping:
            logger.error("%s", self._respawn.crash_loop)
        with self._lock:
            self._fail_queued_if_crash_looping()
        if delay > 0:
            worker.respawn_at = time.monotonic() + delay
        else:
            self._start_replacement(worker)

    def _start_replacement(self, worker: _Worker) -> None:
        replacement = self._spawn(worker.index)
        self._workers[self._workers.index(worker)] = replacement
        self.restarts += 1
        if self._on_restart is not None:
            self._on_restart()

    def _crash_loop_error(self) -> Unavailable | None:
        """Unavailable when in a crash loop with no ready worker (caller holds the lock)."""
        reason = self._respawn.crash_loop
        if reason is None:
            return None
        if any(w.ready and w.respawn_at is None and w.process.is_alive() for w in self._workers):
            return None
        return Unavailable(f"this batchd server cannot decode batches now: {reason}")

    def _refuse_if_crash_looping(self) -> None:
        error = self._crash_loop_error()
        if error is not None:
            raise error

    def _fail_queued_if_crash_looping(self) -> None:
        error = self._crash_loop_error()
        if error is None:
            return
        for pending in self._queue:
            if not pending.future.done():
                pending.future.set_exception(error)
        self._queue.clear()


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
