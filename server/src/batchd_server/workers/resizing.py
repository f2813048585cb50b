"""The worker pool's size changing while it serves (``--workers MIN..MAX``, see ``sizing.py``).

:class:`Resizable` is part of ``WorkerPool`` (a base class, kept apart so the pool's module
stays readable): :meth:`~Resizable.resize` only records the wanted size and wakes the
dispatcher; the dispatcher thread, which alone changes the list of workers, then starts new
workers (they take tasks once they said ready, as replacements do) or retires idle ones.

A retired worker holds no task when it is chosen and gets none after, because it leaves the
list the dispatcher assigns from in the same step, under the pool's lock; it is asked to exit
like at shutdown and reaped by a later round. So shrinking never redoes or loses a batch.
The list is replaced, never changed in place, when workers join or leave, so the threads
that read it without the lock (``alive``, ``pids``) see either the old list or the new one.
"""

from __future__ import annotations

import logging
import os
import threading
from multiprocessing.context import SpawnContext
from typing import Final

from batchd_server.workers.fair_queue import FairQueue
from batchd_server.workers.handle import Pending, Worker, spawn_worker
from batchd_server.workers.sender import pickled

__all__ = ["Resizable"]

logger = logging.getLogger(__name__)

_PAGE: Final = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


class Resizable:
    """Growing and shrinking the pool; ``WorkerPool`` provides the state it works on."""

    size: int
    _workers: list[Worker]
    _retired: list[Worker]
    _queue: FairQueue[Pending]
    _lock: threading.Lock
    _ctx: SpawnContext
    _stopping: bool

    def _wake(self) -> None:
        raise NotImplementedError

    def resize(self, size: int) -> None:
        """Run ``size`` workers from the dispatcher's next round on."""
        if size < 1:
            raise ValueError(f"size={size} must be >= 1")
        with self._lock:
            self.size = size
        self._wake()

    def load(self) -> tuple[int, int]:
        """(workers holding a task, tasks waiting for a worker)."""
        with self._lock:
            return sum(1 for w in self._workers if w.outstanding), len(self._queue)

    def largest_rss_bytes(self) -> int:
        """The resident memory of the largest worker (what one more would need), 0 if
        unknown."""
        largest = 0
        for worker in self._workers:
            try:
                with open(f"/proc/{worker.process.pid}/statm", encoding="ascii") as f:
                    largest = max(largest, int(f.read().split()[1]) * _PAGE)
            except (OSError, ValueError, IndexError):
                continue
        return largest

    def _apply_size(self) -> None:
        """Start or retire workers until ``size`` run; reap retired ones (dispatcher
        thread only)."""
        with self._lock:
            if self._stopping:
                return
            extra = len(self._workers) - self.size
            idle = [w for w in self._workers if w.ready and w.respawn_at is None]
            leaving = [w for w in reversed(idle) if not w.outstanding][: max(0, extra)]
            if leaving:
                self._workers = [w for w in self._workers if w not in leaving]
        for worker in leaving:
            worker.sender.send(pickled(None))
            self._retired.append(worker)
            logger.info("retiring decode worker %d (pid %s)", worker.index, worker.process.pid)
        used = {w.index for w in self._workers}
        free = (i for i in range(len(used) + self.size) if i not in used)
        while len(self._workers) < self.size:
            index = next(free)
            try:
                worker = spawn_worker(self._ctx, index)
            except Exception as e:
                logger.warning(
                    "could not start decode worker %d to grow the pool (%s: %s); the "
                    "others serve meanwhile",
                    index,
                    type(e).__name__,
                    e,
                )
                break
            self._workers = [*self._workers, worker]
            logger.info("started decode worker %d (pid %s)", index, worker.process.pid)
        for worker in [w for w in self._retired if not w.process.is_alive()]:
            worker.sender.close()
            self._retired.remove(worker)
