"""Splits loaded from the catalog, each packed once into read-only shared memory.

Opening a session asks the catalog for the current snapshot of each split it serves (one
index-only aggregate each; a mix's sources are splits like any other) and reuses the packed
arrays while that snapshot is unchanged, so a job whose ranks open sessions together, a
loader re-opened every epoch, or two mixes sharing a source, read the rows once. Idle
splits stay cached (a few of them) until the shm budget needs their room. A segment holds
``SplitArrays.columns()``; workers map it (``workers/context.py``).
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from batchd_server import metrics
from batchd_server.catalog.reader import current_snapshot, load_split
from batchd_server.catalog.types import DatasetRef, Snapshot, SplitArrays
from batchd_server.errors import ResourceExhausted
from batchd_server.shm import Segment, ShmRegistry
from batchd_server.shm.arrays import pack_arrays

if TYPE_CHECKING:
    from batchd_server.catalog.db import Engine

__all__ = ["CatalogCache", "CatalogEntry"]

logger = logging.getLogger(__name__)

_MAX_IDLE = 4
_LOAD_POLL_S = 1.0


@dataclass(eq=False)
class CatalogEntry:
    """One split at one snapshot: its arrays, their segment, and the sessions holding it."""

    key: tuple[int, str, str]
    arrays: SplitArrays
    segment: Segment
    refs: int = 0


class CatalogCache:
    """Split arrays in shared memory, shared by every session on the same snapshot."""

    def __init__(self, engine: Engine, registry: ShmRegistry) -> None:
        self._engine = engine
        self._registry = registry
        self._entries: OrderedDict[tuple[int, str, str], CatalogEntry] = OrderedDict()
        self._lock = threading.Lock()
        # One load per split and snapshot at a time (eight ranks opening together read the
        # split once); loads of different splits, and every other open, go on meanwhile: no
        # lock is held across database I/O.
        self._loading: dict[tuple[int, str, str], threading.Event] = {}

    def acquire(
        self, dataset: str, version: str | None, split: str, snapshot: str | None
    ) -> CatalogEntry:
        """The split's arrays at ``snapshot`` (None: as the catalog is now), referenced once.

        Raises:
            NotFound, SnapshotMismatch, InvalidArgument, ResourceExhausted, Unavailable.
        """
        pinned = None if snapshot is None else Snapshot.parse(snapshot)
        ref, now = current_snapshot(self._engine, dataset, split, version=version)
        wanted = pinned or now
        key = (ref.id, split, wanted.token())
        while True:
            with self._lock:
                entry = self._entries.get(key)
                if entry is not None:
                    entry.refs += 1
                    self._entries.move_to_end(key)
                    return entry
                loading = self._loading.get(key)
                if loading is None:
                    loading = self._loading[key] = threading.Event()
                    break
            # Another open loads this split: wait for it, then take its entry (or, if it
            # failed, try ourselves). Its statement timeout bounds the wait.
            while not loading.wait(_LOAD_POLL_S):
                pass
        try:
            entry = self._load(key, ref, dataset, split, wanted)
            with self._lock:
                self._entries[key] = entry
        finally:
            with self._lock:
                del self._loading[key]
            loading.set()
        self._trim()
        return entry

    def _load(
        self,
        key: tuple[int, str, str],
        ref: DatasetRef,
        dataset: str,
        split: str,
        wanted: Snapshot,
    ) -> CatalogEntry:
        started = time.monotonic()
        arrays = load_split(self._engine, dataset, split, version=ref.version, snapshot=wanted)
        metrics.CATALOG_LOAD_SECONDS.labels(dataset=ref.name).observe(time.monotonic() - started)
        purpose = f"the catalog rows of {dataset!r} split {split!r} ({len(arrays)} samples)"
        segment = self._with_room(
            lambda: pack_arrays(self._registry, arrays.columns(), purpose=purpose)
        )
        logger.info(
            "loaded %s/%s split %s: %d samples at snapshot %s in %.2f s",
            ref.name,
            ref.version,
            split,
            len(arrays),
            wanted.token(),
            time.monotonic() - started,
        )
        return CatalogEntry(key, arrays, segment, refs=1)

    def release(self, entry: CatalogEntry) -> None:
        with self._lock:
            entry.refs -= 1
            assert entry.refs >= 0, "released more often than acquired"
        self._trim()

    def create_segment(self, kind: str, nbytes: int, *, purpose: str) -> Segment:
        """``registry.create``, first evicting idle splits if the budget is the obstacle."""
        return self._with_room(lambda: self._registry.create(kind, nbytes, purpose=purpose))

    def _with_room(self, make: Callable[[], Segment]) -> Segment:
        try:
            return make()
        except ResourceExhausted:
            if not self._evict(keep=0):
                raise
            return make()

    def _trim(self) -> None:
        self._evict(keep=_MAX_IDLE)

    def _evict(self, *, keep: int) -> bool:
        with self._lock:
            idle = [e for e in self._entries.values() if e.refs == 0]
            victims = idle[: max(0, len(idle) - keep)]
            for entry in victims:
                del self._entries[entry.key]
        for entry in victims:
            self._registry.release(entry.segment)
        return bool(victims)

    def close(self) -> None:
        """Release every cached split (sessions must be closed already)."""
        with self._lock:
            entries = list(self._entries.values())
            self._entries.clear()
        for entry in entries:
            self._registry.release(entry.segment)
