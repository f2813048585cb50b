"""Blocks of objects on a local disk: the node cache's store, shared by many processes.

NOTE [ Cache files ]
An object (named by its URL) is cut into aligned blocks of ``block_bytes``; block ``i``
covers bytes ``[i * block_bytes, (i + 1) * block_bytes)``. Each cached block is one file::

    <cache-dir>/blocks/<h[:2]>/<h>.<i>    h = the first 40 hex digits of sha256(url)
    <cache-dir>/objects/<h>.json          {"url", "size"}: the object's size when first cached
    <cache-dir>/tmp/                      files being written
    <cache-dir>/usage                     8 bytes: what every file together takes
    <cache-dir>/fetching                  empty: its bytes are the fetch locks' stripes

A block file is a 32-byte header (magic, the block's first byte in the object, the content's
length, the chunk size, a check of the chunk table), the chunk table (an XXH3-64 digest of
each 16 KiB chunk of the content) and the content. A block may hold a prefix of its range only
(the end of the object, or of what was asked for when the object's size is unknown); a read
that needs more is a miss. A reader checks the header, the file's size against the length,
the table's check and the digest of every chunk it reads: a file that is corrupt or truncated
(a disk error, a crash in the middle of a copy, an operator's ``truncate``), or of an earlier
format, is deleted and the block fetched again. Per-chunk digests keep a hit cheap: a few
records of a block cost a read of their chunks, not of 4 MiB. (A flipped byte in a chunk no
one reads goes unseen until someone reads it, which is when it matters.)

Writers (every worker process and the cache manager's prefetch threads) write a block under
``tmp/`` (at once, or piece by piece as a fetch receives it: ``BlockWriter``, which writes
the header and the chunk table last) and ``link`` it to its name: ``link`` never replaces,
so two processes that fetched the same block leave one file, and a reader never sees a
half-written one. The files' total is bounded by reserving each file's bytes in ``usage`` (under
``flock``) before it is written: a reservation that would pass the capacity is refused, and
the block is served without being kept. What is deleted is given back. So the files never
take more than ``capacity_bytes``, whoever writes. A crash between a reservation and the
link can leave the ledger high; :meth:`BlockStore.scan` (at start, and now and then from the
cache manager) sets it to what the files really take.

Fetches are not repeated: a process about to fetch some missing blocks first takes their
*fetch locks* (``fetch_locks.py``: a byte-range lock on ``fetching`` per stripe of blocks,
plus a thread lock per stripe, since a process's byte-range locks do not exclude its own
threads), reads again what another process cached meanwhile, and fetches only what is still
missing. Two workers and the prefetcher that need the same row group at the start of a cold
epoch then fetch it once, not three times: the later ones wait for the first's GET and read
its blocks from the disk. The kernel drops a dead process's locks, so a worker killed
mid-fetch holds no one up.

The directory is meant for one server at a time (``--cache-dir`` of one pod); it survives a
restart of that server: nothing in it depends on the process that wrote it.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import functools
import hashlib
import json
import logging
import os
import secrets
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Final

from batchd_server.storage.block_format import (
    CHUNK_BYTES,
    DIGEST_BYTES,
    HEADER,
    HEADER_BYTES,
    MAGIC,
    chunk_hasher,
    chunks_match,
    pack_table,
    table_check,
    unpack_table,
)
from batchd_server.storage.fetch_locks import FetchLocks

__all__ = [
    "BLOCK_BYTES",
    "CHUNK_BYTES",
    "DIGEST_BYTES",
    "HEADER_BYTES",
    "BlockKey",
    "BlockRead",
    "BlockStore",
    "BlockWriter",
    "ObjectMeta",
    "object_hash",
]

logger = logging.getLogger(__name__)

BLOCK_BYTES: Final = 4 << 20
"""A block's bytes at most: large enough that one GET of a block costs little more than
its latency, small enough that a sample's block is not mostly other samples."""
_STALE_TMP_S: Final = 600.0
"""A file under tmp/ older than this was left by a crashed writer."""


@functools.lru_cache(maxsize=1 << 16)
def object_hash(url: str) -> str:
    """The 40 hex digits naming ``url``'s files (NOTE [ Cache files ]); remembered, since a
    warm epoch of one object per image asks for each of them once per read."""
    return hashlib.sha256(url.encode("utf-8")).hexdigest()[:40]


