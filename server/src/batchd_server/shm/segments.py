"""Shared-memory segments: created, reserved, budgeted and swept in one place.

A segment is a file in ``/dev/shm`` (which is what ``shm_open`` makes on Linux). We create the
files ourselves instead of using ``multiprocessing.shared_memory``, whose resource tracker
unlinks and warns behind the owner's back. Each segment is reserved with ``posix_fallocate``
when it is created, so a ``/dev/shm`` too small for it fails then, with a message that says
what to change, and never later with a ``SIGBUS`` on first touch of a page.

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

NOTE [ Closing mappings with live views ]
``mmap.close()`` raises ``BufferError`` while buffer exports of the mapping exist: memoryviews,
``np.frombuffer`` and ``torch.frombuffer`` results and their views. ``ShmRegistry.release``
and ``Attachment.close`` therefore close the mapping when they can and otherwise drop their
reference to it: every view holds the mapping, and the last one to die unmaps it. Views stay
valid until then. Make views with ``ndarray()`` (or ``np.frombuffer``), never with
``np.ndarray(buffer=buf)``: that one takes no export, so a close unmaps under it and the next
access is a segmentation fault. A released segment's file is unlinked at once
and its bytes leave the budget; the kernel frees its pages when the last mapping anywhere
goes. After either call, ``buf`` raises ``FailedPrecondition``.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import logging
import math
import mmap
import os
import re
import secrets
import stat
import threading
import weakref
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Final

import numpy as np
import numpy.typing as npt

from batchd._wire.lifetime import Closeable
from batchd_server.errors import (
    FailedPrecondition,
    InvalidArgument,
    NotFound,
    ResourceExhausted,
    Unavailable,
)
from batchd_server.shm.space import ShmSpace, format_bytes, remedy, shm_space

__all__ = [
    "KINDS",
    "PREFIX",
    "SHM_DIR",
    "Attachment",
    "Segment",
    "ShmRegistry",
    "attach",
    "format_bytes",
]

logger = logging.getLogger(__name__)

SHM_DIR: Final = Path("/dev/shm")
PREFIX: Final = "batchd"
KINDS: Final = ("catalog", "ring")
"""What a segment holds: a session's ring of batch slots, or catalog arrays for the workers."""

_SEGMENT_RE: Final = re.compile(rf"{PREFIX}-([0-9a-f]{{12}})-([a-z]+)-[0-9a-f]{{32}}")
_LOCK_RE: Final = re.compile(rf"{PREFIX}-([0-9a-f]{{12}})\.lock")
_LOCK_ATTEMPTS: Final = 8


class _Mapping:
    """A named mapping of a segment; the base of ``Segment`` and ``Attachment``."""

    def __init__(self, name: str, buf: mmap.mmap) -> None:
        self.name = name
        self.nbytes = len(buf)
        self._buf: mmap.mmap | None = buf

    @property
    def buf(self) -> mmap.mmap:
        """The whole segment. Raises ``FailedPrecondition`` once released or closed."""
        if self._buf is None:
            raise FailedPrecondition(
                f"shared-memory segment {self.name} is no longer mapped here (it was released "
                "or closed); keep it open while you use it"
            )
        return self._buf

    def ndarray(
        self, dtype: npt.DTypeLike, shape: int | Sequence[int], offset: int = 0
    ) -> npt.NDArray[Any]:
        """A numpy view of ``shape`` and ``dtype`` at byte ``offset``; read-only if the mapping is.

        Raises:
            InvalidArgument: The array would not fit inside the segment.
        """
        dt = np.dtype(dtype)
        dims = (int(shape),) if isinstance(shape, int | np.integer) else tuple(map(int, shape))
        end = offset + dt.itemsize * math.prod(dims)
        if offset < 0 or min(dims, default=0) < 0 or end > self.nbytes:
            raise InvalidArgument(
                f"a {dt} array of shape {dims} at byte offset {offset} needs bytes "
                f"[{offset}, {end}); segment {self.name} has {self.nbytes}"
            )
        # frombuffer, unlike np.ndarray(buffer=...), holds a buffer export for the view's life,
        # which is what keeps close() from unmapping under it: NOTE [ Closing mappings ...].
        return np.frombuffer(self.buf, dt, math.prod(dims), offset).reshape(dims)

    def _unmap(self) -> None:
        # See NOTE [ Closing mappings with live views ].
        buf, self._buf = self._buf, None
        if buf is not None:
            with contextlib.suppress(BufferError):  # views alive: the last one unmaps
                buf.close()

    def __repr__(self) -> str:
        state = "mapped" if self._buf is not None else "unmapped"
        return f"<{type(self).__name__} {self.name} {format_bytes(self.nbytes)} {state}>"


