"""The format of a node-cache block file (NOTE [ Cache files ] in ``blocks.py``): a 32-byte
header (magic, the block's first byte in the object, the content's length, the chunk size, a
check of the chunk table), a table of one XXH3-64 digest per 16 KiB chunk, then the content;
and the checks a reader makes of them."""

from __future__ import annotations

import struct
from collections.abc import Sequence
from typing import Final

import xxhash

__all__ = [
    "CHUNK_BYTES",
    "DIGEST_BYTES",
    "HEADER",
    "HEADER_BYTES",
    "MAGIC",
    "chunk_hasher",
    "chunks_match",
    "digest",
    "pack_table",
    "table_check",
    "unpack_table",
]

CHUNK_BYTES: Final = 16 << 10
"""Each chunk of a block has its own digest, so a read of a few records of a block checks
(and reads) those records' chunks, not 4 MiB. A batch of 64 random 128-byte records over
64 cached blocks took about 3 ms with 16 KiB chunks, 6 ms with 64 KiB and 30 ms reading
whole blocks (one run on the development machine, page cache warm; noisy)."""
HEADER_BYTES: Final = 32
HEADER: Final = struct.Struct("<8sQQII")
MAGIC: Final = b"batchdB3"
"""B3: XXH3-64 digests. (B2 files, with CRC-32s, are read as bad: fetched again.)"""
DIGEST_BYTES: Final = 8
"""Each chunk's digest in the table: XXH3-64, which checks a warm read's bytes at about 15
GB/s on the development VM, where zlib's CRC-32 managed about 4 (in a warm epoch of a tar
dataset the CRC-32 took 3.6% of the workers' CPU)."""
digest: Final = xxhash.xxh3_64_intdigest


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