@dataclass(frozen=True, order=True)
class BlockKey:
    """Block ``index`` of the object whose URL hashes to ``object``."""

    object: str
    index: int

    @property
    def name(self) -> str:
        return f"{self.object}.{self.index}"

    @classmethod
    def parse(cls, name: str) -> BlockKey | None:
        """The key of a block file's name; None for a name that is not one."""
        head, _, tail = name.partition(".")
        if len(head) != 40 or not tail.isdigit():
            return None
        return cls(head, int(tail))


@dataclass(frozen=True)
class BlockRead:
    """Some bytes of a cached block: ``parts`` are ``(start, bytes)`` runs of its chunks that
    cover what was asked (None when the block holds fewer bytes than were asked: only its
    first ``length``)."""

    length: int
    parts: Sequence[tuple[int, bytes | memoryview]] | None

    def cut(self, lo: int, hi: int) -> bytes | memoryview:
        """Bytes ``[lo, hi)`` of the block, from the part that holds them."""
        assert self.parts is not None, "a short block has no parts"
        for start, data in self.parts:
            if start <= lo and hi <= start + len(data):
                return data[lo - start : hi - start]
        raise AssertionError(f"[{lo}, {hi}) was not read")


@dataclass(frozen=True)
class ObjectMeta:
    """What the store said about an object when its first block was cached."""

    url: str
    size: int
    """Bytes."""


