"""Waiting for a server that is not there yet: a pool scaled to zero, a sidecar starting.

A Loader's first OpenSession on a target where no server answers fails at once with
``Unavailable`` -- unless the Loader was told to wait (``wait_for_server_s``, default
``$BATCHD_WAIT_FOR_SERVER_S``, else 0). Then it tries again with backoff until a server
answers or the wait runs out, and says that it waits: a warning through ``logging`` at the
first failed try and every :data:`LOG_EVERY_S` after, naming the address and the seconds so
far, so a job that waits for its pool to start is visibly waiting and not hung. Each try
resolves the target again (a ``dns:///`` name that has no address while the pool is at zero
has them once replicas are up, and the Loader stripes over them) on fresh channels, bounded
by ``timeout_s`` and by the time left.

Only ``Unavailable`` is waited out (nothing listens, the connection is refused or not
answered, the server is starting); any other refusal -- a wrong dataset, a missing token --
is the caller's at once. When the wait runs out the error names the address, the wait and
the last error, instead of a deadline deep in gRPC.
"""

from __future__ import annotations

import logging
import random
import time
from collections.abc import Callable
from typing import Final, TypeVar

from batchd.errors import Unavailable

__all__ = ["LOG_EVERY_S", "WAIT_FOR_SERVER_ENV", "ServerWait", "wait_for_server"]

logger = logging.getLogger(__name__)

WAIT_FOR_SERVER_ENV: Final = "BATCHD_WAIT_FOR_SERVER_S"
LOG_EVERY_S: Final = 15.0
"""The waiting is logged at the first failed try, then at most this often."""
_FIRST_DELAY_S: Final = 0.1
_MAX_DELAY_S: Final = 2.0
_T = TypeVar("_T")


class ServerWait:
    """What one wait for a server came to: the seconds waited and the tries it took."""

    def __init__(self) -> None:
        self.waited_s = 0.0
        self.tries = 0


def wait_for_server(
    attempt: Callable[[float], _T],
    *,
    target: str,
    wait_s: float,
    record: ServerWait,
    clock: Callable[[], float] = time.monotonic,
    sleep: Callable[[float], None] = time.sleep,
) -> _T:
    """``attempt(seconds_left)`` until it returns, retrying each ``Unavailable`` with backoff
    for up to ``wait_s`` seconds; ``record`` gets the time waited and the tries.

    Args:
        attempt: One try; gets the seconds left of the wait to bound its own calls (the whole
            wait when ``wait_s`` is 0: one try, as without waiting).
        target: The server, as the user named it, for the log and the error.
        wait_s: How long to wait for a server to answer; 0: one try, and its error is raised
            with a word on how to wait for a pool that scales to zero.

    Raises:
        Unavailable: no server answered within ``wait_s``; the message names ``target``, the
            wait, the tries and the last error.
    """
    started = clock()
    deadline = started + wait_s
    delay = _FIRST_DELAY_S
    logged_at: float | None = None
    while True:
        record.tries += 1
        try:
            result = attempt(max(deadline - clock(), 0.0) if wait_s > 0 else 0.0)
        except Unavailable as e:
            now = clock()
            record.waited_s = now - started
            if wait_s <= 0:
                raise Unavailable(
                    f"{e}. If it is a pool that scales to zero and starts on demand, pass "
                    f"wait_for_server_s= (or set ${WAIT_FOR_SERVER_ENV}) to wait for it"
                ) from e
            if now >= deadline:
                raise Unavailable(
                    f"no batchd server answered at {target!r} within wait_for_server_s="
                    f"{wait_s:g} s ({record.tries} tries; the last error: {e}). Check that the "
                    "server, or the pool and its autoscaler, can start there (for a KEDA pool: "
                    "kubectl describe scaledobject batchd-server), or pass a larger "
                    "wait_for_server_s"
                ) from e
            if logged_at is None or now - logged_at >= LOG_EVERY_S:
                logged_at = now
                logger.warning(
                    "batchd: waiting for the batchd server at %r (a pool scaled to zero starts "
                    "on demand): %.0f s so far, up to wait_for_server_s=%g s%s",
                    target,
                    record.waited_s,
                    wait_s,
                    f"; it said: {e}" if record.tries == 1 else "",
                )
            else:
                logger.debug("batchd: try %d on %r failed: %s", record.tries, target, e)
            pause = min(delay * random.uniform(0.5, 1.0), max(0.0, deadline - now))
            if pause > 0:
                sleep(pause)
            delay = min(delay * 2, _MAX_DELAY_S)
            continue
        record.waited_s = clock() - started if record.tries > 1 else 0.0
        if record.tries > 1:
            logger.warning(
                "batchd: the batchd server at %r answered after %.1f s (%d tries)",
                target,
                record.waited_s,
                record.tries,
            )
        return result
