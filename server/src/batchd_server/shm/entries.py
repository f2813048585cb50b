"""Files of a bounded directory of entries: the decode cache's tiers (``decode_cache/``).

A tier is a directory of immutable entry files and one usage file. The shared-memory tier
lives in the shm directory beside the segments and is named like them, so a dead server's
entries are swept with its segments (NOTE [ Instance lock ]):
``batchd-<instance>-dc-<32 hex>`` for entries, ``batchd-<instance>-dctmp-<32 hex>`` for
writes in flight and ``batchd-<instance>-dcuse-<32 hex>`` for the usage file. The disk tier
(a directory the operator names) uses ``dc-<32 hex>``, ``dctmp-<32 hex>`` and ``dc-usage``,
and outlives the server: what it holds is found again by the next one.

NOTE [ Entry files ]
Any process (the workers) may add an entry: it first reserves the entry's bytes in the usage
file (an int64 under ``flock``, refused when the tier's bound would be passed), then writes
a fresh temporary file and renames it over the entry's name. A reader therefore sees a
whole entry or none, never half of one; a worker killed mid-write leaves only a temporary
file and a reservation too many. Both are corrected by the tier's owner (the server's main
process), which periodically counts what the directory really holds, removes temporary
files older than a few seconds, and writes that count back to the usage file under the same
lock (:meth:`EntryDir.recount`). Entries are removed only by the owner. Every file is mode
0600 and opened with ``O_NOFOLLOW``.

NOTE [ Foreign entries ]
The shared-memory tier lives in ``/dev/shm``, which every local user may write, and an
entry's name is no secret (the server's instance id is in every segment's name, and the
key is computed from what anyone who can read the dataset knows). So a name proves nothing:
an entry is served only when it is a regular file owned by the server's user that neither
its group nor others may write (:func:`foreign`). Anything else under an entry's name (another
user's file, a symlink, a FIFO, a device) is a miss that is logged and never read, and the
owner's scans neither count nor evict it. The sticky bit of ``/dev/shm`` keeps other users
from removing or renaming over the server's own files. The disk tier's directory must
itself be the server user's and closed to others (``decode_cache/directory.py``); its
entries get the same check.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import secrets
import stat
import struct
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Final

from batchd_server.shm.segments import PREFIX

__all__ = ["EntryDir", "EntryStat", "disk_entry_dir", "foreign", "shm_entry_dir"]

logger = logging.getLogger(__name__)

_USAGE = struct.Struct("<q")
_STALE_TMP_S: Final = 30.0
"""A temporary file older than this is a dead writer's (an entry takes milliseconds)."""
_CREATE: Final = os.O_CREAT | os.O_EXCL | os.O_WRONLY | os.O_CLOEXEC | os.O_NOFOLLOW
_READ: Final = os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW | os.O_NONBLOCK
"""``O_NONBLOCK``: a FIFO under an entry's name opens at once (and is then refused), instead
of blocking the worker until someone writes to it."""
_WARN_EVERY_S: Final = 60.0
_warned: dict[str, float] = {}
"""When each directory's last foreign entry was logged (one line a minute each at most)."""


def foreign(st: os.stat_result) -> str | None:
    """Why a file with this ``lstat``/``fstat`` is no entry of ours (NOTE [ Foreign entries ]),
    or None when it may be one."""
    if not stat.S_ISREG(st.st_mode):
        return "not a regular file"
    if st.st_uid != os.geteuid():
        return f"owned by uid {st.st_uid}, not the server's {os.geteuid()}"
    if st.st_mode & 0o022:
        return f"writable by others (mode {stat.S_IMODE(st.st_mode):04o})"
    return None


def _refuse(directory: str, name: str, why: str) -> None:
    """Log a foreign entry, at most once a minute per directory."""
    now = time.monotonic()
    if now - _warned.get(directory, -_WARN_EVERY_S) < _WARN_EVERY_S:
        return
    _warned[directory] = now
    logger.warning(
        "decode cache: %s is %s; it is not served (a miss) and not counted. Something other "
        "than this server put it there: remove it, and keep the directory to this server's "
        "user (further ones are logged once a minute)",
        os.path.join(directory, name),
        why,
    )


