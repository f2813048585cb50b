"""What leaves the node cache first: Belady's rule over the live sessions' plans.

Belady's rule (evict the block whose next use is farthest in the future) is optimal and
usually out of reach, because the future is unknown. Not here: each session's reads are a
pure function of its plan (``plan_blocks.py``), so the next use of every cached block is
known. The order of eviction is:

1. blocks no live session will read again within the horizon, least recently written first
   (a finished job's data, an object that changed, the other half of a split);
2. then the blocks read farthest from now, counting each session's future in its own
   batches (sessions are taken to move at about the same pace).

A block is never evicted to make room for one read later than itself: the cache manager
asks only for blocks read after ``farther_than`` (what it is about to prefetch), so a full
cache of blocks all needed sooner than the prefetch simply stops the prefetch there.

Everything here is array work (numpy), never a Python step per block or per read: a block
is named by a 64-bit id (:func:`block_ids`: its object's hash mixed with its index; two
blocks that share an id by chance only share a place in the order), and the next uses are
looked up for the cached blocks only.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from batchd_server.cache_policy.plan_blocks import Uses, hashes64
from batchd_server.storage.blocks import BlockKey

__all__ = ["NEVER", "CachedBlocks", "block_ids", "next_uses", "victims"]

NEVER = -1
"""The next use of a block no live session reads again (within the horizon)."""
_MIX = np.uint64(0x9E3779B97F4A7C15)
"""Spreads a block's index over the id's bits (Fibonacci hashing)."""

U64 = npt.NDArray[np.uint64]
I64 = npt.NDArray[np.int64]


def block_ids(hashes: U64, blocks: I64) -> U64:
    """The ids of blocks ``blocks`` of the objects whose hashes (``hashes64``) are ``hashes``."""
    with np.errstate(over="ignore"):
        return np.bitwise_xor(hashes, blocks.astype(np.uint64) * _MIX)


@dataclass(frozen=True)
class CachedBlocks:
    """The cached blocks, as arrays: each one's key, id, bytes and modification time."""

    keys: Sequence[BlockKey]
    ids: U64
    sizes: I64
    mtimes: npt.NDArray[np.float64]

    @classmethod
    def of(cls, cached: Mapping[BlockKey, tuple[int, float]]) -> CachedBlocks:
        keys = list(cached)
        n = len(keys)
        objects = hashes64([k.object for k in keys])
        blocks = np.fromiter((k.index for k in keys), np.int64, n)
        sizes = np.fromiter((v[0] for v in cached.values()), np.int64, n)
        mtimes = np.fromiter((v[1] for v in cached.values()), np.float64, n)
        return cls(keys, block_ids(objects, blocks), sizes, mtimes)


class _Lookup:
    """Where each of some ids is among ``ids``: a hash table in arrays (a few gathers per
    lookup, not a binary search): each round's table holds the ids whose slot no earlier
    round's did."""

    def __init__(self, ids: U64) -> None:
        self._ids = ids
        bits = max((4 * len(ids)).bit_length(), 4)
        self._mask = np.uint64((1 << bits) - 1)
        self._tables: list[npt.NDArray[np.intp]] = []
        rest = np.arange(len(ids), dtype=np.intp)
        while len(rest):
            slots = (ids[rest] & self._mask).astype(np.intp)
            table = np.full(1 << bits, -1, np.intp)
            table[slots] = rest
            self._tables.append(table)
            rest = rest[table[slots] != rest]

    def find(self, needles: U64) -> npt.NDArray[np.intp]:
        """Each needle's index in ``ids`` (-1: not there)."""
        slots = (needles & self._mask).astype(np.intp)
        found = np.full(len(needles), -1, np.intp)
        for table in self._tables:
            candidate = table[slots]
            open_ = (found < 0) & (candidate >= 0)
            match = np.zeros(len(needles), np.bool_)
            match[open_] = self._ids[candidate[open_]] == needles[open_]
            found[match] = candidate[match]
        return found


def next_uses(uses: Iterable[Uses], cached: CachedBlocks) -> I64:
    """Each cached block's first read over all ``uses``: how many batches from now
    (:data:`NEVER`: none within them)."""
    lookup = _Lookup(cached.ids)
    none = np.iinfo(np.int64).max
    soonest = np.full(len(cached.ids), none, np.int64)
    for use in uses:
        if not len(use.blocks) or not len(soonest):
            continue
        at = lookup.find(block_ids(use.hashes64[use.objects], use.blocks))
        hit = at >= 0
        where, when = at[hit], use.when[hit]
        if len(when) > 1 and not bool(np.all(when[1:] >= when[:-1])):
            by_when = np.argsort(when, kind="stable")
            where, when = where[by_when], when[by_when]
        # Of a block's reads (in order of when), the first is assigned last: it stays.
        first = np.full(len(soonest), none, np.int64)
        first[where[::-1]] = when[::-1]
        np.minimum(soonest, first, out=soonest)
    soonest[soonest == none] = NEVER
    return soonest


def victims(cached: CachedBlocks, uses: I64, nbytes: int, *, farther_than: int = -1) -> list[int]:
    """Indexes into ``cached`` of the blocks to delete, in order, whose bytes add up to
    ``nbytes`` at least (or all that may go, if they add up to less).

    Args:
        cached: Every cached block.
        uses: Each one's next use in batches from now (:func:`next_uses`).
        nbytes: The room wanted.
        farther_than: Only blocks not read at or before this many batches from now may go.
    """
    if nbytes <= 0 or not len(uses):
        return []
    never = np.flatnonzero(uses == NEVER)
    never = never[np.lexsort((np.arange(len(never)), cached.mtimes[never]))]
    later = np.flatnonzero(uses > farther_than)
    later = later[np.argsort(-uses[later], kind="stable")]
    chosen = np.concatenate([never, later])
    freed = np.cumsum(cached.sizes[chosen])
    take = int(np.searchsorted(freed, nbytes)) + 1  # the first whose sum reaches nbytes
    return chosen[:take].tolist()
