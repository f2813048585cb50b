"""A pool of long-lived decode processes shared by every session of the server.

Why processes are spawned, not forked: grpcio is not fork-safe, and a replacement worker is
started while the gRPC server runs. ``spawn`` starts a fresh interpreter (fork + exec), so no
lock or thread of the server leaks into a worker. The initial workers are started before any
gRPC object exists all the same, so the server is not "ready" (listening) before they
are.

One dispatcher thread hands each ready worker up to ``tasks_per_worker`` tasks (so a worker
never idles waiting for the next tiny task), reads results, and watches the workers'
sentinels. It never writes to a pipe itself: each worker has a thread that does
(``sender.py``), so a worker that stopped reading (busy, SIGSTOPped, stuck in the kernel)
holds up no other worker, no ``submit`` and no deadline. The dispatcher bumps a heartbeat
after every round; :attr:`WorkerPool.dispatcher_alive`, which health's liveness reads, is
False once it is older than :data:`DISPATCHER_STALL_S`.

A worker that dies is replaced and the tasks it held are put back at the head of the queue:
a killed worker costs a delay, never a lost or duplicated batch (a task rewrites its whole
slot, so redoing it is harmless). A task that has killed ``max_deaths_per_task`` workers
fails instead of killing more.

Every wait has a deadline. A task that runs longer than ``task_timeout_s`` on its worker
gets the worker killed and replaced, and is redone as ``deadline.py`` says (a sample that
hangs twice becomes a bad sample of kind ``timeout``). Replacements start with backoff when
deaths come in bursts, and workers that keep dying before they are ready put the pool in a
crash loop that health reports and that fails tasks instead of queueing them forever
(``respawn.py``). A replacement the system refuses to start (fork's EAGAIN, EMFILE, ENOMEM)
counts as such a death: the other workers serve meanwhile and it is tried again after the
backoff.

:meth:`WorkerPool.stop` keeps within the seconds its caller gives it (the server's grace):
it asks the workers to exit, terminates those still running when the time kept for the
escalation comes, and kills the rest; a process that does not go even then (stuck in the
kernel) is left after ``handle.REAP_S`` more, with a warning, instead of hanging shutdown.
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
from multiprocessing.connection import wait
from multiprocessing.process import BaseProcess
from typing import Any

from batchd_server.errors import DataLoss, FailedPrecondition, Unavailable
from batchd_server.workers.deadline import NOT_BEGUN, HungBatch, after_timeout, where_stuck
from batchd_server.workers.fair_queue import FairQueue
from batchd_server.workers.handle import (
    REAP_S,
    Pending,
    Worker,
    end_processes,
    left,
    spawn_worker,
    wait_ready,
)
from batchd_server.workers.resizing import Resizable
from batchd_server.workers.respawn import RespawnPolicy
from batchd_server.workers.sender import pickled
from batchd_server.workers.task import BatchResult, BatchTask
from batchd_server.workers.worker import WorkerError

__all__ = ["DEFAULT_TASK_TIMEOUT_S", "DISPATCHER_STALL_S", "WorkerPool"]

logger = logging.getLogger(__name__)

DEFAULT_TASK_TIMEOUT_S = 60.0
_MAX_WAIT_S = 1.0
"""The dispatcher looks at deadlines and due respawns at least this often."""
DISPATCHER_STALL_S = 30.0
"""A dispatcher whose last round began longer ago than this is wedged: liveness fails. A
round takes at most about ``_MAX_WAIT_S`` plus a second per worker that died in it."""
_TERMINATE_S = 1.0
"""Of the time :meth:`WorkerPool.stop` is given, what it keeps (at most half) for
terminating and killing workers that did not exit when asked."""


class WorkerPool(Resizable):
    """``workers`` decode processes; :meth:`submit` returns a future of the batch's result.

    :meth:`resize` changes how many run while it serves (``resizing.py``).

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
        self._workers: list[Worker] = []
        self._retired: list[Worker] = []
        """Workers asked to exit when the pool shrank, until they are reaped."""
        # Round-robin across clients, then their sessions (fair_queue.py), so no session waits
        # behind another's whole ring, and no client's many sessions crowd out another's one.
        self._queue: FairQueue[Pending] = FairQueue(
            lambda p: p.task.spec.session_id, tenant=lambda p: p.task.spec.client
        )
        self._dispatched: collections.deque[tuple[str, int]] = collections.deque(maxlen=4096)
        self._forget: list[str] = []
        self._lock = threading.Lock()
        self._wake_r, self._wake_w = os.pipe2(os.O_CLOEXEC | os.O_NONBLOCK)
        # From 1: a fresh worker's progress array says task 0 until it begins its first task.
        self._ids = itertools.count(1)
        self._stopping = False
        self._thread: threading.Thread | None = None
        self._turned_at = time.monotonic()
        """When the dispatcher began its latest round (its heartbeat)."""
        self.restarts = 0
        """Workers replaced after dying, since start."""

    # -- lifecycle ------------------------------------------------------------------------

    def start(self) -> None:
        """Start the workers and wait until each has imported its code and said ready.

        Raises:
            FailedPrecondition: a worker died or did not get ready in time.
        """
        assert self._thread is None, "start() twice"
        try:
            for index in range(self.size):
                self._workers.append(spawn_worker(self._ctx, index))
        except Exception as e:
            self._abandon()
            raise FailedPrecondition(
                f"could not start decode worker {len(self._workers) + 1} of {self.size} ({e}); "
                "check the machine's process, open file and memory limits (ulimit -u, "
                "ulimit -n, the container's pids and memory limits) or start fewer --workers"
            ) from e
        problem = wait_ready(self._workers, self._start_timeout_s)
        if problem is not None:
            self._abandon()
            raise FailedPrecondition(problem)
        self._turned_at = time.monotonic()
        self._thread = threading.Thread(target=self._dispatch, name="batchd-pool", daemon=True)
        self._thread.start()
        logger.info("started %d decode workers", self.size)

    def stop(self, timeout_s: float = 5.0) -> None:
        """Stop the workers within about ``timeout_s`` seconds: ask them to exit, terminate
        those still running when the time kept for escalating comes (half of ``timeout_s``,
        at most :data:`_TERMINATE_S`), kill the rest. Pending tasks fail. Idempotent.

        A killed worker that is not gone ``handle.REAP_S`` past the deadline (stuck in the
        kernel: a hung file system) is left behind with a warning.
        """
        deadline = time.monotonic() + max(0.0, timeout_s)
        with self._lock:
            if self._stopping:
                return
            self._stopping = True
        self._wake()
        ask_until = deadline - min(_TERMINATE_S, max(0.0, timeout_s) / 2)
        if self._thread is not None:
            self._thread.join(left(ask_until))
        dispatcher_gone = self._thread is None or not self._thread.is_alive()
        for worker in self._live():
            worker.sender.send(pickled(None))
        for worker in self._live():
            worker.process.join(left(ask_until))
        end_processes([w.process for w in [*self._workers, *self._retired]], deadline)
        for process in self._doomed:
            process.join(left(deadline + REAP_S))
            if process.is_alive():
                logger.warning(
                    "decode worker pid %s, killed for a task past its deadline, has not "
                    "exited yet (stuck in the kernel: a hung file system?)",
                    process.pid,
                )
        for worker in [*self._workers, *self._retired]:
            worker.sender.close()
        for worker in [*self._workers, *self._retired]:
            worker.sender.join(left(deadline + REAP_S))
        error = Unavailable("the batchd server is shutting down")
        with self._lock:
            held = [*self._queue, *(p for w in self._workers for p in w.outstanding.values())]
            self._queue.clear()
        for pending in held:
            if not pending.future.done():
                pending.future.set_exception(error)
        if dispatcher_gone:  # else it may still read them: leak two descriptors instead
            os.close(self._wake_r)
            os.close(self._wake_w)

    def _abandon(self) -> None:
        """A failed start: kill what was started, within a second."""
        end_processes([w.process for w in self._workers], time.monotonic() + _TERMINATE_S)
        for worker in self._workers:
            worker.sender.close()

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
        """The thread that feeds the workers runs and began a round within
        :data:`DISPATCHER_STALL_S` (every session hangs without it; health's liveness)."""
        if self._thread is None or not self._thread.is_alive():
            return False
        return time.monotonic() - self._turned_at < DISPATCHER_STALL_S

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
            self._queue.append(Pending(next(self._ids), task, future))
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

    def _dispatch(self) -> None:
        while True:
            try:
                if not self._dispatch_once():
                    return
            except Exception:
                # Nothing may end this thread but stop(): without it every session hangs. A
                # bug that recurs every round must not become a hot logging loop, and the
                # heartbeat, bumped only by a whole round, goes stale and fails liveness.
                logger.exception("the worker pool's dispatcher hit a bug; carrying on")
                time.sleep(_MAX_WAIT_S / 10)

    def _live(self) -> list[Worker]:
        """Workers with a process (not a slot waiting for its replacement's backoff)."""
        return [w for w in self._workers if w.respawn_at is None]

    def _dispatch_once(self) -> bool:
        """One round: hand out tasks, wait for results, deaths, deadlines. False once
        stopping."""
        with self._lock:
            if self._stopping:
                return False
            forget, self._forget = self._forget, []
            assigned = self._assign()
        for worker, pending in assigned:
            self._send_task(worker, pending)
        for session_id in forget:
            message = pickled(("forget", session_id))
            for worker in self._live():
                worker.sender.send(message)
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
        self._apply_size()
        self._turned_at = time.monotonic()
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

    def _assign(self) -> list[tuple[Worker, Pending]]:
        """Give queued tasks to the least busy ready workers (caller holds the lock); what to
        send to whom, in order."""
        assigned: list[tuple[Worker, Pending]] = []
        while self._queue:
            ready = [w for w in self._workers if w.ready and w.respawn_at is None]
            if not ready:
                break
            worker = min(ready, key=lambda w: len(w.outstanding))
            if len(worker.outstanding) >= self._tasks_per_worker or not worker.process.is_alive():
                break
            pending = self._queue.popleft()
            # A task redone after a worker died is running already.
            if not pending.future.running() and not pending.future.set_running_or_notify_cancel():
                continue
            if not worker.outstanding:
                worker.busy_since = time.monotonic()
            worker.outstanding[pending.task_id] = pending
            self._dispatched.append((pending.task.spec.session_id, pending.task.batch_index))
            assigned.append((worker, pending))
        return assigned

    def _send_task(self, worker: Worker, pending: Pending) -> None:
        # Pickled here, outside the lock (512 KiB of positions at the largest batch), and
        # written by the worker's sender: if the worker died meanwhile, its sentinel fires
        # and the task is redone.
        try:
            payload = pickled(("task", pending.task_id, pending.task))
        except Exception as e:  # a bug: fail this batch, not the dispatcher
            with self._lock:
                worker.outstanding.pop(pending.task_id, None)
                if not worker.outstanding:
                    worker.busy_since = None
            logger.exception("batch %d cannot be pickled for a worker", pending.task.batch_index)
            pending.future.set_exception(
                DataLoss(
                    f"batch {pending.task.batch_index} of session {pending.task.spec.session_id} "
                    f"cannot be sent to a decode worker ({type(e).__name__}: {e}); a bug in "
                    "batchd-server: the server log has the traceback"
                )
            )
            return
        worker.sender.send(payload)

    def _receive(self, worker: Worker) -> None:
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

    def _timed_out(self, worker: Worker) -> None:
        """``worker``'s oldest task passed its deadline: kill it, redo its tasks elsewhere."""
        head = next(iter(worker.outstanding.values()))
        # The worker is stuck, so what it last wrote stands still.
        task_id, position = int(worker.progress[0]), int(worker.progress[1])
        if task_id != head.task_id:
            position = NOT_BEGUN  # stuck before it: stopped, say; not the task's fault
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
        logger.warning(
            "decode worker %d (pid %s) held batch %d of session %s for more than %g s (%s); "
            "killed it and starting a new one; %s",
            worker.index,
            worker.process.pid,
            head.task.batch_index,
            head.task.spec.session_id,
            self.task_timeout_s,
            where_stuck(position),
            "the batch failed" if failed is not None else "redoing the batch",
        )
        worker.sender.close()
        if self._on_timeout is not None:
            self._on_timeout()
        self._start_replacement(worker)

    def _died(self, worker: Worker) -> None:
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
        worker.sender.close()
        if self._respawn.crash_loop is not None and not was_looping:
            logger.error("%s", self._respawn.crash_loop)
        with self._lock:
            self._fail_queued_if_crash_looping()
        if delay > 0:
            worker.respawn_at = time.monotonic() + delay
        else:
            self._start_replacement(worker)

    def _start_replacement(self, worker: Worker) -> None:
        """Start ``worker``'s replacement; if the system refuses (fork's EAGAIN, EMFILE,
        ENOMEM), count a death before ready and try again after the backoff."""
        if self._stopping:  # stop() may not have waited for this thread: start nothing
            return
        try:
            replacement = spawn_worker(self._ctx, worker.index)
        except Exception as e:
            was_looping = self._respawn.crash_loop is not None
            delay = self._respawn.spawn_failed(f"{type(e).__name__}: {e}")
            worker.respawn_at = time.monotonic() + delay
            logger.error(
                "could not start a replacement for decode worker %d (%s: %s); the other "
                "workers serve meanwhile, trying again in %g s. Check the machine's process, "
                "open file and memory limits",
                worker.index,
                type(e).__name__,
                e,
                delay,
            )
            if self._respawn.crash_loop is not None and not was_looping:
                logger.error("%s", self._respawn.crash_loop)
            with self._lock:
                self._fail_queued_if_crash_looping()
            return
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


def _drain(fd: int) -> None:
    try:
        while os.read(fd, 4096):
            pass
    except BlockingIOError:
        pass
