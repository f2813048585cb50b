"""The byte layout of a session's ring and of an inline batch, defined once for both sides.

A ring is one shared-memory segment::

    offset                               size          what
    0                                    HEADER_BYTES  token (first bytes), rest zero
    HEADER_BYTES + s * slot_bytes        slot_bytes    slot s, for s in 0 .. slots - 1

``slot_bytes`` is a multiple of :data:`SLOT_ALIGN` (a page: ``cudaHostRegister`` and large
copies want page-aligned memory). Inside a slot every field of the batch has a fixed
place, one after the other, each starting at a multiple of :data:`FIELD_ALIGN` (a cache line,
and enough for any dtype's alignment): ``fields[0]`` at 0, ``fields[i]`` at the end of
``fields[i - 1]``'s capacity rounded up. An inline batch (bytes inside gRPC messages) packs
the fields' *actual* bytes with the same rule, so the client can view them in place.

The server lays a ring out (``batchd_server.sessions``), its workers write into it and the
client maps it; all three use these functions, so they cannot disagree.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Final

__all__ = [
    "FIELD_ALIGN",
    "HEADER_BYTES",
    "SLOT_ALIGN",
    "ceil_div",
    "pack",
    "round_up",
    "slot_offset",
    "slot_size",
]

HEADER_BYTES: Final = 4096
"""The ring's first page; it starts with the token a client checks to know it maps the
server's segment."""
FIELD_ALIGN: Final = 64
"""Every field of a slot (and of an inline batch) starts at a multiple of this."""
SLOT_ALIGN: Final = 4096
"""Every slot starts at (and is a multiple of) a page."""


def ceil_div(n: int, d: int) -> int:
    """``ceil(n / d)`` in integers (``d > 0``), exact for any size."""
    return -(-n // d)


def round_up(n: int, multiple: int) -> int:
    """The smallest multiple of ``multiple`` that is ``>= n`` (``n >= 0``, ``multiple > 0``)."""
    return ceil_div(n, multiple) * multiple


def pack(sizes: Iterable[int]) -> tuple[list[int], int]:
    """Place blocks of ``sizes`` bytes one after the other at FIELD_ALIGN boundaries.

    Returns:
        Each block's offset, and the end of the last block rounded up to FIELD_ALIGN.
    """
    offsets = []
    end = 0
    for size in sizes:
        offsets.append(end)
        end += round_up(size, FIELD_ALIGN)
    return offsets, end


def slot_size(fields_bytes: int) -> int:
    """A slot's size for fields that take ``fields_bytes`` (from :func:`pack`): a whole page,
    at least one."""
    return max(SLOT_ALIGN, round_up(fields_bytes, SLOT_ALIGN))


def slot_offset(slot: int, slot_bytes: int, header_bytes: int = HEADER_BYTES) -> int:
    """Where slot ``slot`` starts in the ring segment."""
    return header_bytes + slot * slot_bytes
