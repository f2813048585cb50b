"""The decode cache's owner in the server's main process: it makes the tiers, keeps their
counts right and evicts, and removes the shared-memory tier at shutdown.

NOTE [ Admission and eviction ]
Sessions read every sample of their split once per epoch, in an order fixed by the seed: so
once an entry of a split that a live session reads was written, the plan says it will be
read again next epoch, whatever its recency. Evicting it to admit another sample of the same
splits gains nothing on a shuffled epoch and loses everything on an unshuffled one (a
sequential scan over more samples than fit makes LRU miss every time). So:

* admission: a worker adds an entry while the tier has room (``shm/entries.py``); a full
  shared-memory tier sends it to the disk tier, a full disk tier drops it. What is cached of
  a dataset larger than the cache is a stable subset, and every epoch hits on that fraction;
* eviction (:meth:`DecodeCacheOwner.sweep`, every second): when a tier is over
  :data:`HIGH_WATER` of its bound, entries of datasets that no live session reads go first,
  least recently used first, down to :data:`LOW_WATER`; from shared memory they move to the
  disk tier when there is one. Entries of live datasets are never evicted for others: once
  no session reads them any more, they are the first to go.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Final

from batchd._wire.lifetime import Closeable
from batchd_server.decode_cache.directory import claim_directory, release_directory
from batchd_server.decode_cache.keys import root_tag
from batchd_server.decode_cache.worker import DecodeCacheSpec
from batchd_server.shm.entries import EntryDir, disk_entry_dir, shm_entry_dir

__all__ = ["HIGH_WATER", "LOW_WATER", "DecodeCacheOwner"]

logger = logging.getLogger(__name__)

HIGH_WATER: Final = 0.9
LOW_WATER: Final = 0.8
_SWEEP_S: Final = 1.0
_RECOUNT_S: Final = 30.0
"""Most seconds between two full counts of a tier (each lists its directory)."""


class DecodeCacheOwner(Closeable):
    """Makes the cache's tiers and keeps them bounded; see NOTE [ Admission and eviction ].

    Args:
        shm_dir: The server's shared-memory directory.
        instance: The server's shm instance (``ShmRegistry.instance``): the shm tier's names.
        size_bytes: The shm tier's bound.
        disk_dir: The disk tier's directory, or None for none: checked and locked
            (NOTE [ One server per directory ] in ``directory.py``).
        disk_bytes: The disk tier's bound.
        live_roots: The dataset roots the live sessions read, now.
        on_evict: Called with the tier (``"shm"``, ``"disk"``) and the count of each sweep's
            evictions.
    """

    def __init__(
        self,
        *,
        shm_dir: Path,
        instance: str,
        size_bytes: int,
        disk_dir: Path | None = None,
        disk_bytes: int = 0,
        live_roots: Callable[[], Iterable[str]] = lambda: (),
        on_evict: Callable[[str, int], None] = lambda tier, n: None,
        sweep_s: float = _SWEEP_S,
    ) -> None:
        self.shm = shm_entry_dir(shm_dir, instance, size_bytes)
        self.disk = disk_entry_dir(disk_dir, disk_bytes) if disk_dir is not None else None
        self.live_roots = live_roots
        """Set once the session manager exists (it is built after the cache)."""
        self._on_evict = on_evict
        self._sweep_s = sweep_s
        self._claim = claim_directory(disk_dir) if disk_dir is not None else None
        """The disk tier's lock file, held while this owner lives."""
        try:
            self.shm.create()
            try:
                if self.disk is not None:
                    self.disk.create()
            except BaseException:
                self.shm.clear()
                raise
        except BaseException:
            self._release()
            raise
        self.spec = DecodeCacheSpec(tuple(t for t in (self.shm, self.disk) if t is not None))
        self._lock = threading.Lock()
        self._scanned: dict[str, tuple[float, frozenset[str] | None]] = {}
        """Per tier: when it was last recounted, and the live datasets when that scan evicted
        (None: it was under the high water mark)."""
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="batchd-decode-cache", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self._sweep_s):
            try:
                self.sweep()
            except OSError as e:  # a disk gone bad must not end the server
                logger.warning("decode cache sweep failed: %s", e)

    def used_bytes(self, tier: str = "shm") -> int:
        """What ``tier`` holds (from its usage file, exact after each sweep)."""
        found = self.shm if tier == "shm" else self.disk
        return found.used_bytes() if found is not None else 0

    def sweep(self) -> dict[str, int]:
        """Recount both tiers and evict from those over :data:`HIGH_WATER`.

        Returns:
            Evictions by tier.
        """
        with self._lock:
            live = frozenset(root_tag(root) for root in self.live_roots())
            evicted = {"shm": self._sweep(self.shm, self.disk, live)}
            if self.disk is not None:
                evicted["disk"] = self._sweep(self.disk, None, live)
        for tier, count in evicted.items():
            if count:
                self._on_evict(tier, count)
        return evicted

    def _sweep(self, tier: EntryDir, lower: EntryDir | None, live: frozenset[str]) -> int:
        # Listing a tier of a million entries takes a second of CPU: the usage file says
        # when to; a full recount runs every _RECOUNT_S, and an eviction scan that found
        # nothing to evict is not redone until the live datasets change or _RECOUNT_S passed.
        now = time.monotonic()
        last = self._scanned.get(tier.usage_name)
        due = last is None or now - last[0] >= _RECOUNT_S
        held = tier.recount() if due else tier.used_bytes()
        if held <= tier.limit_bytes * HIGH_WATER:
            if due:
                self._scanned[tier.usage_name] = (now, None)
            return 0
        if not due and last is not None and last[1] == live:
            return 0  # full of live datasets' entries, as at the last scan
        if not due:
            held = tier.recount()
        self._scanned[tier.usage_name] = (now, live)
        target = tier.limit_bytes * LOW_WATER
        candidates = sorted(
            (e for e in tier.entries() if e.name[:8] not in live), key=lambda e: e.used_at
        )
        evicted = 0
        for entry in candidates:
            if held <= target:
                break
            if lower is not None:
                data = tier.read(entry.name)
                if data is not None:
                    lower.add(entry.name, (data,))
            if tier.remove(entry.name, entry.size):
                held -= entry.size
                evicted += 1
        return evicted

    def _release(self) -> None:
        claim, self._claim = self._claim, None
        if claim is not None:
            release_directory(claim)

    def close(self) -> None:
        """Stop sweeping, remove the shared-memory tier (the disk tier stays) and give the
        disk tier's directory up; idempotent."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        with self._lock:
            try:
                self.shm.clear()
            finally:
                self._release()
