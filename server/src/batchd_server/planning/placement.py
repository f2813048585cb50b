"""Where packing puts each document's remainder (NOTE [ Packed rows ]): best- and first-fit
decreasing, and the placements shared by the sessions that pack the same documents.

Where each remainder goes depends on the remainders' lengths, the method and ``seq_len``
alone, not on the epoch's order, nor on the session. So two sessions of one dataset (two
ranks of a job, a job restarted, a second job on the same data) place once: the placement is
kept in ``PLACEMENT_CACHE``, keyed by (method, ``seq_len``, a digest of the lengths), least
recently used first out past ``max_bytes``. A placement is read-only once made.
"""

from __future__ import annotations

import bisect
import functools
import hashlib
import threading
from collections import OrderedDict
from collections.abc import Callable
from typing import Final

import numpy as np

from batchd_server.metrics.planning import PLACEMENTS
from batchd_server.planning.pacing import Pace
from batchd_server.planning.sampling import Int64Array

__all__ = ["PLACEMENT_CACHE", "PLACEMENT_CACHE_BYTES", "PlacementCache", "place", "place_lengths"]

PLACEMENT_CACHE_BYTES: Final = 256 << 20
"""The server's placements kept at most: some 30 sources of a million documents each."""


def place_lengths(lengths: Int64Array, method: str, seq_len: int) -> Int64Array:
    """The row of each remainder (``lengths % seq_len``, the nonzero ones), longest first,
    by ``method`` ("best_fit" or "first_fit"): from ``PLACEMENT_CACHE`` when another session
    placed the same."""
    rest = lengths[lengths > 0] % seq_len
    descending = -np.sort(-rest[rest > 0])
    return PLACEMENT_CACHE.get(
        method, seq_len, descending, functools.partial(place, method=method, seq_len=seq_len)
    )


def place(descending: Int64Array, method: str, seq_len: int) -> Int64Array:
    """The row of each of these remainders (longest first) by ``method``, placed anew."""
    if method == "first_fit":
        return _first_fit(descending, seq_len)
    return _best_fit(descending, seq_len)


class PlacementCache:
    """Placements by (method, seq_len, lengths), least recently used first out. Thread-safe;
    ``hits`` and ``misses`` count the lookups."""

    def __init__(self, max_bytes: int = PLACEMENT_CACHE_BYTES) -> None:
        self.max_bytes = max_bytes
        self.hits = 0
        self.misses = 0
        self._lock = threading.Lock()
        self._kept: OrderedDict[tuple[str, int, bytes], Int64Array] = OrderedDict()
        self._bytes = 0

    def get(
        self,
        method: str,
        seq_len: int,
        descending: Int64Array,
        place: Callable[[Int64Array], Int64Array],
    ) -> Int64Array:
        """The placement of ``descending`` (remainders, longest first): the kept one, else
        ``place(descending)``, kept from then on (when it fits)."""
        digest = hashlib.blake2b(np.ascontiguousarray(descending).tobytes(), digest_size=20)
        key = (method, seq_len, digest.digest() + descending.size.to_bytes(8, "little"))
        with self._lock:
            kept = self._kept.get(key)
            if kept is not None:
                self._kept.move_to_end(key)
                self.hits += 1
        if kept is not None:
            PLACEMENTS.labels("hit").inc()
            return kept
        placed = place(descending)
        placed.setflags(write=False)
        with self._lock:
            self.misses += 1
            if key not in self._kept and placed.nbytes <= self.max_bytes:
                self._kept[key] = placed
                self._bytes += placed.nbytes
                while self._bytes > self.max_bytes:
                    _, evicted = self._kept.popitem(last=False)
                    self._bytes -= evicted.nbytes
        PLACEMENTS.labels("miss").inc()
        return placed

    def clear(self) -> None:
        """Forget every placement (and the counts)."""
        with self._lock:
            self._kept.clear()
            self._bytes = 0
            self.hits = self.misses = 0


PLACEMENT_CACHE: Final = PlacementCache()
"""The server's one cache: every session's packed sources look here."""


_CHUNK: Final = 1 << 10
"""Items ``_best_fit`` converts between numpy and Python, and places, between two looks at
its ``Pace``: a conversion holds the interpreter (a million at once, some 50 ms)."""