class BlockStore:
    """The block files under one cache directory (NOTE [ Cache files ]). Thread- and
    process-safe: every process opens its own.

    Args:
        root: The cache directory; created if missing.
        capacity_bytes: What all files together may take.
        block_bytes: Bytes per block; every process on one directory must use the same.
        chunk_bytes: Bytes per checksummed chunk (a file of another chunk size is bad).
    """

    def __init__(
        self,
        root: Path,
        *,
        capacity_bytes: int,
        block_bytes: int = BLOCK_BYTES,
        chunk_bytes: int = CHUNK_BYTES,
    ) -> None:
        if capacity_bytes < 0:
            raise ValueError(f"capacity_bytes={capacity_bytes} must be >= 0")
        if block_bytes < 1:
            raise ValueError(f"block_bytes={block_bytes} must be >= 1")
        self.root = root
        self.capacity_bytes = capacity_bytes
        self.block_bytes = block_bytes
        self.chunk_bytes = min(chunk_bytes, block_bytes)
        self._blocks = root / "blocks"
        self._objects = root / "objects"
        self._tmp = root / "tmp"
        for d in (self._blocks, self._objects, self._tmp):
            d.mkdir(parents=True, exist_ok=True)
        # Every block directory made now, not by the first block of each: a directory is an
        # inode, and on a file system that has just deleted many, a new one is slow to get.
        present = set(os.listdir(self._blocks))
        for prefix in (f"{i:02x}" for i in range(256)):
            if prefix not in present:
                (self._blocks / prefix).mkdir(exist_ok=True)
        self._ledger_fd = os.open(root / "usage", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        # flock excludes other processes; threads of this one share the descriptor.
        self._lock = threading.Lock()
        self.fetch_locks = FetchLocks(root / "fetching")
        """Held while fetching blocks (NOTE [ Cache files ])."""
        self.on_corrupt: Callable[[], object] | None = None
        """Called after a corrupt or truncated block file was found (and deleted)."""

    @property
    def closed(self) -> bool:
        return self._ledger_fd < 0

    def close(self) -> None:
        """Close the ledger. Idempotent."""
        with self._lock:
            if self._ledger_fd >= 0:
                os.close(self._ledger_fd)
                self.fetch_locks.close()
                self._ledger_fd = -1

    # -- the ledger -------------------------------------------------------------------------

    @contextlib.contextmanager
    def _ledger(self) -> Iterator[list[int]]:
        """The bytes the files take, locked against every process; assign ``[0]`` to change it."""
        with self._lock:
            fcntl.flock(self._ledger_fd, fcntl.LOCK_EX)
            try:
                raw = os.pread(self._ledger_fd, 8, 0)
                used = [int.from_bytes(raw, "little") if len(raw) == 8 else 0]
                before = used[0]
                yield used
                if used[0] != before:
                    os.pwrite(self._ledger_fd, max(used[0], 0).to_bytes(8, "little"), 0)
            finally:
                fcntl.flock(self._ledger_fd, fcntl.LOCK_UN)

    def used_bytes(self) -> int:
        """What the files take now, by the ledger."""
        with self._ledger() as used:
            return used[0]

    def _reserve(self, nbytes: int) -> bool:
        with self._ledger() as used:
            if used[0] + nbytes > self.capacity_bytes:
                return False
            used[0] += nbytes
            return True

    def _give_back(self, nbytes: int) -> None:
        with self._ledger() as used:
            used[0] -= nbytes

    # -- blocks -----------------------------------------------------------------------------

    def path(self, key: BlockKey) -> Path:
        return Path(self.file(key))

    def file(self, key: BlockKey) -> str:  # a hit opens it: no Path made per block read
        return f"{self._blocks}/{key.object[:2]}/{key.object}.{key.index}"

    def file_bytes(self, length: int) -> int:
        """What a block file of ``length`` content bytes takes (header, chunk table, content)."""
        return HEADER_BYTES + DIGEST_BYTES * -(-length // self.chunk_bytes) + length

    def read(self, key: BlockKey, spans: Sequence[tuple[int, int]]) -> BlockRead | None:
        """The chunks of the block that hold the ``(lo, hi)`` spans (from its first byte),
        checked: None if it is not cached, or its file is bad (then deleted, and
        :attr:`on_corrupt` called); a :class:`BlockRead` without parts if it holds fewer
        bytes than a span's end."""
        path = self.file(key)
        try:
            fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        except FileNotFoundError:
            return None
        try:
            got = self._read(fd, key, spans)
        finally:
            os.close(fd)
        if got is None:
            logger.warning(
                "cache block %s is corrupt or truncated; it is deleted and will be fetched again",
                path,
            )
            self.delete(key, reason="corrupt")
            if self.on_corrupt is not None:
                self.on_corrupt()
        return got

    def read_whole(self, key: BlockKey, length: int) -> bytes | None:
        """The block's whole content when it holds exactly ``length`` bytes (a small object
        whose size is known), in two reads and checked; None otherwise (not cached, another
        length, or bad: :meth:`read` then finds out which, and deletes a bad file).

        The fast path of a cached image: no ``fstat``, no span bookkeeping, one ``pread`` of
        the content (one more byte asked, so a file longer than its header says is caught).
        """
        if not 0 < length <= self.block_bytes:
            return None
        try:
            fd = os.open(self.file(key), os.O_RDONLY | os.O_CLOEXEC)
        except FileNotFoundError:
            return None
        try:
            chunk = self.chunk_bytes
            n = -(-length // chunk)
            head = os.pread(fd, HEADER_BYTES + DIGEST_BYTES * n, 0)
            data = os.pread(fd, length + 1, HEADER_BYTES + DIGEST_BYTES * n)
        finally:
            os.close(fd)
        if len(head) != HEADER_BYTES + DIGEST_BYTES * n or len(data) != length:
            return None
        magic, offset, stored, stored_chunk, checked = HEADER.unpack_from(head)
        if (magic, offset, stored, stored_chunk) != (
            MAGIC,
            key.index * self.block_bytes,
            length,
            chunk,
        ):
            return None
        table = memoryview(head)[HEADER_BYTES:]
        if table_check(table) != checked:
            return None
        digests = unpack_table(table, n)
        return data if chunks_match(memoryview(data), digests, 0, n, chunk) else None

    def _read(self, fd: int, key: BlockKey, spans: Sequence[tuple[int, int]]) -> BlockRead | None:
        """As :meth:`read`; None for a bad file."""
        size = os.fstat(fd).st_size
        head = os.pread(fd, HEADER_BYTES, 0)
        if len(head) < HEADER_BYTES:
            return None
        magic, offset, length, chunk, checked = HEADER.unpack(head)
        if magic != MAGIC or offset != key.index * self.block_bytes:
            return None
        if chunk != self.chunk_bytes or length > self.block_bytes:
            return None
        if size != self.file_bytes(length):
            return None
        n = -(-length // chunk)
        table = os.pread(fd, DIGEST_BYTES * n, HEADER_BYTES)
        if len(table) != DIGEST_BYTES * n or table_check(table) != checked:
            return None
        if max(hi for _, hi in spans) > length:
            return BlockRead(length, None)
        wanted = sorted({c for lo, hi in spans for c in range(lo // chunk, -(-hi // chunk))})
        runs: list[list[int]] = []
        for c in wanted:
            if runs and runs[-1][1] == c:
                runs[-1][1] = c + 1
            else:
                runs.append([c, c + 1])
        digests = unpack_table(table, n)
        parts = []
        for first, last in runs:
            start, end = first * chunk, min(last * chunk, length)
            data = os.pread(fd, end - start, HEADER_BYTES + DIGEST_BYTES * n + start)
            if len(data) != end - start:
                return None
            view = memoryview(data)  # a reader's cut of it is a view, not another copy
            if not chunks_match(view, digests, first, last, chunk):
                return None
            parts.append((start, view))
        return BlockRead(length, parts)

    def write(self, key: BlockKey, content: bytes | memoryview, *, replace: bool = False) -> bool:
        """Keep ``content`` as the block (through :meth:`writer`, in one piece); whether it is
        now cached (False: no room, or the disk refused). ``replace``: an existing file (a
        shorter prefix) gives way."""
        view = memoryview(content).cast("B")
        writer = self.writer(key, len(view))
        if writer is None:
            return False
        try:
            writer.add(view)
        except OSError:
            writer.abort()
            return False
        return writer.finish(replace=replace)

    def writer(self, key: BlockKey, length: int) -> BlockWriter | None:
        """A writer of the block's ``length`` bytes, given in pieces as they arrive
        (:class:`BlockWriter`); None when the ledger has no room or the disk refused."""
        assert 0 <= length <= self.block_bytes, "a block's content fits a block"
        nbytes, tmp = self.file_bytes(length), self._tmp_name()
        if not self._reserve(nbytes):
            return None
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
        except OSError:
            self._give_back(nbytes)
            return None
        return BlockWriter(self, key, length, nbytes, tmp, fd)

    def _tmp_name(self) -> str:
        return f"{self._tmp}/{os.getpid()}-{secrets.token_hex(8)}"

    def _head(self, key: BlockKey, length: int, digests: list[int]) -> tuple[bytes, bytes]:
        """A block file's header and chunk table."""
        table = pack_table(digests)
        offset = key.index * self.block_bytes
        header = HEADER.pack(MAGIC, offset, length, self.chunk_bytes, table_check(table))
        return header, table

    def _link(self, tmp: str, key: BlockKey, nbytes: int, *, replace: bool) -> None:
        """Give the written file ``tmp`` the block's name (``replace``: an existing file
        gives way first); if another writer linked it first, its file stays and this one's
        reservation is given back."""
        path = self.path(key)
        if replace:
            self.delete(key, reason="extended")
        try:
            try:
                os.link(tmp, path)
            except FileNotFoundError:  # the first block under this prefix
                path.parent.mkdir(exist_ok=True)
                os.link(tmp, path)
        except FileExistsError:  # another process cached it first: one file stays
            self._give_back(nbytes)

    def delete(self, key: BlockKey, *, reason: str = "") -> bool:
        """Delete the block's file (if any) and give its bytes back; whether one was there."""
        del reason  # for the reader: why a caller deletes
        path = self.path(key)
        try:
            size = path.stat().st_size
            os.unlink(path)
        except FileNotFoundError:
            return False
        self._give_back(size)
        return True

    def blocks(self) -> dict[BlockKey, tuple[int, float]]:
        """Every block file: its bytes and modification time."""
        found: dict[BlockKey, tuple[int, float]] = {}
        for sub in _entries(self._blocks):
            if not sub.is_dir():
                continue
            for entry in _entries(Path(sub.path)):
                key = BlockKey.parse(entry.name)
                if key is None:
                    continue
                try:
                    st = entry.stat()
                except FileNotFoundError:
                    continue
                found[key] = (st.st_size, st.st_mtime)
        return found

    def scan(self) -> dict[BlockKey, tuple[int, float]]:
        """Set the ledger to what the files take (deleting writes left by a crash), and return
        :meth:`blocks`. Writers wait meanwhile."""
        now = time.time()
        with self._ledger() as used:
            pending = 0
            for entry in _entries(self._tmp):
                try:
                    st = entry.stat()
                    if now - st.st_mtime > _STALE_TMP_S:
                        os.unlink(entry.path)
                    else:
                        pending += st.st_size
                except FileNotFoundError:
                    continue
            found = self.blocks()
            used[0] = pending + sum(size for size, _ in found.values())
        return found

    # -- objects ----------------------------------------------------------------------------

    def meta(self, url: str) -> ObjectMeta | None:
        """What was recorded of ``url`` (None: nothing, or a record that does not parse)."""
        path = self._objects / f"{object_hash(url)}.json"
        try:
            record = json.loads(path.read_text("utf-8"))
            meta = ObjectMeta(str(record["url"]), int(record["size"]))
        except FileNotFoundError:
            return None
        except (OSError, ValueError, KeyError, TypeError):
            return None
        return meta if meta.url == url else None

    def record(self, meta: ObjectMeta) -> None:
        """Record ``meta`` (replacing what was recorded of its URL)."""
        path = self._objects / f"{object_hash(meta.url)}.json"
        tmp = f"{self._tmp_name()}.json"
        record = json.dumps({"url": meta.url, "size": meta.size}).encode("utf-8")
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
            try:
                _write_at(fd, record, 0)
            finally:
                os.close(fd)
            os.replace(tmp, path)
        except OSError as e:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)
            if e.errno not in (errno.ENOSPC, errno.EDQUOT):
                raise

    def forget(self, url: str) -> int:
        """Delete every block of ``url`` and its record (the object changed); blocks deleted."""
        h = object_hash(url)
        deleted = 0
        for entry in _entries(self._blocks / h[:2]):
            key = BlockKey.parse(entry.name)
            if key is not None and key.object == h and self.delete(key, reason="changed"):
                deleted += 1
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self._objects / f"{h}.json")
        return deleted


class BlockWriter:
    """One block file written piece by piece (:meth:`BlockStore.writer`): the content goes to
    its place in a file under ``tmp/`` as it comes, each chunk's digest grows with it, and
    :meth:`finish` writes the header and the chunk table and links the file into place: no
    buffer of the block is needed. Not thread-safe (one fetch writes it)."""

    def __init__(
        self, store: BlockStore, key: BlockKey, length: int, nbytes: int, tmp: str, fd: int
    ) -> None:
        self._store, self.key, self.length = store, key, length
        self._nbytes, self._tmp, self._fd = nbytes, tmp, fd
        self._base = HEADER_BYTES + DIGEST_BYTES * -(-length // store.chunk_bytes)
        self._at = 0
        self._digests: list[int] = []
        self._hash = chunk_hasher()  # of the chunk being written, so far

    def add(self, piece: memoryview) -> None:
        """The next bytes of the content.

        Raises:
            OSError: the disk refused them (the writer is then of no use: :meth:`abort` it).
        """
        assert self._at + len(piece) <= self.length, "more bytes than the block holds"
        _write_at(self._fd, piece, self._base + self._at)
        chunk = self._store.chunk_bytes
        while len(piece):
            take = min(len(piece), chunk - self._at % chunk)
            self._hash.update(piece[:take])
            self._at += take
            piece = piece[take:]
            if self._at % chunk == 0 or self._at == self.length:
                self._digests.append(self._hash.intdigest())
                self._hash.reset()

    def finish(self, *, replace: bool = False) -> bool:
        """Write the header and the table and link the block into place (``replace`` as in
        :meth:`BlockStore.write`); whether it is now cached. The content must be whole."""
        assert self._at == self.length, f"{self._at} of the block's {self.length} bytes written"
        try:
            head = self._store._head(self.key, self.length, self._digests)
            _write_at(self._fd, b"".join(head), 0)
            os.close(self._fd)
            self._fd = -1
            self._store._link(self._tmp, self.key, self._nbytes, replace=replace)
            return True
        except OSError:
            self.abort()
            return False
        finally:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self._tmp)

    def abort(self) -> None:
        """Drop what was written and give its room back. Idempotent."""
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1
        if self._nbytes:
            self._store._give_back(self._nbytes)
            self._nbytes = 0
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self._tmp)


def _write_at(fd: int, data: bytes | memoryview, at: int) -> None:
    """Write ``data`` at ``at``, in as many calls as the kernel needs."""
    view = memoryview(data).cast("B")
    while len(view):
        done = os.pwrite(fd, view, at)
        view, at = view[done:], at + done


def _entries(directory: Path) -> list[os.DirEntry[str]]:
    try:
        with os.scandir(directory) as it:
            return list(it)
    except FileNotFoundError:
        return []