@dataclass(frozen=True)
class EntryStat:
    """One entry file as the owner's scan saw it."""

    name: str
    """The entry's 32 hex."""
    size: int
    used_at: float
    """Its mtime: when it was written or last read (readers touch it, see :meth:`touch`)."""


@dataclass(frozen=True)
class EntryDir:
    """A tier's directory and names; picklable, so tasks carry it to the workers."""

    directory: str
    entry_prefix: str
    """Prefix of entry names; the 32 hex follow."""
    tmp_prefix: str
    usage_name: str
    limit_bytes: int
    """The most bytes the tier's entries (and writes in flight) may take."""

    def _path(self, name: str) -> str:
        return os.path.join(self.directory, name)

    def entry_path(self, key: str) -> str:
        return self._path(self.entry_prefix + key)

    # -- any process ----------------------------------------------------------------------

    def read(self, key: str) -> bytearray | None:
        """The entry ``key``'s bytes, or None when there is none (or it cannot be read)."""
        path = self.entry_path(key)
        try:
            fd = os.open(path, _READ)
        except FileNotFoundError:
            return None
        except OSError as e:  # ELOOP: a symlink under an entry's name
            _refuse(self.directory, self.entry_prefix + key, e.strerror or str(e))
            return None
        try:
            st = os.fstat(fd)
            why = foreign(st)
            if why is not None:
                _refuse(self.directory, self.entry_prefix + key, why)
                return None
            data = bytearray(st.st_size)
            view = memoryview(data)
            while view:
                got = os.readv(fd, [view])
                if not got:
                    return None  # it shrank: not an entry this tier wrote
                view = view[got:]
            return data
        except OSError:
            return None
        finally:
            os.close(fd)

    def has(self, key: str) -> bool:
        """Whether entry ``key`` is there (and would not be refused as foreign); one
        ``lstat``, no read."""
        try:
            st = os.stat(self.entry_path(key), follow_symlinks=False)
        except OSError:
            return False
        return foreign(st) is None

    def touch(self, key: str) -> None:
        """Mark ``key`` as just used (its mtime), for the owner's least-recent order."""
        with contextlib.suppress(OSError, NotImplementedError):
            os.utime(self.entry_path(key), follow_symlinks=False)

    def add(self, key: str, parts: tuple[bytes | bytearray | memoryview, ...]) -> bool:
        """Write entry ``key`` from ``parts`` (concatenated) if the tier has room for it.

        Returns:
            False when the tier is full or the write failed (no space, a read-only disk);
            nothing is left behind then but a reservation the owner's next count corrects.
        """
        size = sum(len(p) for p in parts)
        if not self._reserve(size):
            return False
        tmp = self._path(f"{self.tmp_prefix}{secrets.token_hex(16)}")
        try:
            fd = os.open(tmp, _CREATE, 0o600)
        except OSError:
            self._reserve(-size)
            return False
        try:
            try:
                for part in parts:
                    view = memoryview(part).cast("B")
                    while view:
                        view = view[os.write(fd, view) :]
            finally:
                os.close(fd)
            os.rename(tmp, self.entry_path(key))
        except OSError:  # no space, a read-only or failing disk: a cache never fails a batch
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            self._reserve(-size)
            return False
        return True

    def _reserve(self, nbytes: int) -> bool:
        """Add ``nbytes`` to the usage unless that passes the limit (negative: give back)."""
        try:
            fd = os.open(self._path(self.usage_name), os.O_RDWR | os.O_CLOEXEC | os.O_NOFOLLOW)
        except OSError:
            return False  # the owner is gone (shutting down): add nothing
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            (used,) = _USAGE.unpack(os.pread(fd, _USAGE.size, 0))
            if nbytes > 0 and used + nbytes > self.limit_bytes:
                return False
            os.pwrite(fd, _USAGE.pack(max(0, used + nbytes)), 0)
            return True
        except (OSError, struct.error):
            return False
        finally:
            os.close(fd)  # closing drops the flock

    def used_bytes(self) -> int:
        """The usage file's count: entries, writes in flight, and reservations of dead writers
        until the next :meth:`recount`."""
        try:
            fd = os.open(self._path(self.usage_name), os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW)
        except OSError:
            return 0
        try:
            return int(_USAGE.unpack(os.pread(fd, _USAGE.size, 0))[0])
        finally:
            os.close(fd)

    # -- the owner (the server's main process) --------------------------------------------

    def create(self) -> None:
        """Make the directory (disk tier) and the usage file, then count what is there."""
        Path(self.directory).mkdir(parents=True, exist_ok=True)
        path = self._path(self.usage_name)
        with contextlib.suppress(FileExistsError):
            fd = os.open(path, _CREATE, 0o600)
            try:
                os.write(fd, _USAGE.pack(0))
            finally:
                os.close(fd)
        self.recount()

    def entries(self) -> Iterator[EntryStat]:
        """Every entry file now (the directory may change while this runs)."""
        width = len(self.entry_prefix)
        with os.scandir(self.directory) as found:
            for item in found:
                if not item.name.startswith(self.entry_prefix) or len(item.name) != width + 32:
                    continue
                try:
                    st = item.stat(follow_symlinks=False)
                except OSError:
                    continue
                if foreign(st) is None:
                    yield EntryStat(item.name[width:], st.st_size, st.st_mtime)

    def recount(self) -> int:
        """Remove dead writers' temporary files and set the usage to what the directory
        holds; NOTE [ Entry files ].

        Returns:
            The bytes the tier holds.
        """
        now = time.time()
        held = 0
        fd = os.open(self._path(self.usage_name), os.O_RDWR | os.O_CLOEXEC | os.O_NOFOLLOW)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)  # no reservation changes while we count
            with os.scandir(self.directory) as found:
                for item in found:
                    name = item.name
                    if name == self.usage_name or not name.startswith(
                        (self.entry_prefix, self.tmp_prefix)
                    ):
                        continue
                    try:
                        st = item.stat(follow_symlinks=False)
                        why = foreign(st)
                        if why is not None:  # not ours: neither counted nor removed
                            _refuse(self.directory, name, why)
                            continue
                        if name.startswith(self.tmp_prefix) and now - st.st_mtime > _STALE_TMP_S:
                            os.unlink(item.path)
                            continue
                    except OSError:
                        continue
                    held += st.st_size
            os.pwrite(fd, _USAGE.pack(held), 0)
        finally:
            os.close(fd)
        return held

    def remove(self, key: str, size: int) -> bool:
        """Remove entry ``key`` (of ``size`` bytes) and give its bytes back; False if gone."""
        try:
            os.unlink(self.entry_path(key))
        except FileNotFoundError:
            return False
        self._reserve(-size)
        return True

    def clear(self) -> None:
        """Remove every entry, temporary file and the usage file (shm tier at shutdown)."""
        with os.scandir(self.directory) as found:
            names = [
                item.path
                for item in found
                if item.name.startswith((self.entry_prefix, self.tmp_prefix))
                or item.name == self.usage_name
            ]
        for path in names:
            with contextlib.suppress(OSError):  # gone, or another user's (sticky /dev/shm)
                os.unlink(path)


def shm_entry_dir(shm_dir: Path, instance: str, limit_bytes: int) -> EntryDir:
    """The shared-memory tier of server ``instance`` (swept with its segments when it dies)."""
    base = f"{PREFIX}-{instance}-"
    return EntryDir(
        directory=str(shm_dir),
        entry_prefix=f"{base}dc-",
        tmp_prefix=f"{base}dctmp-",
        usage_name=f"{base}dcuse-{secrets.token_hex(16)}",
        limit_bytes=limit_bytes,
    )


def disk_entry_dir(directory: Path, limit_bytes: int) -> EntryDir:
    """The disk tier in ``directory``: kept across restarts."""
    return EntryDir(
        directory=str(directory),
        entry_prefix="dc-",
        tmp_prefix="dctmp-",
        usage_name="dc-usage",
        limit_bytes=limit_bytes,
    )
