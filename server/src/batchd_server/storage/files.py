"""Read sample bytes from a local dataset root, never from outside it.

:class:`SampleFiles` is the :class:`~batchd_server.storage.reader.SampleReader` of a root that
is a directory of this machine (``storage/open.py`` picks it by the root's scheme; its
object-store sibling is ``storage/objects.py``). A catalog path is untrusted input: an
ingest may have recorded ``../../etc/shadow``, an absolute path, or a path through a
symlink that leads elsewhere. It refuses all three:

1. Before touching the filesystem: an absolute path or a ``..`` component is refused.
2. The path is resolved (``os.path.realpath``) and must lie under the resolved root, so a
   symlink inside the root that points inside the root is fine, and one that leads out is not.
3. The resolved path is opened with ``O_NOFOLLOW`` (the last component cannot have become a
   symlink since step 2) and, where ``/proc`` exists, the opened descriptor's own path is
   checked once more, which also catches a directory swapped for a symlink between steps 2
   and 3. Only regular files are read; ``O_NONBLOCK`` keeps a FIFO from hanging the open.

Every failure is a :class:`~batchd_server.pipelines.base.BadSample` whose ``kind`` says what
went wrong, so one bad sample never stops a worker. I/O errors that are usually passing
(``EIO``, ``ESTALE``, ``EMFILE``...) are retried with backoff first, and one that persists is
kind ``transient``, not blamed on the sample (see :mod:`~batchd_server.pipelines.transient`).

Shard files (read through byte ranges) stay open in a small least-recently-used cache, so a
record costs a ``pread``, not an open and three checks. A cached descriptor was confined when
it was opened; :meth:`SampleFiles.begin_batch` marks the start of a batch, and the first use
of a descriptor in a batch stats its resolved path once: if that no longer names the same
file as it was (device, inode, size, modification and change times), the descriptor is
closed and the path opened and confined again. So a shard replaced, appended to or rewritten
is seen from the next batch on, and a directory swapped for a symlink that leads out of the
root is refused as it would be on a first open. :meth:`SampleFiles.read_ranges` reads many
ranges of a batch at once, in as few reads as their layout allows (see
:mod:`~batchd_server.storage.ranges`).

Reads land in one reused buffer: allocating a fresh buffer per sample costs about 15% of the
decode rate here (glibc hands large blocks back to the kernel and faults them in again).

What a read may ask for is bounded before anything is allocated, so that a sample the worker
cannot hold is a bad sample like any other, not a ``MemoryError`` that fails the batch (and,
under ``on_error="skip"``, the epoch): a sample of more than ``max_sample_bytes``
(:data:`MAX_SAMPLE_BYTES` unless the operator sets ``--max-sample-bytes``; a sparse file of a
terabyte takes no disk) is kind ``too_large``, and a byte range that ends past 2**63 - 1 (a
row ingested with ``--no-verify``; its int64 end would wrap to a negative one that passes
every later check) is kind ``bad_range``.
"""

from __future__ import annotations

import errno
import mmap
import os
import stat
import weakref
from collections import OrderedDict
from collections.abc import Callable, Iterable
from typing import Final, TypeVar

import numpy as np
import numpy.typing as npt

from batchd._wire.lifetime import Closeable
from batchd_server.errors import FailedPrecondition
from batchd_server.limits import MAX_CACHED_BUFFER_BYTES, MAX_SAMPLE_BYTES
from batchd_server.pipelines.base import BadSample
from batchd_server.pipelines.transient import (
    InjectedFaults,
    TransientError,
    is_transient,
    retrying,
)
from batchd_server.shm.space import format_bytes
from batchd_server.storage.ranges import Ranges
from batchd_server.storage.reader import LocalHooks, check_ranges, check_read, too_large

__all__ = ["MAX_CACHED_BUFFER_BYTES", "MAX_READS_PER_FILE", "MAX_SAMPLE_BYTES", "SampleFiles"]

_WHY_TOO_LARGE: Final = ": the file may be sparse, truncated to a huge size or not a sample at all"

