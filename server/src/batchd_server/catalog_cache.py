"""Splits loaded from the catalog, each packed once into read-only shared memory.

Opening a session asks the catalog for the current snapshot of each split it serves (one
index-only aggregate each; a mix's sources are splits like any other) and reuses the packed
arrays while that snapshot is unchanged, so a job whose ranks open sessions together, a
loader re-opened every epoch, or two mixes sharing a source, read the rows once. Idle
splits stay cached (a few of them) until the shm budget needs their room. A segment holds
``SplitArrays.columns()``; workers map it (``workers/context.py``).

An entry is keyed by the rows it holds: the snapshot they actually pin (NOTE [ One entry per
row set ]). Its segment counts against the server's shm budget and no client's quota: one
segment serves every session on those rows, whoever opened them, and a client cannot make
more of them than the distinct row sets its sessions (at most ``--client-max-sessions``)
pin; idle ones are evicted first when the budget needs room.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Final

from batchd_server.catalog.members import load_members
from batchd_server.catalog.reader import current_snapshot, load_split
from batchd_server.catalog.types import DatasetRef, Snapshot, SplitArrays
from batchd_server.errors import ResourceExhausted
from batchd_server.metrics.delivery import record_catalog_load
from batchd_server.shm import Segment, ShmRegistry
from batchd_server.shm.arrays import pack_arrays

if TYPE_CHECKING:
    from batchd_server.catalog.db import Engine

__all__ = ["CatalogCache", "CatalogEntry"]

logger = logging.getLogger(__name__)

_MAX_IDLE = 4
_MAX_ALIASES = 256
"""Tokens remembered as naming the rows of another entry (NOTE [ One entry per row set ])."""
_LOAD_POLL_S = 1.0

_Key = tuple[int, str, str]
"""(dataset id, split, the canonical snapshot token of the rows); the split's name ends in
``_MEMBERS`` for the entry with its tar members' ranges."""
_MEMBERS: Final = "\x00members"

# NOTE [ One entry per row set ]
# A snapshot token s1.N.C pins the C verified rows of the split with id <= N. Ids are global
# over the catalog, so a split's ids have gaps, and s1.N.C and s1.N'.C pin the same rows when
# the split has no verified id in (N, N']. Keyed by the token as given, each equivalent token
# would load the split again into a segment of its own (a client could fill the budget with
# copies). So an entry is keyed by its canonical token, that of the rows' last id: a pin of
# the rows the catalog has now (same count, N at or past their last id) is the current
# snapshot before any load; any other pin is loaded, its canonical key looked up before a
# segment is made, and the token remembered as an alias of that key.


@dataclass(eq=False)
class CatalogEntry:
    """One split at one snapshot: its arrays, their segment, and the sessions holding it."""

    key: _Key
    arrays: SplitArrays
    segment: Segment
    refs: int = 0


class CatalogCache:
    """Split arrays in shared memory, shared by every session on the same rows."""

    def __init__(self, engine: Engine, registry: ShmRegistry) -> None:
        self._engine = engine
        self._registry = registry
        self._entries: OrderedDict[_Key, CatalogEntry] = OrderedDict()
        self._aliases: OrderedDict[_Key, _Key] = OrderedDict()
        """A pinned token's key -> the canonical key of its rows, when they differ."""
        self._lock = threading.Lock()
        # One load per split and snapshot at a time (eight ranks opening together read the
        # split once); loads of different splits, and every other open, go on meanwhile: no
        # lock is held across database I/O.
        self._loading: dict[_Key, threading.Event] = {}

    def acquire(
        self,
        dataset: str,
        version: str | None,
        split: str,
        snapshot: str | None,
        *,
        members: bool = False,
    ) -> CatalogEntry:
        """The split's arrays at ``snapshot`` (None: as the catalog is now), referenced once;
        ``members``: with every tar member's range where the dataset records them (for a
        session of several fields: ``catalog/members.py``), an entry of its own, so that a
        session of one field never loads them.

        Raises:
            NotFound, SnapshotMismatch, InvalidArgument, ResourceExhausted, Unavailable.
        """
        pinned = None if snapshot is None else Snapshot.parse(snapshot)
        ref, now = current_snapshot(self._engine, dataset, split, version=version)
        wanted = now if pinned is None or _same_rows(pinned, now) else pinned
        key = (ref.id, split + _MEMBERS if members and ref.members else split, wanted.token())
        while True:
            with self._lock:
                key = self._aliases.get(key, key)
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
        finally:
            with self._lock:
                del self._loading[key]
            loading.set()
        self._trim()
        return entry

    def _load(
        self,
        key: _Key,
        ref: DatasetRef,
        dataset: str,
        split: str,
        wanted: Snapshot,
    ) -> CatalogEntry:
        """Load the rows ``wanted`` pins into an entry under their canonical key (or take
        the entry already there), referenced once."""
        started = time.monotonic()
        arrays = load_split(self._engine, dataset, split, version=ref.version, snapshot=wanted)
        record_catalog_load(ref.name, time.monotonic() - started)
        pins = _pinned_by(arrays)
        canonical = (ref.id, key[1], pins.token())
        if canonical != key:
            arrays = dataclasses.replace(arrays, snapshot=pins)
            with self._lock:
                self._remember_alias(key, canonical)
                entry = self._take(canonical)
            if entry is not None:
                return entry
        purpose = f"the catalog rows of {dataset!r} split {split!r} ({len(arrays)} samples)"
        columns = arrays.columns()
        if key[1].endswith(_MEMBERS):  # every tar member's range, for a session of fields
            columns.update(load_members(self._engine, arrays))
        segment = self._with_room(lambda: pack_arrays(self._registry, columns, purpose=purpose))
        with self._lock:
            entry = self._take(canonical)  # another token of the same rows, loaded meanwhile
            if entry is None:
                entry = self._entries[canonical] = CatalogEntry(canonical, arrays, segment, 1)
        if entry.segment is not segment:
            self._registry.release(segment)
            return entry
        logger.info(
            "loaded %s/%s split %s: %d samples at snapshot %s in %.2f s",
            ref.name,
            ref.version,
            split,
            len(arrays),
            pins.token(),
            time.monotonic() - started,
        )
        return entry

    def _take(self, key: _Key) -> CatalogEntry | None:
        """The entry under ``key``, referenced once more, or None (caller holds the lock)."""
        entry = self._entries.get(key)
        if entry is not None:
            entry.refs += 1
            self._entries.move_to_end(key)
        return entry

    def _remember_alias(self, key: _Key, canonical: _Key) -> None:
        """``key`` names the rows of ``canonical`` from now on (caller holds the lock)."""
        self._aliases[key] = canonical
        self._aliases.move_to_end(key)
        while len(self._aliases) > _MAX_ALIASES:
            self._aliases.popitem(last=False)

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


def _same_rows(pinned: Snapshot, now: Snapshot) -> bool:
    """Whether ``pinned`` pins the rows the split has ``now``: as many, and every one of them
    (rows are immutable and ids only grow, so its id bound is at or past their last id)."""
    return pinned.row_count == now.row_count and pinned.max_sample_id >= now.max_sample_id


def _pinned_by(arrays: SplitArrays) -> Snapshot:
    """The canonical snapshot of ``arrays``' rows: their last id and their count."""
    last_id = int(arrays.ids[-1]) if len(arrays) else 0
    return Snapshot(max_sample_id=last_id, row_count=len(arrays))
