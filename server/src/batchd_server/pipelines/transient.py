"""I/O errors that say nothing about the sample: retried with backoff, never blamed on it.

An NFS server that restarts answers ``ESTALE`` or ``EIO`` for a moment; a worker that briefly
holds too many descriptors gets ``EMFILE``; a machine short of memory refuses a map with
``ENOMEM``. The sample is fine: reading it again a little later works. :class:`SampleFiles`
(``files.py``) therefore raises :class:`TransientError` for the errnos in
:data:`TRANSIENT_ERRNOS`, and :func:`retrying` runs the whole read again (descriptors
reopened: a stale handle stays stale) up to :data:`TRIES` times, sleeping
:data:`FIRST_DELAY_S`, then four times longer each time (about a second in all). One that is
still failing becomes a bad sample of kind ``transient``, whose message says the error is
usually passing and the file itself may be fine, so that nobody un-verifies good data for it.
A file that gave up in a batch fails at once for the rest of that batch: a shard on a dead
mount costs one round of retries per batch, not one per sample.

Tests only: ``BATCHD_TESTING_READ_ERRORS`` makes reads of named files fail, so that the
retries can be exercised in real worker processes without a failing disk. Its value is
``ERRNO:COUNT:PATH`` entries separated by commas: the first COUNT reads (-1: every read) of
the catalog path PATH by each session in each worker fail with ERRNO (a name such as
``EIO``). A server that sees it logs a warning; never set it anywhere else.
"""

from __future__ import annotations

import errno
import logging
import os
import time
from collections.abc import Callable, Iterable
from typing import Final, TypeVar

from batchd_server.pipelines.base import BadSample

__all__ = [
    "FAULTS_ENV",
    "FIRST_DELAY_S",
    "TRANSIENT_ERRNOS",
    "TRIES",
    "InjectedFaults",
    "TransientError",
    "retrying",
]

logger = logging.getLogger(__name__)

TRANSIENT_ERRNOS: Final = frozenset(
    {
        errno.EIO,
        errno.EMFILE,
        errno.ENFILE,
        errno.ESTALE,
        errno.ENOMEM,
        errno.EAGAIN,
        errno.ETIMEDOUT,
    }
)
TRIES: Final = 4
FIRST_DELAY_S: Final = 0.05
FAULTS_ENV: Final = "BATCHD_TESTING_READ_ERRORS"
_T = TypeVar("_T")


class TransientError(Exception):
    """An OSError of :data:`TRANSIENT_ERRNOS` while reading ``path``; retried."""

    def __init__(self, path: str, error: OSError) -> None:
        name = errno.errorcode.get(error.errno or 0, str(error.errno))
        super().__init__(f"{path}: {error.strerror or error} ({name})")
        self.path = path


def is_transient(error: OSError) -> bool:
    return error.errno in TRANSIENT_ERRNOS


def retrying(
    attempt: Callable[[], _T],
    *,
    forget: Callable[[Iterable[str]], None],
    given_up: dict[str, str],
    sleep: Callable[[float], None] = time.sleep,
) -> _T:
    """``attempt()``, run again after each :class:`TransientError` up to :data:`TRIES` times.

    Args:
        forget: Drops cached descriptors and maps of the paths it gets, before a retry.
        given_up: Path -> message of files that kept failing in this batch; filled here, and
            such a file fails at once (the caller clears it per batch).

    Raises:
        BadSample: ``transient``, after the last try, or at once for a file in ``given_up``.
    """
    delay = FIRST_DELAY_S
    started = time.monotonic()
    for tries in range(1, TRIES + 1):
        try:
            return attempt()
        except TransientError as e:
            forget([e.path])
            message = given_up.get(e.path)
            if message is None and tries == TRIES:
                message = given_up[e.path] = (
                    f"{e}, an error that is usually transient, on each of {tries} tries over "
                    f"{time.monotonic() - started:.1f} s; the file itself may well be fine: "
                    "check the storage it is on (and the server's open-file limit for EMFILE)"
                )
            if message is not None:
                raise BadSample("transient", message) from e
            logger.debug("transient error, retrying in %g s: %s", delay, e)
            sleep(delay)
            delay *= 4
    raise AssertionError("unreachable")  # pragma: no cover


class InjectedFaults:
    """The test-only read failures of :data:`FAULTS_ENV` (see the module docs)."""

    def __init__(self, spec: str) -> None:
        self._left: dict[str, tuple[int, int]] = {}
        for entry in filter(None, (e.strip() for e in spec.split(","))):
            name, count, path = entry.split(":", 2)
            self._left[path] = (getattr(errno, name), int(count))
        logger.warning(
            "%s is set: reads of %s will fail on purpose", FAULTS_ENV, sorted(self._left)
        )

    @classmethod
    def from_env(cls) -> InjectedFaults | None:
        spec = os.environ.get(FAULTS_ENV)
        return cls(spec) if spec else None

    def check(self, path: str) -> None:
        """Raise the OSError due for a read of ``path``, if one is."""
        due = self._left.get(path)
        if due is None or due[1] == 0:
            return
        code, count = due
        self._left[path] = (code, count - 1 if count > 0 else count)
        raise OSError(code, os.strerror(code), path)