_OPEN_FLAGS: Final = os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW | os.O_NONBLOCK
_MAX_OPEN_FDS: Final = 16
_MAX_KNOWN_DIRS: Final = 4096
MAX_READS_PER_FILE: Final = 4
"""A batch whose ranges of one file need more reads than this is gathered from a map of the
file instead (see :meth:`SampleFiles.read_ranges`)."""
_MAX_MAPS: Final = 8
_PROC_FD: Final = "/proc/self/fd"
_T = TypeVar("_T")


Identity = tuple[int, int, int, int, int]
"""(st_dev, st_ino, st_size, st_mtime_ns, st_ctime_ns): a file, as it is now."""


def _identity(st: os.stat_result) -> Identity:
    return st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns


class _Open:
    """A cached descriptor of a confined shard file."""

    __slots__ = ("checked", "fd", "identity", "mapped", "real", "size")

    def __init__(self, fd: int, st: os.stat_result, real: str, batch: int) -> None:
        self.fd = fd
        self.size = st.st_size
        self.identity = _identity(st)
        self.real = real
        """The resolved path it was opened by, stat'ed to see whether it still names it."""
        self.checked = batch
        """The batch (see ``SampleFiles.begin_batch``) in which it was last checked."""
        self.mapped: npt.NDArray[np.uint8] | None = None
        """The whole file mapped, once a batch scattered over it asked for it."""


def _close_all(fds: dict[str, _Open]) -> None:
    for entry in fds.values():
        os.close(entry.fd)
    fds.clear()


