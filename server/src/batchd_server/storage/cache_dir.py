"""The node cache's directory as a thing to trust: who owns it and who may write in it, how
its files are opened (never through a link, never blocking on a FIFO, only regular files of
this server's user), and its ledger of bytes (NOTE [ Cache files ] in ``blocks.py``).

NOTE [ Ledger ]
The ledger (``<cache-dir>/usage``) holds what every file of the cache takes (8 bytes), then
one change counter per block directory (256 of 8 bytes). Every change to a block directory
(a file made for writing, linked, deleted; a record written) is made under the ledger's lock
together with the bytes it costs or gives back, and bumps its directory's counter. So a
recount (``BlockStore.scan``) can list a directory *without* the lock and know, from its
counter, whether the directory changed while it listed: a listing whose counter did not move
is exact. Writers never wait for a listing, and the ledger does not drift during one.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import stat
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Final

from batchd_server.errors import FailedPrecondition

__all__ = ["SLOTS", "Ledger", "LedgerState", "check_dir", "open_file", "safe_file"]

logger = logging.getLogger(__name__)

SLOTS: Final = 256
"""Change counters in the ledger: one per block directory (``blocks/00`` .. ``blocks/ff``)."""
_OPEN_FLAGS: Final = os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
"""Every file of the cache is opened with these: a symbolic link put in place of a file is
refused (ELOOP), and a FIFO does not block the open."""


def check_dir(path: Path, *, what: str = "the cache directory") -> None:
    """Refuse a directory another user could change under the server: one that is not a
    directory (a link counts as one only for the root the operator named), is owned by
    another user, or is writable by its group or by anyone.

    Raises:
        FailedPrecondition: saying what is wrong and what to run to fix it.
    """
    try:
        st = os.stat(path) if what == "the cache directory" else os.lstat(path)
    except OSError as e:
        raise FailedPrecondition(f"{what} {path} cannot be read: {e.strerror or e}") from e
    uid = os.geteuid()
    if not stat.S_ISDIR(st.st_mode):
        raise FailedPrecondition(
            f"{what} {path} is not a directory (a link or a file is in its place); remove it "
            "and let the server make it, or choose another --cache-dir"
        )
    if st.st_uid != uid:
        raise FailedPrecondition(
            f"{what} {path} is owned by uid {st.st_uid}, not by the server's uid {uid}: "
            f"another user could change the cached bytes; run `chown -R {uid} {path}` or "
            "choose another --cache-dir"
        )
    if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        raise FailedPrecondition(
            f"{what} {path} is writable by its group or by anyone (mode "
            f"{stat.S_IMODE(st.st_mode):04o}): another user could change the cached bytes; run "
            f"`chmod go-w {path}` or choose another --cache-dir"
        )


def open_file(path: str | Path, flags: int, mode: int = 0o600) -> int:
    """``os.open`` of one of the cache's files, with :data:`_OPEN_FLAGS`."""
    return os.open(path, flags | _OPEN_FLAGS, mode)


def safe_file(fd: int) -> os.stat_result | None:
    """The file's status if it is a regular file of this server's user; None otherwise (a
    FIFO, a device, a directory, another user's file put in the cache's place)."""
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid():
        return None
    return st


class LedgerState:
    """The ledger as one holder of its lock sees it (:meth:`Ledger.locked`)."""

    def __init__(self, used: int) -> None:
        self.used = used
        """What the files take; assign to change it."""
        self.touched: set[int] = set()

    def touch(self, slot: int) -> None:
        """Note a change to block directory ``slot``: its counter moves when the lock goes."""
        self.touched.add(slot)


class Ledger:
    """The ledger file of one cache directory, for one process (NOTE [ Ledger ])."""

    def __init__(self, path: Path) -> None:
        self._fd = open_file(path, os.O_RDWR | os.O_CREAT)
        if safe_file(self._fd) is None:
            os.close(self._fd)
            raise FailedPrecondition(
                f"the cache's ledger {path} is not a regular file of the server's user; "
                "remove it (the server recounts the files at start)"
            )
        # flock excludes other processes; threads of this one share the descriptor.
        self._lock = threading.Lock()

    @property
    def closed(self) -> bool:
        return self._fd < 0

    def close(self) -> None:
        with self._lock:
            if self._fd >= 0:
                os.close(self._fd)
                self._fd = -1

    @contextlib.contextmanager
    def locked(self) -> Iterator[LedgerState]:
        """The ledger, locked against every thread and process."""
        with self._lock:
            fcntl.flock(self._fd, fcntl.LOCK_EX)
            try:
                raw = os.pread(self._fd, 8, 0)
                state = LedgerState(int.from_bytes(raw, "little") if len(raw) == 8 else 0)
                before = state.used
                yield state
                if state.used != before:
                    os.pwrite(self._fd, max(state.used, 0).to_bytes(8, "little"), 0)
                for slot in state.touched:
                    at = 8 + 8 * slot
                    raw = os.pread(self._fd, 8, at)
                    count = int.from_bytes(raw, "little") if len(raw) == 8 else 0
                    os.pwrite(self._fd, ((count + 1) & (2**64 - 1)).to_bytes(8, "little"), at)
            finally:
                fcntl.flock(self._fd, fcntl.LOCK_UN)

    def counters(self) -> list[int]:
        """Every block directory's change counter."""
        with self.locked():
            return self.peek_counters()

    def peek_counters(self) -> list[int]:
        """As :meth:`counters`, by a holder of :meth:`locked`."""
        raw = os.pread(self._fd, 8 * SLOTS, 8).ljust(8 * SLOTS, b"\0")
        return [int.from_bytes(raw[8 * i : 8 * i + 8], "little") for i in range(SLOTS)]
