"""The segments one server owns: created, reserved, budgeted and released in one place.

We create the files ourselves instead of using ``multiprocessing.shared_memory``, whose
resource tracker unlinks and warns behind the owner's back. Each segment is reserved with
``posix_fallocate`` when it is created, so a ``/dev/shm`` too small for it fails then, with a
message that says what to change, and never later with a ``SIGBUS`` on first touch of a page.
A registry is one server instance: it holds the instance lock and sweeps what dead instances
left (``instance.py``, NOTE [ Instance lock ]).
"""

from __future__ import annotations

import errno
import mmap
import os
import secrets
import threading
import weakref
from collections.abc import Callable
from pathlib import Path

from batchd._wire.lifetime import Closeable
from batchd_server.errors import FailedPrecondition, InvalidArgument, ResourceExhausted
from batchd_server.shm.instance import InstanceLock, sweep_dead_instances
from batchd_server.shm.segments import KINDS, SHM_DIR, Segment, segment_name
from batchd_server.shm.space import ShmSpace, format_bytes, remedy, shm_space

__all__ = ["ShmRegistry"]


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
        lock = InstanceLock.take(shm_dir)
        self.instance = lock.instance
        self._owner_pid = os.getpid()
        self._mutex = threading.Lock()
        self._segments: dict[str, Segment] = {}
        self._creating_bytes = 0
        self._aside_bytes = 0
        self._aside_used: Callable[[], int] = lambda: 0
        self._aside_purpose = ""
        """Bytes set aside for the decode cache's shared-memory tier, what it holds now, and
        what it is for (named in the budget's messages)."""
        self._closed = False
        # Files to remove if close() is never called; shared with the finalizer, which must
        # not hold self.
        self._paths: dict[str, Path] = {}
        self._finalizer = weakref.finalize(self, _remove_files, self._owner_pid, lock, self._paths)
        self.sweep()

    def reserved_bytes(self) -> int:
        """Bytes of the budget in use: live segments plus those being created."""
        with self._mutex:
            return self._reserved_locked()

    def _reserved_locked(self) -> int:
        segments = sum(s.nbytes for s in self._segments.values())
        return self._creating_bytes + self._aside_bytes + segments

    def _aside_unused(self) -> int:
        """Set-aside bytes the cache does not hold yet: free in ``shm_dir``, but not for us."""
        return max(0, self._aside_bytes - self._aside_used()) if self._aside_bytes else 0

    def set_aside(self, nbytes: int, *, purpose: str, used: Callable[[], int]) -> None:
        """Take ``nbytes`` of the budget for files that fill up over time (the decode cache's
        shared-memory tier, ``shm/entries.py``), whose bytes held now ``used()`` says.

        Raises:
            ResourceExhausted: The budget or ``shm_dir`` cannot hold ``nbytes`` more.
        """
        space = self.space()
        with self._mutex:
            self._require_open()
            reserved = self._reserved_locked()
            if nbytes > self.budget_bytes - reserved:
                raise ResourceExhausted(
                    f"{purpose} needs {format_bytes(nbytes)} of the server's shared-memory "
                    f"budget of {format_bytes(self.budget_bytes)}, of which "
                    f"{format_bytes(reserved)} is reserved already; raise --shm-budget "
                    "(BATCHD_SHM_BUDGET) by as much, leaving room for the sessions' rings, or "
                    "ask for less"
                )
            if nbytes > space.free_bytes - self._creating_bytes:
                raise ResourceExhausted(self._no_space_message(space, nbytes, purpose))
            self._aside_bytes += nbytes
            self._aside_used = used
            self._aside_purpose = purpose

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
        return min(self.budget_bytes, reserved + self.free_bytes() - self._aside_unused())

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
            fs_room = space.free_bytes - self._creating_bytes - self._aside_unused()
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
        name = segment_name(self.instance, kind, secrets.token_hex(16))
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
        segment.unmap()
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
        return sweep_dead_instances(self.shm_dir, own_instance=self.instance)

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
        segments = format_bytes(reserved - self._aside_bytes)
        held = f"{segments} is reserved by {len(self._segments)} segment(s)"
        less = ""
        if self._aside_bytes:  # the decode cache: say so, or its bytes look like no one's
            held += f" and {format_bytes(self._aside_bytes)} is set aside for {self._aside_purpose}"
            less = ", give the decode cache less"
        return (
            f"the server's shared-memory budget of {format_bytes(self.budget_bytes)} "
            f"({self.budget_bytes} bytes) is used up: {held}, and {purpose} needs "
            f"{format_bytes(nbytes)} more. Raise the budget with --shm-budget or "
            f"BATCHD_SHM_BUDGET{less}, or ask for less: a smaller prefetch or batch_size"
        )

    def _no_space_message(self, space: ShmSpace, nbytes: int, purpose: str) -> str:
        free = f"{format_bytes(space.free_bytes)} free"
        kept = self._aside_unused()
        if kept:  # free, but not for this session: say why, or the numbers contradict
            free += f", of which {format_bytes(kept)} is kept for {self._aside_purpose} to fill"
        return (
            f"{self.shm_dir} has {free}; this session needs "
            f"{format_bytes(nbytes)} ({purpose}). {self.shm_dir} is "
            f"{format_bytes(space.size_bytes)} in all, so the filesystem is the limit, not "
            f"--shm-budget: {remedy(space, nbytes)}; or lower batch_size / prefetch."
        )


def _remove_files(owner_pid: int, lock: InstanceLock, paths: dict[str, Path]) -> None:
    """Finalizer of a ``ShmRegistry``: unlink what is left, then drop the lock."""
    owner = os.getpid() == owner_pid
    if owner:
        for path in list(paths.values()):
            path.unlink(missing_ok=True)
    paths.clear()
    lock.release(unlink=owner)  # the lock file goes before it is unlocked: NOTE [ Instance lock ]
