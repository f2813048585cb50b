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
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

import numpy as np

from batchd_server.cache_policy.plan_blocks import Uses
from batchd_server.storage.blocks import BlockKey

__all__ = ["NEVER", "next_uses", "victims"]

NEVER = -1
"""The next use of a block no live session reads again (within the horizon)."""


def next_uses(uses: Iterable[Uses]) -> dict[BlockKey, int]:
    """Each block's first read over all ``uses``: how many batches from now."""
    soonest: dict[BlockKey, int] = {}
    for use in uses:
        if not len(use.blocks):
            continue
        keys = (use.objects.astype(np.int64) << 32) | use.blocks
        order = np.lexsort((use.when, keys))
        keys, when = keys[order], use.when[order]
        firsts = np.flatnonzero(np.r_[True, keys[1:] != keys[:-1]])
        for key, at in zip(keys[firsts].tolist(), when[firsts].tolist(), strict=True):
            block = BlockKey(use.hashes[key >> 32], key & 0xFFFFFFFF)
            known = soonest.get(block)
            if known is None or at < known:
                soonest[block] = at
    return soonest


def victims(
    cached: Mapping[BlockKey, tuple[int, float]],
    uses: Mapping[BlockKey, int],
    nbytes: int,
    *,
    farther_than: int = -1,
) -> list[BlockKey]:
    """Cached blocks to delete, in order, whose bytes add up to ``nbytes`` at least (or all
    that may go, if they add up to less).

    Args:
        cached: Every cached block: its bytes and modification time.
        uses: Each block's next use in batches from now (:func:`next_uses`); a block not in
            it is read by no live session.
        nbytes: The room wanted.
        farther_than: Only blocks not read at or before this many batches from now may go.
    """
    if nbytes <= 0:
        return []
    never = sorted(
        (mtime, key) for key, (_, mtime) in cached.items() if uses.get(key, NEVER) == NEVER
    )
    later = sorted(
        ((uses[key], key) for key in cached if uses.get(key, NEVER) > farther_than),
        reverse=True,
    )
    chosen: list[BlockKey] = []
    freed = 0
    for _, key in [*never, *later]:
        if freed >= nbytes:
            break
        chosen.append(key)
        freed += cached[key][0]
    return chosen