class SampleFiles(LocalHooks, Closeable):
    """Confined, buffer-reusing reads of sample files under one dataset root.

    Not thread-safe: a worker process holds one per session. Descriptors of shard files
    (byte-range reads) are cached and re-checked once per batch (see the module docs); maps
    (:meth:`map_whole`) are cached as they were first made.

    Args:
        root: The dataset's root directory; symlinks in it are resolved once.
        max_sample_bytes: The most bytes one sample may have (see the module docs).

    Raises:
        FailedPrecondition: ``root`` is not an existing directory.
    """

    def __init__(self, root: str, *, max_sample_bytes: int = MAX_SAMPLE_BYTES) -> None:
        if max_sample_bytes < 1:
            raise ValueError(f"max_sample_bytes={max_sample_bytes} must be >= 1")
        self.max_sample_bytes = max_sample_bytes
        real = os.path.realpath(root)
        if not os.path.isdir(real):
            raise FailedPrecondition(
                f"dataset root {root!r} is not a directory on this server; mount the dataset "
                "there or re-ingest it with the root this server sees"
            )
        self.root = real
        self._prefix = real if real.endswith(os.sep) else real + os.sep
        self._check_proc = os.path.isdir(_PROC_FD)
        self._buffer = bytearray(0)
        # path -> cached descriptor; insertion order is recency.
        self._fds: OrderedDict[str, _Open] = OrderedDict()
        self._batch = 0
        self._maps: OrderedDict[str, npt.NDArray[np.uint8]] = OrderedDict()
        # Catalog directory -> its resolved path, for the fast open (see _open).
        self._dirs: dict[str, str] = {}
        self._finalizer = weakref.finalize(self, _close_all, self._fds)
        self._given_up: dict[str, str] = {}
        """Files whose transient errors outlasted the retries in this batch."""
        self._faults = InjectedFaults.from_env()

    def _retrying(self, attempt: Callable[[], _T]) -> _T:
        return retrying(attempt, forget=self._forget, given_up=self._given_up)

    def _forget(self, paths: Iterable[str]) -> None:
        """Close the cached descriptors and drop the maps of ``paths`` (before a retry)."""
        for path in paths:
            entry = self._fds.pop(path, None)
            if entry is not None:
                os.close(entry.fd)
            self._maps.pop(path, None)

    def read(self, path: str, offset: int = -1, length: int = -1) -> memoryview:
        """The bytes of one sample.

        Args:
            path: Relative to the root, as the catalog records it.
            offset: First byte; -1 (with ``length`` -1) reads the whole file.
            length: Bytes to read; -1 means up to the end of the file.

        Returns:
            A view of a buffer this object reuses: valid until the next call.

        Raises:
            BadSample: ``unsafe_path``, ``missing``, ``unreadable``, ``too_large``,
                ``bad_range`` or ``transient`` (see module docs).
        """
        check_read(path, offset, length)
        self._check_size(path, length)
        return self._retrying(lambda: self._read(path, offset, length))

    def _check_size(self, path: str, count: int) -> None:
        if count > self.max_sample_bytes:
            raise too_large(path, count, self.max_sample_bytes, _WHY_TOO_LARGE)

    def _read(self, path: str, offset: int, length: int) -> memoryview:
        whole = offset == -1 and length == -1
        if whole:
            fd, st, _ = self._open(path)
            size = st.st_size
        else:
            fd, size = self._cached_fd(path)
        try:
            start = max(offset, 0)
            end = size if length == -1 else start + length
            if start > size or end > size:
                raise BadSample(
                    "unreadable",
                    f"{path}: byte range [{start}, {end}) is past the end of the file "
                    f"({size} bytes)",
                )
            self._check_size(path, end - start)
            view = self._view(end - start, path)
            _pread_into(fd, view, start, path, self._faults)
            return view
        finally:
            if whole:
                os.close(fd)

    def read_ranges(self, ranges: Ranges) -> tuple[npt.NDArray[np.uint8], npt.NDArray[np.int64]]:
        """The byte ranges of many samples, fetched in as few reads as their layout allows.

        The ranges of each file are sorted and coalesced into runs
        (:func:`~batchd_server.storage.ranges.plan_reads`), one ``pread`` per run, into one
        buffer. A batch of one file whose ranges are scattered (more than
        :data:`MAX_READS_PER_FILE` runs: shuffled small records) costs no read at all: the
        result is a read-only map of the whole file, cached with its descriptor, and the
        ranges are where they lie in it. A map's pages are the page cache's own, so this is
        the memory-speed path; its price is that a file truncated between the batch's
        re-check and the copy would fault (SIGBUS) the worker, whose batch the pool then
        redoes and which then sees the new size.

        Returns:
            ``(data, starts)``: sample ``i`` is ``data[starts[i]:starts[i] + lengths[i]]``.
            Valid until the next call (a reused buffer, or a map this object may drop).

        Raises:
            BadSample: A file cannot be opened, a range is not inside its file, ends past
                2**63 - 1 or is larger than a sample may be, or the batch's bytes cannot be
                allocated. Which sample is at fault is not said: read each with :meth:`read`
                to find out.
        """
        check_ranges(ranges, ranges.paths, self.max_sample_bytes, _WHY_TOO_LARGE)
        return self._retrying(lambda: self._read_ranges(ranges))

    def _read_ranges(self, ranges: Ranges) -> tuple[npt.NDArray[np.uint8], npt.NDArray[np.int64]]:
        paths = ranges.paths
        groups = ranges.by_file()
        plans = ranges.plans()
        entries = [self._cached(path) for path in paths]
        for path, entry, plan in zip(paths, entries, plans, strict=True):
            if plan.end > entry.size:
                raise BadSample(
                    "unreadable",
                    f"{path}: a byte range ends at {plan.end}, past {entry.size} bytes",
                )
        if len(paths) == 1 and len(plans[0].run_offsets) > MAX_READS_PER_FILE:
            return self._mapping(entries[0], paths[0]), ranges.offsets.astype(np.int64, copy=True)
        view = self._view(sum(p.total_bytes for p in plans), "a batch of byte ranges")
        starts = np.empty(len(ranges), np.int64)
        base = 0
        for path, entry, rows, plan in zip(paths, entries, groups, plans, strict=True):
            runs = zip(plan.run_offsets.tolist(), plan.run_lengths.tolist(), strict=True)
            at = base
            for offset, length in runs:
                _pread_into(entry.fd, view[at : at + length], offset, path, self._faults)
                at += length
            starts[rows] = plan.starts + base
            base = at
        return np.frombuffer(view, np.uint8), starts

    def begin_batch(self) -> None:
        """A new batch begins: each cached descriptor is re-checked on its next use, and
        files that failed transiently are tried again."""
        self._batch += 1
        self._given_up.clear()

    def size(self, path: str) -> int:
        """The size in bytes of the file ``path`` names (a Parquet footer is read from its
        end). Its descriptor is cached like a shard's, and re-checked once per batch.

        Raises:
            BadSample: As :meth:`read`.
        """
        return self._retrying(lambda: self._cached(path).size)

    def map_whole(self, path: str) -> npt.NDArray[np.uint8]:
        """A read-only memory map of a whole file, cached (least recently used first out).

        Raises:
            BadSample: As :meth:`read`.
        """
        return self._retrying(lambda: self._map_whole(path))

    def _map_whole(self, path: str) -> npt.NDArray[np.uint8]:
        cached = self._maps.get(path)
        if cached is not None:
            self._maps.move_to_end(path)
            return cached
        fd, st, _ = self._open(path)
        size = st.st_size
        try:
            if size == 0:
                array = np.zeros(0, np.uint8)
            else:
                try:
                    # mmap keeps its own duplicate of the descriptor.
                    array = np.frombuffer(mmap.mmap(fd, size, access=mmap.ACCESS_READ), np.uint8)
                except OSError as e:
                    raise _bad(path, e) from e
        finally:
            os.close(fd)
        self._maps[path] = array
        if len(self._maps) > _MAX_MAPS:
            # Dropped, not closed: arrays handed out earlier keep their mapping alive.
            self._maps.popitem(last=False)
        return array

    def close(self) -> None:
        """Close cached descriptors and drop the buffer and maps. Idempotent."""
        self._finalizer()
        self._maps.clear()
        self._buffer = bytearray(0)

    def _view(self, count: int, what: str) -> memoryview:
        """``count`` bytes of buffer to read ``what`` into (a path, for messages)."""
        if count > MAX_CACHED_BUFFER_BYTES:
            try:
                return memoryview(bytearray(count))
            except MemoryError as e:  # one allocation refused: nothing else is affected
                raise BadSample(
                    "too_large",
                    f"{what}: cannot allocate the {format_bytes(count)} to read it into; the "
                    "worker's machine is short of memory, or lower --max-sample-bytes",
                ) from e
        if count > len(self._buffer):
            # A new bytearray, never a resize: views handed out earlier may still exist.
            self._buffer = bytearray(
                min(max(count, 2 * len(self._buffer)), MAX_CACHED_BUFFER_BYTES)
            )
        return memoryview(self._buffer)[:count]

    def _mapping(self, entry: _Open, path: str) -> npt.NDArray[np.uint8]:
        """The whole file of a cached descriptor, mapped read-only (made once per descriptor)."""
        if entry.mapped is None:
            try:
                # mmap keeps its own duplicate of the descriptor.
                mapped = mmap.mmap(entry.fd, entry.size, access=mmap.ACCESS_READ)
            except OSError as e:
                if is_transient(e):
                    raise TransientError(path, e) from e
                raise BadSample("unreadable", f"{path}: cannot be mapped ({e})") from e
            except ValueError as e:  # an empty file
                raise BadSample("unreadable", f"{path}: cannot be mapped ({e})") from e
            entry.mapped = np.frombuffer(mapped, np.uint8)
        return entry.mapped

    def _cached_fd(self, path: str) -> tuple[int, int]:
        """A cached descriptor of ``path`` and the file's size (see the module docs)."""
        entry = self._cached(path)
        return entry.fd, entry.size

    def _cached(self, path: str) -> _Open:
        entry = self._fds.get(path)
        if entry is not None and entry.checked != self._batch:
            try:
                same = _identity(os.stat(entry.real)) == entry.identity
            except (OSError, ValueError):
                same = False
            if same:
                entry.checked = self._batch
            else:
                del self._fds[path]
                os.close(entry.fd)
                entry = None
        if entry is not None:
            self._fds.move_to_end(path)
            return entry
        fd, st, real = self._open(path)
        entry = self._fds[path] = _Open(fd, st, real, self._batch)
        if len(self._fds) > _MAX_OPEN_FDS:
            os.close(self._fds.popitem(last=False)[1].fd)
        return entry

    def _open(self, path: str) -> tuple[int, os.stat_result, str]:
        """An open descriptor of the regular file ``path`` names, its stat and real path.

        Where ``/proc`` re-checks every opened descriptor, a directory's resolved path is
        remembered: the next file in it is opened as that path plus its name (``O_NOFOLLOW``),
        which skips ``realpath``'s walk (a third of a small file's open). The re-check still
        refuses anything that lands outside the root; a name that is itself a symlink, or a
        directory moved since, falls back to the full resolution below.
        """
        head, _, name = path.rpartition(os.sep)
        known = self._dirs.get(head) if self._check_proc and name not in ("", ".", "..") else None
        if known is not None:
            try:
                fd = os.open(known + name, _OPEN_FLAGS)
            except (OSError, ValueError):
                fd = -1  # a symlink (ELOOP), gone, a NUL: resolve in full, which explains
            if fd >= 0:
                return self._confined(path, fd, known + name)
        real = self._resolve(path)
        try:
            fd = os.open(real, _OPEN_FLAGS)
        except OSError as e:
            raise _bad(path, e) from e
        fd_st_real = self._confined(path, fd, real)
        if self._check_proc and len(self._dirs) < _MAX_KNOWN_DIRS:
            real_head = os.path.dirname(real)
            if os.path.join(self.root, path) == os.path.join(real_head, name):
                # No symlink on the way: the directory resolves to itself plus the root.
                self._dirs[head] = real_head + os.sep
        return fd_st_real

    def _confined(self, path: str, fd: int, real: str) -> tuple[int, os.stat_result, str]:
        """Checks an opened ``fd`` (inside the root, a regular file); closes it if not."""
        try:
            try:
                if self._check_proc and not self._inside(os.readlink(f"{_PROC_FD}/{fd}")):
                    raise BadSample("unsafe_path", f"{path}: resolves outside {self.root}")
                st = os.fstat(fd)
            except OSError as e:
                raise _bad(path, e) from e
            if not stat.S_ISREG(st.st_mode):
                kind = "a directory" if stat.S_ISDIR(st.st_mode) else "not a regular file"
                raise BadSample("unreadable", f"{path}: is {kind}")
        except BaseException:
            os.close(fd)
            raise
        return fd, st, real

    def _resolve(self, path: str) -> str:
        if os.path.isabs(path) or ".." in path.split(os.sep):
            raise BadSample(
                "unsafe_path",
                f"{path!r}: sample paths must be relative to the dataset root, without '..'",
            )
        try:
            real = os.path.realpath(os.path.join(self.root, path))
        except (OSError, ValueError) as e:  # ValueError: an embedded NUL byte
            raise BadSample("unsafe_path", f"{path!r}: cannot be resolved ({e})") from e
        if not self._inside(real):
            raise BadSample("unsafe_path", f"{path}: resolves to {real}, outside {self.root}")
        return real

    def _inside(self, real: str) -> bool:
        return real == self.root or real.startswith(self._prefix)


def _pread_into(
    fd: int, view: memoryview, offset: int, path: str, faults: InjectedFaults | None = None
) -> None:
    """Fill ``view`` from ``fd`` at ``offset``, or raise BadSample (TransientError for an
    errno that is usually passing)."""
    count, done = len(view), 0
    while done < count:
        try:
            if faults is not None:
                faults.check(path)
            got = os.preadv(fd, [view[done:]], offset + done)
        except OSError as e:
            raise _bad(path, e) from e
        if got == 0:
            raise BadSample(
                "unreadable", f"{path}: file ended at byte {offset + done} while reading"
            )
        done += got


def _describe(e: OSError) -> str:
    return e.strerror or str(e)


def _bad(path: str, e: OSError) -> BadSample | TransientError:
    if is_transient(e):
        return TransientError(path, e)
    if e.errno in (errno.ENOENT, errno.ENOTDIR):
        return BadSample("missing", f"{path}: no such file")
    if e.errno == errno.ELOOP:
        # A symlink loop (realpath leaves it unresolved), or O_NOFOLLOW met a symlink that
        # appeared after the path was resolved.
        return BadSample("unsafe_path", f"{path}: symlink loop, or a symlink appeared")
    return BadSample("unreadable", f"{path}: {_describe(e)}")
