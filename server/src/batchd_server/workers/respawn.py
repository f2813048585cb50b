"""When to start a replacement for a dead worker, and when to call it a crash loop.

A worker killed now and then (the OOM killer, a decoder segfault, a task deadline) is
replaced at once. Deaths that come in a burst are replaced with exponential backoff: the
first death in :data:`WINDOW_S` costs nothing, each further one doubles the pause before
its replacement starts (from :data:`FIRST_DELAY_S` up to :data:`MAX_DELAY_S`), so a worker
that cannot live does not cost the server a core in a tight spawn loop.

A worker that dies before it said ready (a broken install, a module that crashes at
import, an environment the interpreter refuses) will never serve. After
:data:`CRASH_LOOP_STARTS` such deaths in a row, with no worker getting ready in between,
the pool is in a *crash loop*: health reports NOT_SERVING with :meth:`RespawnPolicy.crash_loop`
as the reason, and while no worker is ready the pool fails tasks with Unavailable instead of
queueing them forever. It keeps trying (every :data:`MAX_DELAY_S` at most); the first worker
that gets ready ends the crash loop.

A replacement the system refuses to start (fork's EAGAIN, a full file table, no memory) is
such a death too (:meth:`RespawnPolicy.spawn_failed`), and is never retried at once.
"""

from __future__ import annotations

import collections
import time
from collections.abc import Callable
from typing import Final

__all__ = ["CRASH_LOOP_STARTS", "FIRST_DELAY_S", "MAX_DELAY_S", "WINDOW_S", "RespawnPolicy"]

WINDOW_S: Final = 60.0
"""Deaths this recent count towards the backoff."""
FIRST_DELAY_S: Final = 0.25
MAX_DELAY_S: Final = 10.0
CRASH_LOOP_STARTS: Final = 5
"""Workers that died before getting ready, in a row, that make a crash loop."""


class RespawnPolicy:
    """Counts worker deaths; says how long to wait before each replacement. Not thread-safe:
    the pool's dispatcher thread is its only writer (readers only read a string)."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._deaths: collections.deque[float] = collections.deque()
        self._failed_starts = 0
        self._last_start_failure = ""
        self._crash_loop: str | None = None

    def died(self, *, before_ready: bool, how: str) -> float:
        """A worker died (``how``: its exit code or signal); the seconds to wait before
        starting its replacement."""
        now = self._clock()
        self._deaths.append(now)
        while self._deaths and now - self._deaths[0] > WINDOW_S:
            self._deaths.popleft()
        recent = len(self._deaths)
        if before_ready:
            self._failed_starts += 1
            self._last_start_failure = how
            if self._failed_starts >= CRASH_LOOP_STARTS:
                self._crash_loop = (
                    f"decode workers keep dying before they are ready ({self._failed_starts} "
                    f"in a row, the last with {how}): a crash loop. The server keeps "
                    f"restarting them every {MAX_DELAY_S:g} s at most; its log has their "
                    "output. Check that batchd-server and the decoders it imports are "
                    "installed completely, and the machine's memory and process limits"
                )
        if recent <= 1:
            return 0.0
        return min(FIRST_DELAY_S * 2 ** (recent - 2), MAX_DELAY_S)

    def spawn_failed(self, error: str) -> float:
        """Starting a replacement failed with ``error``: counted as a worker that died before
        it was ready; the seconds to wait before the next try, at least
        :data:`FIRST_DELAY_S`."""
        return max(FIRST_DELAY_S, self.died(before_ready=True, how=f"a failed start ({error})"))

    def ready(self) -> None:
        """A worker got ready: whatever kept them from starting is gone."""
        self._failed_starts = 0
        self._crash_loop = None

    @property
    def crash_loop(self) -> str | None:
        """Why the pool is in a crash loop (one sentence with the remedy), or None."""
        return self._crash_loop
