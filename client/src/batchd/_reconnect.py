"""Retrying against a server that went away: backoff, one deadline, one error at the end.

A Loader that loses its server mid-epoch (killed, restarted, rescheduled) retries for
``reconnect_timeout_s`` seconds. Sampling is a pure function of the session's options and
catalog snapshot, so a new session on the same snapshot, streamed from the first batch the
loop has not seen, continues the epoch exactly where it broke off.
"""

from __future__ import annotations

import logging
import random
import time
from collections.abc import Callable
from typing import Final, TypeVar

from batchd.errors import ResourceExhausted, Unavailable

__all__ = ["DEFAULT_RECONNECT_TIMEOUT_S", "retry_until"]

logger = logging.getLogger(__name__)

DEFAULT_RECONNECT_TIMEOUT_S: Final = 60.0
_FIRST_DELAY_S: Final = 0.1
_MAX_DELAY_S: Final = 2.0
_T = TypeVar("_T")


def retry_until(
    attempt: Callable[[float], _T],
    *,
    target: str,
    timeout_s: float,
    lost_at: float,
    cause: BaseException,
    failed_before: int = 0,
    clock: Callable[[], float] = time.monotonic,
    sleep: Callable[[float], None] = time.sleep,
) -> _T:
    """``attempt(seconds_left)`` until it returns, retrying each ``Unavailable`` and
    ``ResourceExhausted`` with backoff until ``timeout_s`` after ``lost_at``.

    A server that is back may still refuse the new session for a while: when the client lost
    it without closing its old session (the server was stopped or cut off, not restarted),
    that session holds its place in the client's limits until its lease ends. Refusals are
    retried like an absent server, so the lease can run out first.

    Args:
        attempt: One try; gets the seconds left before the deadline to bound its own calls
            (0: a single try without waiting for the server). Anything but ``Unavailable``
            and ``ResourceExhausted`` it raises goes to the caller at once.
        target: The server, for the final error.
        timeout_s: How long after ``lost_at`` to keep trying; 0: one try, and its error
            is raised as it is.
        lost_at: When the server was lost (``clock()`` time): a server that accepts a new
            session but loses it again before any batch does not restart the clock...
        cause: The failure that started the retrying.
        failed_before: ...nor the backoff: tries of this outage that succeeded here but
            failed before a batch came; the first try waits as if they had failed here.

    Raises:
        Unavailable: still failing at the deadline; the message names ``target``, the time
            waited and the last error.
        ResourceExhausted: the server answered at the deadline, but refused the session; the
            message says so and carries the server's, which names the limit.
    """
    if timeout_s <= 0:
        return attempt(0.0)
    deadline = lost_at + timeout_s
    delay = _FIRST_DELAY_S
    last: BaseException = cause
    tries = 0
    started = clock()
    if failed_before == 0:
        logger.warning(
            "batchd: lost the server at %r; reconnecting, and the epoch resumes where it "
            "stopped: nothing to do unless reconnecting fails (the error was: %s)",
            target,
            cause,
        )
    else:
        delay = min(_FIRST_DELAY_S * 2 ** (failed_before - 1), _MAX_DELAY_S)
        _pause(delay, deadline, clock, sleep)
        delay = min(delay * 2, _MAX_DELAY_S)
    while True:
        left = deadline - clock()
        if left <= 0:
            if isinstance(last, ResourceExhausted):
                raise ResourceExhausted(
                    f"the batchd server at {target!r} is back after it went away ({cause}), "
                    f"but it still refused a new session for this Loader after "
                    f"reconnect_timeout_s={timeout_s:g} s ({tries} tries): {last}"
                ) from last
            if last is cause and failed_before:
                raise Unavailable(
                    f"the batchd server at {target!r} took new sessions but lost each before "
                    f"a batch came ({failed_before} times within reconnect_timeout_s="
                    f"{timeout_s:g} s); the last failure: {cause}. Check the server's log"
                ) from cause
            raise Unavailable(
                f"the batchd server at {target!r} went away ({cause}) and could not be "
                f"reached again within reconnect_timeout_s={timeout_s:g} s ({tries} tries; "
                f"last error: {last}). Check that `batchd-server serve` runs there, or pass "
                "a larger reconnect_timeout_s"
            ) from last
        tries += 1
        try:
            result = attempt(left)
        except (Unavailable, ResourceExhausted) as e:
            last = e
            logger.debug("batchd: reconnect try %d to %r failed: %s", tries, target, e)
        else:
            waited = clock() - started
            level = logging.WARNING if failed_before == 0 else logging.DEBUG
            logger.log(level, "batchd: back on %r after %.1f s (%d tries)", target, waited, tries)
            return result
        _pause(delay, deadline, clock, sleep)
        delay = min(delay * 2, _MAX_DELAY_S)


def _pause(
    delay_s: float, deadline: float, clock: Callable[[], float], sleep: Callable[[float], None]
) -> None:
    """Sleep about ``delay_s`` (jittered, so clients lost together do not retry together),
    never past ``deadline``."""
    pause = min(delay_s * random.uniform(0.5, 1.0), max(0.0, deadline - clock()))
    if pause > 0:
        sleep(pause)