class Segment(_Mapping):
    """A segment this process created with ``ShmRegistry.create``: reserved, mapped read-write."""

    def __init__(self, *, name: str, path: Path, kind: str, buf: mmap.mmap) -> None:
        super().__init__(name, buf)
        self.path = path
        self.kind = kind


class Attachment(_Mapping, Closeable):
    """A mapping of a segment that another process created (see ``attach``)."""

    def close(self) -> None:
        """Unmap; idempotent. Safe while views exist (NOTE [ Closing mappings with live views ])."""
        self._unmap()


def attach(name: str, *, writable: bool, shm_dir: Path = SHM_DIR) -> Attachment:
    """Map the segment ``name`` that a server created (workers and same-host clients use this).

    Args:
        name: ``Segment.name``, as the server handed it out.
        writable: Map read-write; otherwise the mapping is read-only and writes through it (or
            through numpy views of it) raise.
        shm_dir: Where segments live.

    Raises:
        InvalidArgument: ``name`` is not a batchd segment name.
        NotFound: No such segment (its session closed, or its server exited).
        FailedPrecondition: This process may not open it (segments are mode 0600).
    """
    if not isinstance(name, str) or not _SEGMENT_RE.fullmatch(name):
        raise InvalidArgument(
            f"{name!r} is not a batchd shared-memory segment name; expected "
            f"{PREFIX}-<12 hex>-<kind>-<32 hex>, as the server returned it"
        )
    path = shm_dir / name
    mode = "read-write" if writable else "read-only"
    flags = (os.O_RDWR if writable else os.O_RDONLY) | os.O_CLOEXEC | os.O_NOFOLLOW
    try:
        fd = os.open(path, flags)
    except FileNotFoundError as e:
        raise NotFound(
            f"shared-memory segment {path} does not exist: its session was closed or the server "
            "that created it has exited"
        ) from e
    except PermissionError as e:
        raise FailedPrecondition(
            f"no permission to open {path} {mode}: batchd segments are mode 0600, so attach as "
            "the user the server runs as"
        ) from e
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_size == 0:
            raise FailedPrecondition(f"{path} is not a batchd segment (empty or not a file)")
        access = mmap.ACCESS_WRITE if writable else mmap.ACCESS_READ
        return Attachment(name, mmap.mmap(fd, st.st_size, access=access))
    finally:
        os.close(fd)  # the mapping does not need it


