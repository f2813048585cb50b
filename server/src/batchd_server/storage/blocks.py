"""Blocks of objects on a local disk: the node cache's store, shared by many processes.

NOTE [ Cache files ]
An object (named by its URL) is cut into aligned blocks of ``block_bytes``; block ``i``
covers bytes ``[i * block_bytes, (i + 1) * block_bytes)``. Each cached block is one file::

    <cache-dir>/blocks/<h[:2]>/<h>.<i>     h = the first 40 hex digits of sha256(url)
    <cache-dir>/blocks/<h[:2]>/<h>.json    {"url", "size", "version"}: the object as first cached
    <cache-dir>/blocks/<h[:2]>/.tmp-*      files being written
    <cache-dir>/usage                      the ledger (NOTE [ Ledger ] in ``cache_dir.py``)
    <cache-dir>/fetching                   empty: its bytes are the fetch locks' stripes

A block file is a 40-byte header (magic, the block's first byte in the object, the content's
length, the chunk size, a check of the chunk table, the object's version: NOTE [ Object
versions ] in ``block_format.py``), the chunk table
(an XXH3-64 digest of each 16 KiB chunk) and the content (``block_format.py``). A block may
hold a prefix of its range only (the end of the object, or of what was asked for when the
object's size is unknown); a read that needs more is a miss. A reader checks the header, the
file's size, the table's check and the digest of every chunk it reads: a file that is corrupt
or truncated, of an earlier format, unreadable (an I/O error) or not a regular file of the
server's user (a directory or a FIFO in its place) is removed and the block fetched again; if
it cannot be removed (a read-only disk), the block is fetched at every read, with a warning.
Per-chunk digests keep a hit cheap: a few records of a block cost a read of their chunks, not
of 4 MiB.

Writers (every worker process and the cache manager's prefetch threads) write a block to a
``.tmp-*`` file (at once, or piece by piece as a fetch receives it: ``BlockWriter``) and
``link`` it to its name: ``link`` never replaces, so two processes that fetched the same
block leave one file, and a reader never sees a half-written one. Each file's bytes (a
record counts as a file system block, ``RECORD_BYTES``) are reserved in the ledger before it
is written: a reservation that would pass the capacity is refused, and the block is served
without being kept. What is deleted is given back, so the files never take more than
``capacity_bytes``, whoever writes. Every change of a block directory's names is made under
the ledger's lock with its bytes, so :meth:`BlockStore.scan` (at start, and now and then
from the cache manager) can recount the files without holding the lock (NOTE [ Ledger ]).
Files are opened with ``O_NOFOLLOW | O_NONBLOCK``, and a directory another user may write
in is refused (``cache_dir.check_dir``).

Fetches are not repeated: a process about to fetch some missing blocks first takes their
*fetch locks* (``fetch_locks.py``), reads again what another process cached meanwhile, and
fetches only what is still missing. The kernel drops a dead process's locks, so a worker
killed mid-fetch holds no one up.

The directory is meant for one server at a time (``--cache-dir`` of one pod); it survives a
restart of that server: nothing in it depends on the process that wrote it.
"""

from __future__ import annotations

import contextlib
import errno
import json
import logging
import os
import secrets
import shutil
import stat
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Final

from batchd_server.storage.block_format import (
    CHUNK_BYTES,
    DIGEST_BYTES,
    HEADER,
    HEADER_BYTES,
    MAGIC,
    BlockRead,
    pack_table,
    read_spans,
    table_check,
    whole_matches,
)
from batchd_server.storage.block_keys import BlockKey, ObjectMeta, object_hash
from batchd_server.storage.block_listing import (
    RECORD_BYTES,
    RECORD_SUFFIX,
    TMP_PREFIX,
    Listing,
    list_directory,
)
from batchd_server.storage.block_writer import BlockWriter, write_at
from batchd_server.storage.cache_dir import SLOTS, Ledger, check_dir, open_file, safe_file
from batchd_server.storage.fetch_locks import FetchLocks

__all__ = [
    "BLOCK_BYTES",
    "CHUNK_BYTES",
    "DIGEST_BYTES",
    "HEADER_BYTES",
    "RECORD_BYTES",
    "BlockKey",
    "BlockRead",
    "BlockStore",
    "BlockWriter",
    "Listing",
    "ObjectMeta",
    "object_hash",
]

