"""The decode cache as a worker uses it: look a sample up, else decode it and offer it.

A worker holds one :class:`SampleCache` per session (its tiers, from the session's
:class:`DecodeCacheSpec`) and one :class:`CachedSource` per source whose pipeline has an
adapter. A lookup reads the entry's file from the first tier that has it; an entry that does
not check out (``entry.py``) counts as corrupt and is decoded and written again, which
replaces it. A new entry goes to the shared-memory tier, or to the disk tier when that one
is full (NOTE [ Entry files ] in ``shm/entries.py``).

Before a batch's bytes are fetched ahead (an object store's batched staging and whole-object
prefetch), :meth:`CachedSource.to_fetch` says which of its rows are not cached, so that a
batch of hits costs no request and a batch of misses is still fetched in a few.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

from batchd_server.catalog.types import SampleColumns
from batchd_server.decode_cache.adapters import Adapter, adapter_for
from batchd_server.decode_cache.entry import Entry, pack, unpack
from batchd_server.decode_cache.keys import Identity, identity_of
from batchd_server.pipelines.base import Block, Pipeline, SampleInfo
from batchd_server.shm.entries import EntryDir

__all__ = ["CacheCounts", "CachedSource", "DecodeCacheSpec", "SampleCache"]


@dataclass(frozen=True)
class DecodeCacheSpec:
    """A server's decode cache as tasks carry it to the workers."""

    tiers: tuple[EntryDir, ...]
    """Shared memory first, then the disk directory if there is one."""


@dataclass(frozen=True)
class CacheCounts:
    """One task's lookups, for the server's metrics."""

    hits: int = 0
    misses: int = 0
    corrupt: int = 0
    """Entries found but not whole or not right: decoded again (and counted as misses)."""
    written_bytes: int = 0
    """Bytes of the entries this task added."""


class SampleCache:
    """A worker's view of the cache's tiers, counting what each task did."""

    def __init__(self, spec: DecodeCacheSpec) -> None:
        self.tiers = spec.tiers
        self._counts = CacheCounts()

    def take_counts(self) -> CacheCounts:
        """The counts since the last call."""
        counts, self._counts = self._counts, CacheCounts()
        return counts

    def _count(self, hits: int = 0, misses: int = 0, corrupt: int = 0, written: int = 0) -> None:
        c = self._counts
        self._counts = CacheCounts(
            c.hits + hits, c.misses + misses, c.corrupt + corrupt, c.written_bytes + written
        )

    def get(self, name: str, key: bytes) -> Entry | None:
        for tier in self.tiers:
            data = tier.read(name)
            if data is None:
                continue
            entry = unpack(key, data)
            if entry is None:
                self._count(corrupt=1)
                continue
            tier.touch(name)
            return entry
        return None

    def has(self, name: str) -> bool:
        """Whether a tier holds entry ``name`` (not read, so not checked)."""
        return any(tier.has(name) for tier in self.tiers)

    def put(self, name: str, key: bytes, entry: Entry) -> None:
        parts = pack(key, *entry)
        for tier in self.tiers:
            if tier.add(name, parts):
                self._count(written=sum(len(p) for p in parts))
                return


class CachedSource:
    """One source's samples through the cache."""

    def __init__(self, cache: SampleCache, adapter: Adapter, identity: Identity) -> None:
        self.cache = cache
        self.adapter = adapter
        self.identity = identity

    @classmethod
    def of(
        cls, cache: SampleCache | None, pipeline: Pipeline, root: str, dataset: str = ""
    ) -> CachedSource | None:
        """The cached decode of a source (its ``root``, and its ``dataset`` row as the
        catalog names it), or None when its pipeline is not cached."""
        adapter = adapter_for(pipeline) if cache is not None else None
        if cache is None or adapter is None:
            return None
        return cls(cache, adapter, identity_of(root, dataset))

    def to_fetch(
        self, columns: SampleColumns, positions: npt.NDArray[np.int64]
    ) -> tuple[npt.NDArray[np.int64], bool]:
        """Which of ``positions`` a read-ahead should fetch, and whether it should leave out
        the bytes of rows whose decodes may come from the cache
        (``RowReader.read_ahead``'s ``decoded_cached``): where the identity probes (an
        object store), the rows with no entry and False; else all of them and True."""
        if not self.identity.probes or not positions.size:
            return positions, True
        recipe, key, cache = self.adapter.recipe, self.identity.key, self.cache
        raw, bounds = columns.path_bytes, columns.path_offsets
        rows: Any = zip(
            positions.tolist(),
            columns.byte_offsets[positions].tolist(),
            columns.byte_lengths[positions].tolist(),
            columns.ids[positions].tolist(),
            strict=True,
        )
        missing = np.ones(positions.size, bool)
        for i, (p, offset, length, sample_id) in enumerate(rows):
            path = raw[bounds[p] : bounds[p + 1]].tobytes().decode("utf-8", "replace")
            found = key(recipe, path, offset, length, sample_id)
            missing[i] = found is None or not cache.has(found[0])
        return positions[missing], False

    def decode(
        self,
        sample: SampleInfo,
        offset: int,
        length: int,
        read: Callable[[], memoryview],
        row: Block,
    ) -> None:
        """Write ``sample``'s row from the cache, or from ``read()``'s bytes (then cache it).

        Raises:
            BadSample: As the pipeline would for the bytes ``read()`` returns (or raises).
        """
        recipe, key, path, sample_id = (
            self.adapter.recipe,
            self.identity.key,
            sample.path,
            sample.sample_id,
        )
        found = key(recipe, path, offset, length, sample_id)
        target = found
        if found is not None:
            entry = self.cache.get(*found)
            if entry is not None:
                variant = self.adapter.variant(entry, sample)
                if variant:
                    target = key(
                        f"{recipe} {variant}", sample.path, offset, length, sample.sample_id
                    )
                    entry = self.cache.get(*target) if target is not None else None
            if entry is not None and self.adapter.load(entry, sample, row):
                self.cache._count(hits=1)
                return
            self.cache._count(misses=1)
        entry = self.adapter.decode(read(), sample, row)
        if target is not None:
            self.cache.put(*target, entry)