def _best_fit(descending: Int64Array, capacity: int) -> Int64Array:
    """Each item's row: the fullest open row it fits, else a new one (rows numbered as
    opened). Rows are kept in buckets by room left, and the distinct rooms in a sorted list
    (at most ``capacity`` of them), so an item costs a bisect, not a scan of the rows."""
    rooms: list[int] = []
    buckets: dict[int, list[int]] = {}
    out = np.empty(descending.size, np.int64)
    opened = 0
    pace = Pace()
    for first in range(0, descending.size, _CHUNK):
        pace()
        chunk: list[int] = []
        for length in descending[first : first + _CHUNK].tolist():
            i = bisect.bisect_left(rooms, length)
            if i < len(rooms):
                room = rooms[i]
                bucket = buckets[room]
                row = bucket.pop()
                if not bucket:
                    del rooms[i]
                    del buckets[room]
            else:
                room, row = capacity, opened
                opened += 1
            chunk.append(row)
            left = room - length
            if left:
                if left not in buckets:
                    buckets[left] = []
                    bisect.insort(rooms, left)
                buckets[left].append(row)
        out[first : first + len(chunk)] = chunk
    return out


_BLOCK: Final = 256
"""Rows per block of ``_first_fit``'s room index (each block's largest room)."""


def _first_fit(descending: Int64Array, capacity: int) -> Int64Array:
    """Each item's row: the first opened row it fits, else a new one (rows numbered as
    opened), for items in decreasing order.

    The items of one size go together: the first row with room for one takes as many as
    fit (it stays the first that fits until it has no room for another), then the next such
    row, then new rows take ``capacity // size`` each. So a size costs a few numpy steps,
    not a step per item; which rows have room is found through each block of ``_BLOCK``
    rows' largest room, and only the first ``items`` blocks with room are looked into (each
    such block has a row that takes at least one item)."""
    n = descending.size
    out = np.empty(n, np.int64)
    room = np.zeros(n + _BLOCK, np.int64)
    """Each row's room; rows not yet opened have none."""
    block_room = np.zeros(-(-room.size // _BLOCK), np.int64)
    opened = 0
    ends = np.flatnonzero(np.diff(descending)) + 1
    pace = Pace()
    for a, b in zip([0, *ends.tolist()], [*ends.tolist(), n], strict=True):
        if a >= n:
            break
        pace()
        size, items = int(descending[a]), b - a
        placed = 0
        if items == 1:
            # One item (sizes all distinct, as under a large seq_len): the first block with
            # room, its first row with room, in a few steps of their own.
            with_room = block_room[: -(-opened // _BLOCK)] >= size
            block = int(with_room.argmax()) if with_room.size else 0
            if with_room.size and with_room[block]:
                base = block * _BLOCK
                row = base + int((room[base : base + _BLOCK] >= size).argmax())
                out[a] = row
                room[row] -= size
                block_room[block] = room[base : base + _BLOCK].max()
                continue
            blocks = np.empty(0, np.int64)  # no row has room: a new one
        else:
            blocks = np.flatnonzero(block_room[: -(-opened // _BLOCK)] >= size)[:items]
        if blocks.size:
            rows = (blocks[:, None] * _BLOCK + np.arange(_BLOCK)).reshape(-1)
            rows = rows[room[rows] >= size]
            fits = room[rows] // size
            through = np.cumsum(fits)
            last = int(np.searchsorted(through, items))
            if last < rows.size:
                rows, fits = rows[: last + 1], fits[: last + 1].copy()
                fits[-1] = items - (int(through[last - 1]) if last else 0)
            placed = int(fits.sum())
            out[a : a + placed] = np.repeat(rows, fits)
            room[rows] -= fits * size
            touched = np.unique(rows // _BLOCK)
            block_room[touched] = room[(touched[:, None] * _BLOCK + np.arange(_BLOCK))].max(1)
        left = items - placed
        if left:
            per_row = capacity // size
            new_rows = -(-left // per_row)
            out[a + placed : b] = opened + np.arange(left, dtype=np.int64) // per_row
            room[opened : opened + new_rows] = capacity - per_row * size
            room[opened + new_rows - 1] = capacity - (left - (new_rows - 1) * per_row) * size
            first, opened = opened // _BLOCK, opened + new_rows
            last_block = -(-opened // _BLOCK)
            block_room[first:last_block] = (
                room[first * _BLOCK : last_block * _BLOCK].reshape(-1, _BLOCK).max(1)
            )
    return out
