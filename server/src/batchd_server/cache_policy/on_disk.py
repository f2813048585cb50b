"""What the cache manager knows of the node cache's files (NOTE [ Cache manager ] in
``manager.py``): each block directory's listing, kept as arrays and listed again a few
directories a round, so that making room costs array work, not a listing of every file."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Final

import numpy as np
import numpy.typing as npt

from batchd_server.cache_policy.eviction import CachedBlocks
from batchd_server.cache_policy.plan_blocks import hashes64
from batchd_server.storage.blocks import BlockKey, BlockStore
from batchd_server.storage.cache_dir import SLOTS

__all__ = ["DiskView"]

_ORPHAN_AGE_S: Final = 60.0
"""A record without a block is deleted once older than this (a younger one may be a
reader's whose blocks are being written)."""


@dataclass
class _Directory:
    """One block directory's files, as arrays."""

    blocks: CachedBlocks
    objects: npt.NDArray[np.uint64]
    """Each block's object (``hashes64``)."""
    records: list[str]
    """The objects with a record (their hashes)."""
    record_objects: npt.NDArray[np.uint64]
    record_mtimes: npt.NDArray[np.float64]


def _directory(store: BlockStore, slot: int) -> _Directory:
    found = store.directory(slot)
    cached = {BlockKey(h, i): v for (h, i), v in found.blocks.items()}
    blocks = CachedBlocks.of(cached)
    records = list(found.records)
    return _Directory(
        blocks,
        hashes64([k.object for k in blocks.keys]),
        records,
        hashes64(records),
        np.fromiter(found.records.values(), np.float64, len(records)),
    )


class DiskView:
    """The cache's files as last listed, directory by directory."""

    def __init__(self, store: BlockStore) -> None:
        self._store = store
        self._dirs: list[_Directory | None] = [None] * SLOTS
        self._next = 0

    def refresh(self, files: int) -> None:
        """List directories again, in turn, until about ``files`` files were listed (at
        least one directory, at most all), and delete the records there that have had no
        block for a while."""
        listed = 0
        for _ in range(SLOTS):
            d = self._dirs[self._next] = self._sweep(self._next, _ORPHAN_AGE_S)
            self._next = (self._next + 1) % SLOTS
            listed += len(d.blocks.keys) + len(d.records) + 1
            if listed >= files:
                break

    def _sweep(self, slot: int, age_s: float) -> _Directory:
        """List directory ``slot`` and delete the records older than ``age_s`` of objects
        with no block there."""
        d = _directory(self._store, slot)
        if not d.records:
            return d
        orphan = ~np.isin(d.record_objects, d.objects)
        orphan &= d.record_mtimes <= time.time() - age_s
        if orphan.any():
            for i in np.flatnonzero(orphan).tolist():
                self._store.delete_record(d.records[i])
            left = ~orphan
            d.records = [h for h, kept in zip(d.records, left.tolist(), strict=True) if kept]
            d.record_objects, d.record_mtimes = d.record_objects[left], d.record_mtimes[left]
        return d

    def cached(self) -> CachedBlocks:
        """Every cached block of the directories listed so far."""
        parts = [d.blocks for d in self._dirs if d is not None]
        if not parts:
            return CachedBlocks.of({})
        return CachedBlocks(
            [k for p in parts for k in p.keys],
            np.concatenate([p.ids for p in parts]),
            np.concatenate([p.sizes for p in parts]),
            np.concatenate([p.mtimes for p in parts]),
        )

    def delete(self, cached: CachedBlocks, chosen: list[int]) -> int:
        """Delete the blocks ``chosen`` (indexes into ``cached``), then the records of the
        objects they leave with no block (their directories listed again to see); blocks
        deleted."""
        slots: set[int] = set()
        deleted = 0
        for i in chosen:
            key = cached.keys[i]
            if self._store.delete(key, reason="evicted"):
                deleted += 1
                slots.add(int(key.object[:2], 16))
        for slot in slots:
            self._dirs[slot] = self._sweep(slot, 0.0)
        return deleted