logger = logging.getLogger(__name__)

BLOCK_BYTES: Final = 4 << 20
"""A block's bytes at most: large enough that one GET of a block costs little more than
its latency, small enough that a sample's block is not mostly other samples."""


class BlockStore:
    """The block files under one cache directory (NOTE [ Cache files ]). Thread- and
    process-safe: every process opens its own.

    Args:
        root: The cache directory; created if missing.
        capacity_bytes: What all files together may take (block files and records).
        block_bytes: Bytes per block; every process on one directory must use the same.
        chunk_bytes: Bytes per checksummed chunk (a file of another chunk size is bad).

    Raises:
        FailedPrecondition: the directory (or one under it) is not this server's user's, or
            others may write in it (``cache_dir.check_dir``).
        OSError: the directory or its ledger cannot be made or opened (a read-only disk).
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
        root.mkdir(mode=0o700, parents=True, exist_ok=True)
        check_dir(root)
        self._blocks.mkdir(mode=0o700, exist_ok=True)
        check_dir(self._blocks, what="the cache's block directory")
        # Every block directory made now, not by the first block of each: a directory is an
        # inode, and on a file system that has just deleted many, a new one is slow to get.
        present = set(os.listdir(self._blocks))
        for prefix in (f"{i:02x}" for i in range(SLOTS)):
            if prefix not in present:
                (self._blocks / prefix).mkdir(mode=0o700, exist_ok=True)
            check_dir(self._blocks / prefix, what="the cache's block directory")
        self._ledger = Ledger(root / "usage")
        self.fetch_locks = FetchLocks(root / "fetching")
        """Held while fetching blocks (NOTE [ Cache files ])."""
        self.on_corrupt: Callable[[], object] | None = None
        """Called after a bad block file was found (and removed)."""
        self._warned: set[int | None] = set()

    @property
    def closed(self) -> bool:
        return self._ledger.closed

    def close(self) -> None:
        """Close the ledger. Idempotent."""
        if not self._ledger.closed:
            self._ledger.close()
            self.fetch_locks.close()

    def used_bytes(self) -> int:
        """What the files take now, by the ledger."""
        with self._ledger.locked() as ledger:
            return ledger.used

    def room(self) -> int:
        """The bytes that would fit now (a hint: another writer may take them first); 0 when
        the ledger cannot be read."""
        try:
            with self._ledger.locked() as ledger:
                return self.capacity_bytes - ledger.used
        except OSError:
            return 0

    def _give_back(self, nbytes: int, tmp: str | None, slot: int) -> None:
        """Give back a reservation and remove the file written for it."""
        try:
            with self._ledger.locked() as ledger:
                ledger.used -= nbytes
                ledger.touch(slot)
                if tmp is not None:
                    with contextlib.suppress(FileNotFoundError):
                        os.unlink(tmp)
        except OSError as e:
            self._refused(e, "give back a reservation")

    def _refused(self, error: OSError, doing: str) -> None:
        """Say once per kind of error that the disk refused something: the bytes are then
        served from the store without being kept (a full disk is quietly so)."""
        if error.errno in (errno.ENOSPC, errno.EDQUOT) or error.errno in self._warned:
            return
        self._warned.add(error.errno)
        logger.warning(
            "the node cache in %s could not %s (%s); what it cannot keep is read from the "
            "object store instead until the disk is fixed",
            self.root,
            doing,
            error.strerror or error,
        )

    # -- blocks -----------------------------------------------------------------------------

    def path(self, key: BlockKey) -> Path:
        return Path(self.file(key))

    def file(self, key: BlockKey) -> str:  # a hit opens it: no Path made per block read
        return f"{self._blocks}/{key.object[:2]}/{key.object}.{key.index}"

    def file_bytes(self, length: int) -> int:
        """What a block file of ``length`` content bytes takes (header, chunk table, content)."""
        return HEADER_BYTES + DIGEST_BYTES * -(-length // self.chunk_bytes) + length

    def read(
        self, key: BlockKey, spans: Sequence[tuple[int, int]], version: int = 0
    ) -> BlockRead | None:
        """The chunks of the block that hold the ``(lo, hi)`` spans (from its first byte),
        checked: None if it is not cached, or its file is bad (corrupt, truncated, not a
        regular file of the server's user, or unreadable: an I/O error); a bad file is then
        removed and :attr:`on_corrupt` called. A :class:`BlockRead` without parts if it
        holds fewer bytes than a span's end, or is of another version of the object than
        ``version`` (``version_tag``)."""
        path = self.file(key)
        why = "corrupt or truncated"
        try:
            fd = open_file(path, os.O_RDONLY)
        except FileNotFoundError:
            return None
        except OSError as e:
            got, why = None, f"unreadable ({e.strerror or e})"
        else:
            try:
                st = safe_file(fd)
                if st is None:
                    got, why = None, "not a regular file of the server's user"
                else:
                    got = read_spans(
                        fd,
                        st.st_size,
                        key.index * self.block_bytes,
                        self.block_bytes,
                        self.chunk_bytes,
                        spans,
                        version,
                    )
            except OSError as e:
                got, why = None, f"unreadable ({e.strerror or e})"
            finally:
                os.close(fd)
        if got is None:
            logger.warning(
                "cache block %s is %s; it is removed and will be fetched again", path, why
            )
            self.delete(key, reason="bad")
            if self.on_corrupt is not None:
                self.on_corrupt()
        return got

    def read_whole(self, key: BlockKey, length: int, version: int = 0) -> bytes | None:
        """The block's whole content when it holds exactly ``length`` bytes of the object's
        ``version`` (a small object whose size is known), in two reads and checked; None
        otherwise (not cached, another length or version, or bad: :meth:`read` then finds out
        which, and deletes a bad file).

        The fast path of a cached image: no ``fstat`` (a file that is not a regular one
        fails its ``pread``; one of another user cannot be in a directory only the server
        may write, ``cache_dir.check_dir``), no span bookkeeping, one ``pread`` of
        the content (one more byte asked, so a file longer than its header says is caught).
        """
        if not 0 < length <= self.block_bytes:
            return None
        chunk = self.chunk_bytes
        n = -(-length // chunk)
        try:
            fd = open_file(self.file(key), os.O_RDONLY)
        except OSError:  # not there; or a link, or unreadable: read() finds out which
            return None
        try:
            head = os.pread(fd, HEADER_BYTES + DIGEST_BYTES * n, 0)
            data = os.pread(fd, length + 1, HEADER_BYTES + DIGEST_BYTES * n)
        except OSError:  # an I/O error, a directory, a FIFO: read() removes it
            return None
        finally:
            os.close(fd)
        at = key.index * self.block_bytes
        return data if whole_matches(head, data, at, length, chunk, version) else None

    def write(
        self,
        key: BlockKey,
        content: bytes | memoryview,
        *,
        replace: bool = False,
        version: int = 0,
    ) -> bool:
        """Keep ``content`` as the block (through :meth:`writer`, in one piece); whether it is
        now cached (False: no room, or the disk refused). ``replace``: an existing file (a
        shorter prefix, or of another version) gives way."""
        view = memoryview(content).cast("B")
        writer = self.writer(key, len(view), version)
        if writer is None:
            return False
        try:
            writer.add(view)
        except OSError as e:
            self._refused(e, "write a block")
            writer.abort()
            return False
        return writer.finish(replace=replace)

    def writer(self, key: BlockKey, length: int, version: int = 0) -> BlockWriter | None:
        """A writer of the block's ``length`` bytes of the object's ``version``
        (``version_tag``), given in pieces as they arrive (:class:`BlockWriter`); None when
        the ledger has no room or the disk refused."""
        assert 0 <= length <= self.block_bytes, "a block's content fits a block"
        nbytes = self.file_bytes(length)
        slot = _slot(key.object)
        tmp = self._tmp_name(key.object, nbytes)
        fd = -1
        try:
            with self._ledger.locked() as ledger:
                if ledger.used + nbytes > self.capacity_bytes:
                    return None
                fd = _create(tmp)
                ledger.used += nbytes
                ledger.touch(slot)
        except OSError as e:
            if fd >= 0:  # the ledger refused after the file was made
                os.close(fd)
                with contextlib.suppress(OSError):
                    os.unlink(tmp)
            self._refused(e, "start a block file")
            return None
        return BlockWriter(self, key, length, nbytes, tmp, fd, version)

    def _tmp_name(self, h: str, nbytes: int) -> str:
        """A new file to write in the directory of ``h``'s blocks, named with the bytes
        reserved for it (which a recount counts while it is written)."""
        token = secrets.token_hex(8)
        return f"{self._blocks}/{h[:2]}/{TMP_PREFIX}{os.getpid()}-{token}-{nbytes}"

    def _head(
        self, key: BlockKey, length: int, digests: list[int], version: int = 0
    ) -> tuple[bytes, bytes]:
        """A block file's header and chunk table."""
        table = pack_table(digests)
        offset = key.index * self.block_bytes
        check = table_check(table)
        header = HEADER.pack(MAGIC, offset, length, self.chunk_bytes, check, version)
        return header, table

    def _link(self, tmp: str, key: BlockKey, nbytes: int, *, replace: bool) -> bool:
        """Give the written file ``tmp`` the block's name (``replace``: an existing file
        gives way first), and remove ``tmp``; if another writer linked it first, its file
        stays and this one's reservation is given back. Under the ledger's lock, so that a
        recount never sees the names half changed (NOTE [ Ledger ]). Whether the
        reservation was given back."""
        path = self.file(key)
        with self._ledger.locked() as ledger:
            ledger.touch(_slot(key.object))
            try:
                if replace:
                    ledger.used -= self._remove(path)[1]
                try:
                    os.link(tmp, path)
                except FileExistsError:  # another process cached it first: one file stays
                    ledger.used -= nbytes
                    return True
                return False
            finally:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(tmp)

    def _remove(self, path: str, charge: int | None = None) -> tuple[bool, int]:
        """Remove what is at ``path`` (by a holder of the ledger's lock): whether something
        was, and the bytes the ledger counted for it (``charge``, else a regular file's size;
        nothing for anything else, which no recount counts). A directory put in a file's
        place is removed if empty; one that is not stays, and is refused at every read.

        Raises:
            OSError: the disk refused (the entry stays).
        """
        try:
            st = os.lstat(path)
        except FileNotFoundError:
            return False, 0
        if stat.S_ISDIR(st.st_mode):
            os.rmdir(path)
            return True, 0
        os.unlink(path)
        if not stat.S_ISREG(st.st_mode):
            return True, 0
        return True, st.st_size if charge is None else charge

    def delete(self, key: BlockKey, *, reason: str = "") -> bool:
        """Delete the block's file (if any) and give its bytes back; whether one was there.
        The file is looked at, removed and its bytes given back under the ledger's lock: a
        writer that links the block again meanwhile waits, and its file is not the one
        removed."""
        del reason  # for the reader: why a caller deletes
        try:
            with self._ledger.locked() as ledger:
                found, nbytes = self._remove(self.file(key))
                ledger.used -= nbytes
                if found:
                    ledger.touch(_slot(key.object))
        except OSError as e:
            self._refused(e, f"delete the block file {self.file(key)}")
            return False
        return found

    def listing(self) -> tuple[dict[BlockKey, tuple[int, float]], dict[str, float]]:
        """Every block file (its bytes and modification time), and every object's record
        (its modification time), by the object's hash. No lock is held."""
        now = time.time()
        blocks: dict[BlockKey, tuple[int, float]] = {}
        records: dict[str, float] = {}
        for slot in range(SLOTS):
            found = list_directory(self._slot_dir(slot), now)
            blocks.update((BlockKey(h, i), v) for (h, i), v in found.blocks.items())
            records.update(found.records)
        return blocks, records

    def blocks(self) -> dict[BlockKey, tuple[int, float]]:
        """Every block file: its bytes and modification time."""
        return self.listing()[0]

    def directory(self, slot: int) -> Listing:
        """The files of block directory ``slot`` (of 256), listed without the ledger's lock."""
        return list_directory(self._slot_dir(slot), time.time())

    def _slot_dir(self, slot: int) -> str:
        return f"{self._blocks}/{slot:02x}"

    def scan(self) -> dict[BlockKey, tuple[int, float]]:
        """Set the ledger to what the files take (deleting writes left by a crash), and return
        :meth:`blocks`. Each directory is listed without the ledger's lock, and listed again
        if it changed meanwhile (NOTE [ Ledger ]); only a directory that changed during its
        second listing is listed a third time, under the lock. Writers do not wait for the
        listing, and what they change during it is counted once."""
        now = time.time()
        before = self._ledger.counters()
        listed = [list_directory(self._slot_dir(s), now) for s in range(SLOTS)]
        for _ in range(2):
            after = self._ledger.counters()
            changed = [s for s in range(SLOTS) if after[s] != before[s]]
            if not changed:
                break
            for s in changed:
                listed[s] = list_directory(self._slot_dir(s), now)
            before = after
        with self._ledger.locked() as ledger:
            after = self._ledger.peek_counters()
            for s in range(SLOTS):
                if after[s] != before[s]:
                    listed[s] = list_directory(self._slot_dir(s), now)
            ledger.used = sum(found.bytes for found in listed)
            for s, found in enumerate(listed):
                for stale in found.stale:  # not counted: a crashed writer's
                    with contextlib.suppress(FileNotFoundError):
                        os.unlink(stale)
                    ledger.touch(s)
        for legacy in ("objects", "tmp"):  # an earlier batchd's records and writes
            shutil.rmtree(self.root / legacy, ignore_errors=True)
        return {BlockKey(h, i): v for found in listed for (h, i), v in found.blocks.items()}

    # -- objects ----------------------------------------------------------------------------

    def _record(self, h: str) -> str:
        return f"{self._blocks}/{h[:2]}/{h}{RECORD_SUFFIX}"

    def meta(self, url: str) -> ObjectMeta | None:
        """What was recorded of ``url`` (None: nothing, or a record that does not parse or
        cannot be read, or an earlier batchd's, without a version: it is asked again)."""
        try:
            fd = open_file(self._record(object_hash(url)), os.O_RDONLY)
        except OSError:
            return None
        try:
            if safe_file(fd) is None:
                return None
            raw = os.pread(fd, RECORD_BYTES + 1, 0)
            record = json.loads(raw)
            version = record["version"]
            version = None if version is None else str(version)
            meta = ObjectMeta(str(record["url"]), int(record["size"]), version)
        except (OSError, ValueError, KeyError, TypeError):
            return None
        finally:
            os.close(fd)
        return meta if meta.url == url else None

    def record(self, meta: ObjectMeta) -> None:
        """Record ``meta`` (replacing what was recorded of its URL). A record is counted as
        :data:`RECORD_BYTES` of the capacity; with no room left (or a URL too long) it is
        not kept, and the size is asked of the store again when next needed."""
        h = object_hash(meta.url)
        path = self._record(h)
        text = json.dumps({"url": meta.url, "size": meta.size, "version": meta.version})
        data = text.encode("utf-8")
        if len(data) > RECORD_BYTES:
            return
        tmp = self._tmp_name(h, 0)
        try:
            with self._ledger.locked() as ledger:
                exists = os.path.lexists(path)
                if not exists and ledger.used + RECORD_BYTES > self.capacity_bytes:
                    return
                ledger.touch(_slot(h))
                fd = _create(tmp)
                try:
                    write_at(fd, data, 0)
                finally:
                    os.close(fd)
                try:
                    os.link(tmp, path)
                    ledger.used += RECORD_BYTES
                except FileExistsError:  # the record is replaced; its charge stays
                    os.replace(tmp, path)
        except OSError as e:
            self._refused(e, "record an object's size")
        finally:
            with contextlib.suppress(OSError):
                os.unlink(tmp)

    def delete_record(self, h: str) -> bool:
        """Delete the record of the object whose URL hashes to ``h``; whether there was one."""
        try:
            with self._ledger.locked() as ledger:
                found, nbytes = self._remove(self._record(h), charge=RECORD_BYTES)
                ledger.used -= nbytes
                if found:
                    ledger.touch(_slot(h))
        except OSError as e:
            self._refused(e, "delete a record")
            return False
        return found

    def forget(self, url: str) -> int:
        """Delete every block of ``url`` and its record (the object changed); blocks deleted."""
        h = object_hash(url)
        found = list_directory(self._slot_dir(_slot(h)), time.time())
        deleted = sum(
            self.delete(BlockKey(o, i), reason="changed") for o, i in found.blocks if o == h
        )
        self.delete_record(h)
        return deleted


def _create(path: str) -> int:
    """A new file to write (its block directory made again if it was removed)."""
    try:
        return open_file(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL)
    except FileNotFoundError:
        os.mkdir(os.path.dirname(path), 0o700)
        return open_file(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL)


def _slot(h: str) -> int:
    """The block directory (and ledger counter) of the object whose URL hashes to ``h``."""
    return int(h[:2], 16)