class ShmRegistry(Closeable):
    """The segments one server instance owns: created, budgeted, released and swept here.

    Only this class creates or unlinks segments. It is thread-safe. Creating one takes the
    instance lock (NOTE [ Instance lock ]) and sweeps what dead instances left in ``shm_dir``.
    ``close()`` releases everything; so does interpreter exit or garbage collection, as a
    fallback. A child process forked from the owner never unlinks anything.
    """

    def __init__(self, *, budget_bytes: int, shm_dir: Path = SHM_DIR) -> None:
        """Take an instance lock in ``shm_dir`` and sweep segments of dead instances.

        Args:
            budget_bytes: Most bytes this registry may hold in segments at once.
            shm_dir: Where segments live: a tmpfs, ``/dev/shm`` unless testing.

        Raises:
            InvalidArgument: ``budget_bytes`` is negative.
            FailedPrecondition: ``shm_dir`` is missing or not writable.
        """
        if budget_bytes < 0:
            raise InvalidArgument(f"shm budget_bytes={budget_bytes} must be >= 0")
        if not shm_dir.is_dir():
            raise FailedPrecondition(
                f"{shm_dir} is not a directory; batchd keeps its shared memory there, so run it "
                "on Linux with a tmpfs mounted at /dev/shm"
            )
        self.budget_bytes = budget_bytes
        self.shm_dir = shm_dir
        self.instance, lock_fd = _take_instance_lock(shm_dir)
        self._owner_pid = os.getpid()
        self._mutex = threading.Lock()
        self._segments: dict[str, Segment] = {}
        self._creating_bytes = 0
        self._closed = False
        # Files to remove if close() is never called; shared with the finalizer, which must
        # not hold self.
        self._paths: dict[str, Path] = {}
        self._finalizer = weakref.finalize(
            self,
            _remove_files,
            self._owner_pid,
            lock_fd,
            shm_dir / _lock_name(self.instance),
            self._paths,
        )
        self.sweep()

    def reserved_bytes(self) -> int:
        """Bytes of the budget in use: live segments plus those being created."""
        with self._mutex:
            return self._reserved_locked()

    def _reserved_locked(self) -> int:
        return self._creating_bytes + sum(s.nbytes for s in self._segments.values())

    def free_bytes(self) -> int:
        """Bytes an unprivileged process may still allocate in ``shm_dir``."""
        return shm_space(self.shm_dir).free_bytes

    def space(self) -> ShmSpace:
        """``shm_dir``'s size and free bytes, read now."""
        space = shm_space(self.shm_dir)
        return ShmSpace(space.path, space.size_bytes, self.free_bytes())

    def effective_budget_bytes(self) -> int:
        """What this registry may hold now: the configured budget, or less when ``shm_dir``
        cannot hold that much beside what others keep there (read fresh on every call)."""
        with self._mutex:
            reserved = self._reserved_locked()
        return min(self.budget_bytes, reserved + self.free_bytes())

    def segments(self) -> list[Segment]:
        """The live segments, oldest first."""
        with self._mutex:
            return list(self._segments.values())

    def create(self, kind: str, nbytes: int, *, purpose: str) -> Segment:
        """Create, reserve and map a zero-filled segment of ``nbytes``.

        Args:
            kind: One of ``KINDS``; part of the name.
            nbytes: Size in bytes, >= 1.
            purpose: What it is for, for error messages (``"ring of 4 slots of 96.0 MiB"``).

        Raises:
            InvalidArgument: Unknown ``kind`` or ``nbytes < 1``.
            ResourceExhausted: The budget or ``shm_dir`` has no room; nothing is left behind.
            FailedPrecondition: The registry is closed.
        """
        if kind not in KINDS:
            raise InvalidArgument(f"segment kind {kind!r} must be one of {', '.join(KINDS)}")
        if nbytes < 1:
            raise InvalidArgument(f"segment nbytes={nbytes} must be >= 1")
        space = self.space()
        with self._mutex:
            self._require_open()
            reserved = self._reserved_locked()
            # Two ceilings: the operator's budget and what the filesystem can still take (less
            # what is being created here and not yet allocated). The message names the one
            # that binds: "raise --shm-budget" is no help when /dev/shm is the limit.
            fs_room = space.free_bytes - self._creating_bytes
            budget_room = self.budget_bytes - reserved
            if nbytes > min(fs_room, budget_room):
                if fs_room <= budget_room:
                    raise ResourceExhausted(self._no_space_message(space, nbytes, purpose))
                raise ResourceExhausted(self._budget_message(reserved, nbytes, purpose))
            self._creating_bytes += nbytes
        try:
            segment = self._allocate(kind, nbytes, purpose)
        except BaseException:
            with self._mutex:
                self._creating_bytes -= nbytes
            raise
        with self._mutex:
            self._creating_bytes -= nbytes
            if not self._closed:
                self._segments[segment.name] = segment
                return segment
        self._discard(segment)
        raise FailedPrecondition(f"shm registry {self.instance} was closed during the creation")

    def _allocate(self, kind: str, nbytes: int, purpose: str) -> Segment:
        name = f"{PREFIX}-{self.instance}-{kind}-{secrets.token_hex(16)}"
        path = self.shm_dir / name
        flags = os.O_CREAT | os.O_EXCL | os.O_RDWR | os.O_CLOEXEC | os.O_NOFOLLOW
        fd = os.open(path, flags, 0o600)
        with self._mutex:
            self._paths[name] = path
        try:
            os.fchmod(fd, 0o600)  # exactly 0600, whatever the umask
            try:
                os.posix_fallocate(fd, 0, nbytes)
            except OSError as e:
                if e.errno not in (errno.ENOSPC, errno.EDQUOT):
                    raise
                self._unlink(name, path)  # first, so that free_bytes() counts its pages again
                raise ResourceExhausted(
                    self._no_space_message(shm_space(self.shm_dir), nbytes, purpose)
                ) from e
            buf = mmap.mmap(fd, nbytes, flags=mmap.MAP_SHARED)
        except BaseException:
            self._unlink(name, path)
            raise
        finally:
            os.close(fd)
        return Segment(name=name, path=path, kind=kind, buf=buf)

    def release(self, segment: Segment) -> None:
        """Unmap and unlink ``segment`` and return its bytes to the budget; idempotent.

        Views of it stay valid until they die (NOTE [ Closing mappings with live views ]).
        """
        with self._mutex:
            self._segments.pop(segment.name, None)
        self._discard(segment)

    def _discard(self, segment: Segment) -> None:
        segment._unmap()
        self._unlink(segment.name, segment.path)

    def _unlink(self, name: str, path: Path) -> None:
        with self._mutex:
            self._paths.pop(name, None)
        if os.getpid() == self._owner_pid:
            path.unlink(missing_ok=True)

    def sweep(self) -> list[str]:
        """Remove what dead instances left in ``shm_dir``; see NOTE [ Instance lock ].

        Logs one line per dead instance. Segments of live instances, in this process or any
        other, are never touched.

        Returns:
            Names of the segments removed (lock files not included).
        """
        by_instance: dict[str, list[str]] = {}
        for name in os.listdir(self.shm_dir):
            match = _SEGMENT_RE.fullmatch(name) or _LOCK_RE.fullmatch(name)
            if match is not None and match[1] != self.instance:
                by_instance.setdefault(match[1], []).append(name)
        removed: list[str] = []
        for instance, names in sorted(by_instance.items()):
            removed += self._sweep_instance(instance, sorted(names))
        return removed

    def _sweep_instance(self, instance: str, names: list[str]) -> list[str]:
        lock_path = self.shm_dir / _lock_name(instance)
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
                if _SEGMENT_RE.fullmatch(name) is None:
                    continue
                try:
                    size = os.stat(self.shm_dir / name, follow_symlinks=False).st_size
                    os.unlink(self.shm_dir / name)
                except FileNotFoundError:
                    continue  # another sweeper was first
                except OSError as e:
                    logger.warning("cannot remove stale segment %s: %s", self.shm_dir / name, e)
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
                self.shm_dir,
                instance,
            )
            return removed
        finally:
            if lock_fd is not None:
                os.close(lock_fd)

    def close(self) -> None:
        """Release every segment, then remove and unlock the instance lock; idempotent."""
        with self._mutex:
            self._closed = True
            segments = list(self._segments.values())
            self._segments.clear()
        for segment in segments:
            self._discard(segment)
        self._finalizer()

    def _require_open(self) -> None:
        if self._closed:
            raise FailedPrecondition(f"shm registry {self.instance} is closed")

    def __repr__(self) -> str:
        return (
            f"<ShmRegistry {self.instance} in {self.shm_dir}: {len(self._segments)} segments, "
            f"{format_bytes(self.reserved_bytes())} of {format_bytes(self.budget_bytes)}>"
        )

    def _budget_message(self, reserved: int, nbytes: int, purpose: str) -> str:
        return (
            f"the server's shared-memory budget of {format_bytes(self.budget_bytes)} "
            f"({self.budget_bytes} bytes) is used up: {format_bytes(reserved)} is reserved by "
            f"{len(self._segments)} segment(s) and {purpose} needs {format_bytes(nbytes)} more. "
            "Raise the budget with --shm-budget or BATCHD_SHM_BUDGET, or ask for less: a "
            "smaller prefetch or batch_size"
        )

    def _no_space_message(self, space: ShmSpace, nbytes: int, purpose: str) -> str:
        return (
            f"{self.shm_dir} has {format_bytes(space.free_bytes)} free; this session needs "
            f"{format_bytes(nbytes)} ({purpose}). {self.shm_dir} is "
            f"{format_bytes(space.size_bytes)} in all, so the filesystem is the limit, not "
            f"--shm-budget: {remedy(space, nbytes)}; or lower batch_size / prefetch."
        )


