"""The format of a node-cache block file (NOTE [ Cache files ] in ``blocks.py``): a 40-byte
header (magic, the block's first byte in the object, the content's length, the chunk size, a
check of the chunk table, the object's version: :func:`version_tag`), a table of one XXH3-64
digest per 16 KiB chunk, then the content; and the checks a reader makes of them.

NOTE [ Object versions ]
The cache holds one version of an object: the one its record names (its ETag, else its
version id, as the store said when the object was first cached). Every block is written with
the version it was fetched as in its header, and every fill of a missing block asks the store
for the recorded version (``If-Match``), whichever process fills it. A reader reads blocks
for the version it knows; a block of another version is a miss, fetched again and replaced,
never served with blocks of another (the check is in the header each read reads anyway).
When the store says the object changed, the reader forgets the object (``BlockStore.forget``:
its blocks and record, under the ledger's lock), records the new version, and reads what was
asked again, all of it of the new version (``cache.CachingFetcher``).
"""

from __future__ import annotations

import os
import struct
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Final

import xxhash

__all__ = [
    "CHUNK_BYTES",
    "DIGEST_BYTES",
    "HEADER",
    "HEADER_BYTES",
    "MAGIC",
    "BlockRead",
    "chunk_hasher",
    "chunks_match",
    "digest",
    "pack_table",
    "read_spans",
    "table_check",
    "unpack_table",
    "version_tag",
    "whole_matches",
]

CHUNK_BYTES: Final = 16 << 10
"""Each chunk of a block has its own digest, so a read of a few records of a block checks
(and reads) those records' chunks, not 4 MiB. A batch of 64 random 128-byte records over
64 cached blocks took about 3 ms with 16 KiB chunks, 6 ms with 64 KiB and 30 ms reading
whole blocks (one run on the development machine, page cache warm; noisy)."""
HEADER_BYTES: Final = 40
HEADER: Final = struct.Struct("<8sQQIIQ")
MAGIC: Final = b"batchdB4"
"""B4: the object's version in the header. (B3 files, without it, and B2 files, with CRC-32s,
are read as bad: fetched again.)"""
DIGEST_BYTES: Final = 8
"""Each chunk's digest in the table: XXH3-64, which checks a warm read's bytes at about 15
GB/s on the development VM, where zlib's CRC-32 managed about 4 (in a warm epoch of a tar
dataset the CRC-32 took 3.6% of the workers' CPU)."""
digest: Final = xxhash.xxh3_64_intdigest


def version_tag(version: str | None) -> int:
    """What a block file's header keeps of its object's version (ETag, else version id):
    64 bits of its digest; 0 for an object whose store says no version."""
    return 0 if version is None else digest(version.encode("utf-8")) or 1


def chunk_hasher() -> xxhash.xxh3_64:
    """A chunk's :data:`digest`, fed piece by piece (``update``, ``intdigest``, ``reset``):
    for a writer that receives a block in pieces that fall across chunk edges."""
    return xxhash.xxh3_64()


def pack_table(digests: Sequence[int]) -> bytes:
    """The chunk table of ``digests``."""
    return struct.pack(f"<{len(digests)}Q", *digests)


def unpack_table(table: bytes | memoryview, n: int) -> tuple[int, ...]:
    """The ``n`` digests at the start of ``table``."""
    return struct.unpack_from(f"<{n}Q", table)


def table_check(table: bytes | memoryview) -> int:
    """The header's check of the chunk table (32 bits of its digest)."""
    return digest(table) & 0xFFFFFFFF


def chunks_match(
    view: memoryview, digests: Sequence[int], first: int, last: int, chunk: int
) -> bool:
    """Whether chunks ``first`` .. ``last - 1``, whose bytes ``view`` holds from the first
    one's start, have the table's digests."""
    return all(
        digest(view[(c - first) * chunk : (c + 1 - first) * chunk]) == digests[c]
        for c in range(first, last)
    )


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


def read_spans(
    fd: int,
    size: int,
    offset: int,
    block_bytes: int,
    chunk: int,
    spans: Sequence[tuple[int, int]],
    version: int = 0,
) -> BlockRead | None:
    """The chunks that hold the ``(lo, hi)`` spans of the block file ``fd`` (``size`` bytes,
    the block's first byte ``offset`` in its object), checked; None for a bad file. A block
    of another version of the object than ``version`` (:func:`version_tag`) is read as one
    without the spans (no parts): a miss, fetched again and replaced, never served.

    Raises:
        OSError: the file cannot be read.
    """
    head = os.pread(fd, HEADER_BYTES, 0)
    if len(head) < HEADER_BYTES:
        return None
    magic, stored, length, stored_chunk, checked, stored_version = HEADER.unpack(head)
    if magic != MAGIC or stored != offset:
        return None
    if stored_chunk != chunk or length > block_bytes:
        return None
    n = -(-length // chunk)
    if size != HEADER_BYTES + DIGEST_BYTES * n + length:
        return None
    table = os.pread(fd, DIGEST_BYTES * n, HEADER_BYTES)
    if len(table) != DIGEST_BYTES * n or table_check(table) != checked:
        return None
    if stored_version != version or max(hi for _, hi in spans) > length:
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


def whole_matches(
    head: bytes, data: bytes, offset: int, length: int, chunk: int, version: int = 0
) -> bool:
    """Whether ``head`` (a block file's header and chunk table) and ``data`` (its content,
    read with one byte more than ``length``) are a block of exactly ``length`` bytes at
    ``offset``, of the object's ``version`` (:func:`version_tag`), whose every chunk matches
    its digest."""
    n = -(-length // chunk)
    if len(head) != HEADER_BYTES + DIGEST_BYTES * n or len(data) != length:
        return False
    magic, stored, stored_length, stored_chunk, checked, stored_version = HEADER.unpack_from(head)
    if (magic, stored, stored_length, stored_chunk, stored_version) != (
        MAGIC,
        offset,
        length,
        chunk,
        version,
    ):
        return False
    table = memoryview(head)[HEADER_BYTES:]
    if table_check(table) != checked:
        return False
    return chunks_match(memoryview(data), unpack_table(table, n), 0, n, chunk)
