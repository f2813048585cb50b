"""How a share group resolves its waiters' futures outside every lock (``share.py``, NOTE
[ Share groups ], its last paragraph): a waiter's done-callbacks take the waiter's session's
lock, which a caller holding the group's lock, or another session's, must not wait for."""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable
from concurrent.futures import CancelledError, Future

from batchd_server.workers.task import BatchResult

__all__ = ["chain", "later", "when_done"]


def later(actions: list[Callable[[], object]]) -> None:
    """Run ``actions`` (resolving waiters' futures) on a thread of their own: the caller
    holds its session's lock, and a waiter's done-callbacks take the waiter's session's."""
    if actions:
        threading.Thread(
            target=lambda: [a() for a in actions], name="batchd-share-settle", daemon=True
        ).start()


def when_done(future: Future[BatchResult], fn: Callable[[Future[BatchResult]], object]) -> None:
    """Call ``fn(future)`` once ``future`` is done: on the thread that finishes it, or, when it
    is done already (a fast worker), on a thread of its own, never inside this call, whose
    caller holds the group's lock and a session's."""
    registered = False

    def done(f: Future[BatchResult]) -> None:
        if registered:
            fn(f)
        else:
            later([functools.partial(fn, f)])

    future.add_done_callback(done)
    registered = True


def chain(waiter: Future[BatchResult], own: Future[BatchResult]) -> None:
    """Resolve ``waiter`` (set running) as ``own`` resolved."""
    if own.cancelled():
        waiter.set_exception(CancelledError())
    elif (error := own.exception()) is not None:
        waiter.set_exception(error)
    else:
        waiter.set_result(own.result())