def _lock_name(instance: str) -> str:
    return f"{PREFIX}-{instance}.lock"


def _take_instance_lock(shm_dir: Path) -> tuple[str, int]:
    """A fresh instance id and the fd holding its lock; see NOTE [ Instance lock ]."""
    for _ in range(_LOCK_ATTEMPTS):
        instance = secrets.token_hex(6)
        path = shm_dir / _lock_name(instance)
        flags = os.O_CREAT | os.O_EXCL | os.O_RDWR | os.O_CLOEXEC | os.O_NOFOLLOW
        try:
            fd = os.open(path, flags, 0o600)
        except FileExistsError:
            continue
        except PermissionError as e:
            raise FailedPrecondition(
                f"cannot create files in {shm_dir} ({e.strerror}); the server needs a writable "
                "/dev/shm: do not mount it read-only, and run with a tmpfs there"
            ) from e
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            if os.path.samestat(os.fstat(fd), os.stat(path, follow_symlinks=False)):
                return instance, fd
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


def _remove_files(owner_pid: int, lock_fd: int, lock_path: Path, paths: dict[str, Path]) -> None:
    """Finalizer of a ``ShmRegistry``: unlink what is left, then drop the lock."""
    if os.getpid() == owner_pid:
        for path in list(paths.values()):
            path.unlink(missing_ok=True)
        lock_path.unlink(missing_ok=True)  # before unlocking: see NOTE [ Instance lock ]
    paths.clear()
    os.close(lock_fd)
