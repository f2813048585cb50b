"""The node cache's fetch locks: one reader fetches a block while the others wait for it.

A lock per stripe of blocks, across the processes of one cache directory (an
open-file-description byte-range lock on one byte of ``<cache-dir>/fetching``) and across
the threads of a process (a thread lock: a process's byte-range locks do not exclude its
own threads). The kernel drops a dead process's locks, so a worker killed mid-fetch holds no
one up. See NOTE [ Cache files ] in ``blocks.py`` for how the cache uses them.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import stat
import struct
import threading
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Final, Protocol, TypeVar

__all__ = ["FETCH_STRIPES", "FetchLocks"]

FETCH_STRIPES: Final = 4096
"""Fetch locks per cache directory: the blocks of one object take consecutive stripes, so
two blocks share a lock only 4,096 blocks (16 GiB) apart or across objects by chance, and a
shared lock costs a wait, never a wrong answer."""
_FLOCK: Final = struct.Struct("hhqqi4x")
"""``struct flock`` on 64-bit Linux: type, whence, start, len, pid (0 for an OFD lock)."""


class _Block(Protocol):
    """A block's key (``blocks.BlockKey``): its object's hash (hex) and its index."""

    @property
    def object(self) -> str: ...

    @property
    def index(self) -> int: ...


K = TypeVar("K", bound=_Block)


class FetchLocks:
    """The fetch locks of one cache directory, for one process (each opens its own).

    Args:
        path: The lock file (created if missing; its bytes are the stripes).
    """

    def __init__(self, path: Path) -> None:
        # Never through a link, and never blocking on a FIFO put in the file's place.
        flags = os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW | os.O_NONBLOCK
        self._fd = os.open(path, flags, 0o600)
        st = os.fstat(self._fd)
        if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid():
            os.close(self._fd)
            raise OSError(
                errno.EINVAL,
                f"{path} is not a regular file of the server's user; remove it (it is made "
                "again at start)",
            )
        self._stripes = [threading.Lock() for _ in range(FETCH_STRIPES)]

    def close(self) -> None:
        """Close the lock file. Idempotent."""
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    @contextlib.contextmanager
    def hold(self, keys: Sequence[K], *, wait: bool = True) -> Iterator[set[K]]:
        """Hold the locks of ``keys``: another process or thread that asks for any of them
        waits until this one is done. Yields the keys whose locks are held: all of them, or
        with ``wait=False`` those no one else held.

        Every taker takes its stripes in ascending order and holds a stripe's thread lock
        before its byte-range lock, so no two takers wait on each other. The byte-range
        locks are open-file-description locks, which the kernel does not check for
        deadlocks: a process's classic locks are one owner for all its threads, so two
        processes whose threads wait on each other's stripes would be refused as a
        "deadlock" that is not one.
        """
        by_stripe: dict[int, list[K]] = {}
        for k in keys:
            by_stripe.setdefault((int(k.object[:12], 16) + k.index) % FETCH_STRIPES, []).append(k)
        held: list[int] = []
        got: set[K] = set()
        try:
            for stripe in sorted(by_stripe):
                if not self._stripes[stripe].acquire(blocking=wait):
                    continue
                if not _range_lock(self._fd, stripe, fcntl.F_WRLCK, wait=wait):
                    self._stripes[stripe].release()
                    continue
                held.append(stripe)
                got.update(by_stripe[stripe])
            yield got
        finally:
            for stripe in reversed(held):
                with contextlib.suppress(OSError):
                    _range_lock(self._fd, stripe, fcntl.F_UNLCK, wait=False)
                self._stripes[stripe].release()


def _range_lock(fd: int, byte: int, kind: int, *, wait: bool) -> bool:
    """Take (``F_WRLCK``) or drop (``F_UNLCK``) the open-file-description lock of one byte of
    ``fd``; False when ``wait`` is False and someone else holds it."""
    request = _FLOCK.pack(kind, os.SEEK_SET, byte, 1, 0)
    try:
        fcntl.fcntl(fd, fcntl.F_OFD_SETLKW if wait else fcntl.F_OFD_SETLK, request)
    except (BlockingIOError, PermissionError):  # EAGAIN, or EACCES on some systems: held
        return False
    return True
