"""A server instance's lock in the shm directory, and the sweep of what dead instances left.

NOTE [ Instance lock ]
Each ``ShmRegistry`` is one server instance with a random 12-hex id. Its segments are named
``batchd-<instance>-<kind>-<32 random hex>`` and it holds an exclusive ``flock`` on
``batchd-<instance>.lock`` for its whole life. A sweep treats another instance as dead when
it can take that lock itself without blocking (or when the lock file is gone), and then
removes the instance's segments and lock file. flock, unlike a PID check, works between
containers that share ``/dev/shm`` but not a PID namespace. A new instance creates its lock
file, locks it, and only then checks that the path still names the file it locked: a sweeper
that saw the file before it was locked may have taken it for dead and unlinked it, and the
new instance then starts over with a new id. It creates no segment before that check passes.
(A child forked from the server shares the lock, so the instance counts as alive while such
a child lives; that is right, as the child may still map the segments.)
"""

from __future__ import annotations

import fcntl
import logging
import os
import re
import secrets
from dataclasses import dataclass
from pathlib import Path
from typing import Final

from batchd_server.errors import FailedPrecondition, Unavailable
from batchd_server.shm.segments import PREFIX, segment_instance
from batchd_server.shm.space import format_bytes

__all__ = ["InstanceLock", "lock_name", "sweep_dead_instances"]

logger = logging.getLogger(__name__)

_LOCK_RE: Final = re.compile(rf"{PREFIX}-([0-9a-f]{{12}})\.lock")
_LOCK_ATTEMPTS: Final = 8


def lock_name(instance: str) -> str:
    """The name of ``instance``'s lock file in the shm directory."""
    return f"{PREFIX}-{instance}.lock"


@dataclass(frozen=True)
class InstanceLock:
    """A fresh instance id and the open file that holds its ``flock``."""

    instance: str
    fd: int
    path: Path

    @classmethod
    def take(cls, shm_dir: Path) -> InstanceLock:
        """Create, lock and verify a new instance's lock file in ``shm_dir``.

        Raises:
            FailedPrecondition: ``shm_dir`` is not writable.
            Unavailable: Sweepers removed every lock file we made, ``_LOCK_ATTEMPTS`` times.
        """
        for _ in range(_LOCK_ATTEMPTS):
            instance = secrets.token_hex(6)
            path = shm_dir / lock_name(instance)
            flags = os.O_CREAT | os.O_EXCL | os.O_RDWR | os.O_CLOEXEC | os.O_NOFOLLOW
            try:
                fd = os.open(path, flags, 0o600)
            except FileExistsError:
                continue
            except PermissionError as e:
                raise FailedPrecondition(
                    f"cannot create files in {shm_dir} ({e.strerror}); the server needs a "
                    "writable /dev/shm: do not mount it read-only, and run with a tmpfs there"
                ) from e
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                if os.path.samestat(os.fstat(fd), os.stat(path, follow_symlinks=False)):
                    return cls(instance, fd, path)
            except (BlockingIOError, FileNotFoundError):
                pass  # a sweeper took the file for a dead instance's; start over
            except BaseException:
                os.close(fd)
                raise
            os.close(fd)
        raise Unavailable(
            f"could not take an instance lock in {shm_dir} in {_LOCK_ATTEMPTS} attempts: other "
            "processes keep sweeping it; try again"
        )

    def release(self, *, unlink: bool) -> None:
        """Remove the lock file if ``unlink`` (only its owner does), then unlock.

        The file goes first: a newcomer must never lock a file that is about to be removed.
        """
        if unlink:
            self.path.unlink(missing_ok=True)
        os.close(self.fd)


def sweep_dead_instances(shm_dir: Path, *, own_instance: str) -> list[str]:
    """Remove what dead instances left in ``shm_dir``; see NOTE [ Instance lock ].

    Logs one line per dead instance. Entries of ``own_instance`` and of live instances, in
    this process or any other, are never touched.

    Returns:
        Names of the segments removed (lock files not included).
    """
    by_instance: dict[str, list[str]] = {}
    for name in os.listdir(shm_dir):
        lock = _LOCK_RE.fullmatch(name)
        instance = segment_instance(name) or (lock[1] if lock else None)
        if instance is not None and instance != own_instance:
            by_instance.setdefault(instance, []).append(name)
    removed: list[str] = []
    for instance, names in sorted(by_instance.items()):
        removed += _sweep_instance(shm_dir, instance, sorted(names))
    return removed


def _sweep_instance(shm_dir: Path, instance: str, names: list[str]) -> list[str]:
    lock_path = shm_dir / lock_name(instance)
    try:
        lock_fd: int | None = os.open(lock_path, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW)
    except FileNotFoundError:
        lock_fd = None  # it died before creating a segment, or after removing its lock
    except OSError as e:
        logger.warning("not sweeping batchd instance %s: %s", instance, e)
        return []
    try:
        if lock_fd is not None:
            try:
                fcntl.flock(lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                return []  # alive
        removed: list[str] = []
        removed_bytes = 0
        for name in names:
            if segment_instance(name) is None:
                continue
            try:
                size = os.stat(shm_dir / name, follow_symlinks=False).st_size
                os.unlink(shm_dir / name)
            except FileNotFoundError:
                continue  # another sweeper was first
            except OSError as e:
                logger.warning("cannot remove stale segment %s: %s", shm_dir / name, e)
                continue
            removed.append(name)
            removed_bytes += size
        if lock_fd is not None:
            lock_path.unlink(missing_ok=True)
        elif not removed:
            return []  # it exited cleanly between our listing and now
        logger.info(
            "removed %d shared-memory segment(s), %s, left in %s by dead batchd instance %s",
            len(removed),
            format_bytes(removed_bytes),
            shm_dir,
            instance,
        )
        return removed
    finally:
        if lock_fd is not None:
            os.close(lock_fd)
