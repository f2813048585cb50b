"""What a worker process spends on fetching from object stores, in all: one pool of fetch
threads, and one budget of bytes fetched ahead of their reads.

Every reader of a process (a worker serves many sessions, each with one reader per source)
submits its fetches to :func:`fetch_pool` and reserves what it fetches ahead from
:data:`AHEAD`: a tenant opening many sessions gets more work queued, not more threads or
more memory. Made lazily and again after a fork (a pool's threads and a budget's count do
not cross one).
"""

from __future__ import annotations

import os
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Final

__all__ = ["AHEAD", "AHEAD_BYTES", "FETCH_THREADS", "AheadBudget", "fetch_pool"]

FETCH_THREADS: Final = 64
"""Objects a worker process fetches at once, for all its readers: the images of a batch of
64 in one round trip. A small object's fetch costs its latency, not its bytes (at 50 ms, 8
at a time held two workers to about 280 images a second, half what they decode); a thread
waiting on the store holds no GIL, and the threads start only as fetches need them."""
AHEAD_BYTES: Final = 256 << 20
"""The most bytes a worker process may have fetched ahead of their reads, in flight or
waiting, for all its readers together."""


class AheadBudget:
    """Bytes reserved by fetches ahead (:meth:`take` before the fetch, :meth:`give` once
    its bytes are read or dropped). Thread-safe."""

    def __init__(self, limit: int) -> None:
        if limit < 1:
            raise ValueError(f"limit={limit} must be >= 1")
        self.limit = limit
        self._used = 0
        self._lock = threading.Lock()

    @property
    def used(self) -> int:
        """Bytes reserved now."""
        with self._lock:
            return self._used

    def take(self, count: int) -> bool:
        """Reserve ``count`` bytes if they fit under the limit; whether they did."""
        with self._lock:
            if self._used + count > self.limit:
                return False
            self._used += count
            return True

    def give(self, count: int) -> None:
        """Return ``count`` bytes that :meth:`take` reserved."""
        with self._lock:
            self._used = max(self._used - count, 0)


class _PerProcess:
    def __init__(self) -> None:
        self.pid = -1
        self.pool: ThreadPoolExecutor | None = None
        self.lock = threading.Lock()


_this = _PerProcess()


def fetch_pool() -> ThreadPoolExecutor:
    """This process's fetch threads (:data:`FETCH_THREADS` at most), shared by its readers.
    Never shut down: a fetch stuck in the retries of a store that is down ends on its own,
    and a reader's close cancels only what it queued."""
    with _this.lock:
        if _this.pool is None or _this.pid != os.getpid():
            _this.pool = ThreadPoolExecutor(FETCH_THREADS, thread_name_prefix="batchd-fetch")
            _this.pid = os.getpid()
        return _this.pool


AHEAD: Final = AheadBudget(AHEAD_BYTES)
"""This process's budget of bytes fetched ahead (a spawned worker starts with its own)."""
