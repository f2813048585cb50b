"""Planning's long Python loops let the server's other threads in as they go.

An epoch's plan is built on the thread of the call that asked for it (OpenSession, or a
stream starting an epoch), in the server's one process. Its array work releases the
interpreter, but a loop of Python steps (best-fit's placement, a schedule's batches) holds it
but for a moment every few milliseconds, and a gRPC call needs it several times on several
threads: each waits for such a moment, so one client's big open would slow every other
client's calls many times over. A loop that calls a :class:`Pace` every step sleeps
``rest_s`` (with the interpreter released) once every ``slice_s`` of work, long enough for
the waiting threads to take their turns: a fifth more time for the loop, and other calls
answered as if it were not running.

And while any plan is being built, the cyclic garbage collector waits
(:func:`collector_paused`): building a plan allocates enough to set off full collections,
each a pause of every thread of the server for as long as it takes to walk every object
(some 100 ms each, several per second, measured at a million documents), and a plan makes
no reference cycles for it to find. The collector runs again once the last plan is built.
"""

from __future__ import annotations

import gc
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Final

__all__ = ["REST_S", "SLICE_S", "Pace", "collector_paused"]

SLICE_S: Final = 0.005
"""Work between rests: CPython's own switch interval."""
REST_S: Final = 0.001


class Pace:
    """Call it every step of a long loop; it rests once per ``slice_s`` of the loop's time."""

    def __init__(self, slice_s: float = SLICE_S, rest_s: float = REST_S) -> None:
        self.slice_s = slice_s
        self.rest_s = rest_s
        self._since = time.perf_counter()

    def __call__(self) -> None:
        if time.perf_counter() - self._since >= self.slice_s:
            time.sleep(self.rest_s)
            self._since = time.perf_counter()


_lock = threading.Lock()
_building = 0
"""Plans being built now, on any thread."""
_was_enabled = False
"""Whether the collector ran when the first of them began."""


@contextmanager
def collector_paused() -> Iterator[None]:
    """The cyclic garbage collector paused while any plan is built (see the module's note);
    nests, and leaves a collector that was off off."""
    global _building, _was_enabled
    with _lock:
        if _building == 0:
            _was_enabled = gc.isenabled()
            gc.disable()
        _building += 1
    try:
        yield
    finally:
        with _lock:
            _building -= 1
            if _building == 0 and _was_enabled:
                gc.enable()
