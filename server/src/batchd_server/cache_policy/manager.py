"""The node cache's manager: a thread of the server's main process that prefetches ahead of
every live session and decides, from their plans, what leaves the cache.

NOTE [ Cache manager ]
Workers read through their own :class:`~batchd_server.storage.cache.CachingFetcher`: a hit is
a file read, a miss a request to the store whose blocks are kept if the ledger has room
(NOTE [ Cache files ]). They never delete anything but corrupt files. The manager, every
``interval_s``:

1. asks each live stream on an object store where it is (:class:`Reading`: the first batch
   not yet delivered, the first after those the workers are reading, and its plan;
   ``sessions/cache_reads.py``);
2. looks at the blocks of the next ``prefetch_batches`` batches of each from the latter on,
   and reports as the prefetch lead how many batches from the former are wholly cached;
3. when the room left is less than those missing blocks plus a margin for the workers' own
   misses (a twentieth of the capacity), lists the cached blocks, computes every block's
   next use over the rest of each session's epoch and its whole next epoch, and deletes
   blocks in Belady's order (``eviction.py``), never one read within the prefetch window;
4. hands the missing blocks to a bounded pool of threads, the nearest batches first, one
   task per object and batch (a request of one range per run of blocks), as many as the
   free space holds (a write the ledger refused would be fetched again every round).

It learns what the workers cached by looking (a ``stat`` per block of the window; the
directory listing only when it must evict), so nothing has to be told to it, and nothing is
lost when a worker dies. A restart finds the files as they were (``BlockStore.scan``), and
every ``_RESCAN_S`` the ledger is set again to what the files take (a worker killed between
its reservation and its link leaves it high).
"""

from __future__ import annotations

import fcntl
import logging
import os
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import wait as wait_futures
from dataclasses import dataclass
from pathlib import Path
from typing import Final

import numpy as np
import numpy.typing as npt

from batchd_server.cache_policy.eviction import next_uses, victims
from batchd_server.cache_policy.on_disk import DiskView
from batchd_server.cache_policy.plan_blocks import SourceBlocks, Uses, upcoming_uses
from batchd_server.catalog.types import SampleColumns
from batchd_server.errors import FailedPrecondition
from batchd_server.limits import MAX_SAMPLE_BYTES
from batchd_server.metrics import node_cache as cache_metrics
from batchd_server.metrics.registry import dataset_label
from batchd_server.pipelines.base import BadSample
from batchd_server.planning.sampling import EpochPlan
from batchd_server.storage.base import TooLarge
from batchd_server.storage.blocks import BlockKey
from batchd_server.storage.cache import CachingFetcher
from batchd_server.storage.cache_dir import open_file
from batchd_server.storage.schemes import is_local_root

__all__ = ["CacheManager", "Reading", "SourceRef"]

logger = logging.getLogger(__name__)

_USES_MAX_AGE_S: Final = 1.0
"""The next uses of every block are computed again at most this often."""
_HORIZON_SAMPLES: Final = 1 << 23
"""The samples of the sessions' future that eviction looks at, shared among them (8M: half
a second of array work); blocks read only later count as never read (no live session reads
them within the horizon)."""
_FILES_PER_ROUND: Final = 8192
"""Files listed again each round while the cache is near full, a block directory at a time:
a small cache is listed whole each round; in a large one the victims are chosen among the
directories listed so far (each a uniform sample of the blocks, by their hashes), and no
round lists them all."""
_SOURCE_ROWS_INLINE: Final = 1 << 16
"""A source of more rows is mapped to blocks beside the rounds (:meth:`CacheManager._source`)."""
_RESCAN_S: Final = 300.0
"""How often the ledger is set again to what the files take (``BlockStore.scan``)."""
_MARGIN_FRACTION: Final = 20
"""The manager keeps 1/this of the capacity free for the workers' own misses."""


@dataclass(frozen=True)
class SourceRef:
    """One source of a session as the cache sees it."""

    key: str
    """Names the source's rows for as long as they live (its catalog segment's name)."""
    start: int
    """Its first global task position."""
    columns: SampleColumns
    root: str

    @property
    def remote(self) -> bool:
        """Whether its bytes come through the cache: an object-store root (``s3://...``),
        not a local directory (which the kernel's page cache serves)."""
        return not is_local_root(self.root)


@dataclass(frozen=True)
class Reading:
    """Where one live stream is, and what it will read."""

    dataset: str
    plan: EpochPlan
    cursor: int
    """The first batch not yet delivered."""
    ahead: int
    """The first batch after those the workers are reading: prefetch starts here."""
    stride: int
    sources: tuple[SourceRef, ...]
    next_plan: Callable[[], EpochPlan | None]
    """The session's next epoch, read after this one (None: not known)."""
    next_start: int = 0
    """The first batch the stream will read of the next epoch."""
    max_sample_bytes: int = MAX_SAMPLE_BYTES
    """The most bytes one of its samples may have (``--max-sample-bytes``): a whole object
    of unknown size is prefetched only up to this (more is the worker's ``too_large``)."""


@dataclass(frozen=True)
class _Job:
    """A prefetch: the ranges of one object read by one batch, ``distance`` batches ahead."""

    distance: int
    url: str
    ranges: list[tuple[int, int]]
    blocks: frozenset[BlockKey]
    """Those of its blocks that are not cached."""
    max_bytes: int
    """A whole object's bytes at most (the session's ``max_sample_bytes``)."""


def _own(root: Path) -> int:
    """An exclusive lock on ``root`` for this server's life: two servers on one directory
    would each evict by their own sessions' plans and undo the other's prefetches.

    Raises:
        FailedPrecondition: another process holds it.
    """
    fd = open_file(root / "manager.lock", os.O_RDWR | os.O_CREAT)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        raise FailedPrecondition(
            f"another batchd-server uses the cache directory {root}; give each server its "
            "own --cache-dir (BATCHD_CACHE_DIR)"
        ) from None
    return fd


class CacheManager:
    """Prefetch and eviction for one cache directory (NOTE [ Cache manager ]).

    Holds the cache directory for the server's life (one server per directory).

    Args:
        fetcher: The main process's fetcher over the cache (prefetches go through it).
        readings: Every live stream's :class:`Reading`.
        prefetch_batches: How many batches ahead of each stream to fetch; 0: none.
        threads: Prefetch requests in flight at most.
        interval_s: How often to look.
    """

    def __init__(
        self,
        fetcher: CachingFetcher,
        readings: Callable[[], list[Reading]],
        *,
        prefetch_batches: int,
        threads: int = 4,
        interval_s: float = 0.25,
    ) -> None:
        self.fetcher = fetcher
        self.store = fetcher.store
        self._readings = readings
        self.prefetch_batches = prefetch_batches
        self._threads = threads
        self._interval_s = interval_s
        self._pool = ThreadPoolExecutor(threads, thread_name_prefix="batchd-prefetch")
        self._in_flight: dict[BlockKey, Future[int]] = {}
        """Blocks a prefetch is fetching."""
        self._sources: dict[str, SourceBlocks] = {}
        self._building: dict[str, Future[SourceBlocks]] = {}
        self._builder = ThreadPoolExecutor(1, thread_name_prefix="batchd-cache-plan")
        self._uses: list[Uses] = []
        self._disk = DiskView(self.store)
        self._uses_at = -_USES_MAX_AGE_S
        self._leads: set[str] = set()
        """The datasets whose prefetch lead is reported."""
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.evicted = 0
        """Blocks deleted to make room, since the start."""
        self._owner = _own(self.store.root)
        self.store.scan()
        self._scanned_at = time.monotonic()
        cache_metrics.CACHE_CAPACITY_BYTES.set(self.store.capacity_bytes)

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="batchd-cache", daemon=True)
        self._thread.start()

    def close(self) -> None:
        """Stop looking; prefetches under way finish. Idempotent."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(5.0)
        self._pool.shutdown(wait=True, cancel_futures=True)
        self._builder.shutdown(wait=True, cancel_futures=True)
        self.store.close()
        if self._owner >= 0:
            os.close(self._owner)  # the lock goes with the descriptor
            self._owner = -1

    def drain(self, timeout_s: float = 60.0) -> None:
        """Wait for the prefetches under way and the sources being mapped to blocks (tests;
        shutdown)."""
        wait_futures(set(self._in_flight.values()), timeout=timeout_s)
        wait_futures(set(self._building.values()), timeout=timeout_s)

    def _run(self) -> None:
        while not self._stop.wait(self._interval_s):
            try:
                self.tick()
            except Exception:  # one bad round must not end the cache's upkeep
                logger.exception("the cache manager's round failed; it tries again")

    # -- one round --------------------------------------------------------------------------

    def tick(self) -> None:
        """One round of NOTE [ Cache manager ]; the tests call it directly."""
        readings = [r for r in self._readings() if any(s.remote for s in r.sources)]
        live = {s.key for r in readings for s in r.sources}
        for key in [k for k in self._sources if k not in live]:
            del self._sources[key]
        for key in [k for k in self._building if k not in live]:
            self._building.pop(key).cancel()
        self._in_flight = {k: f for k, f in self._in_flight.items() if not f.done()}
        wanted: list[_Job] = []
        missing: set[BlockKey] = set()
        lead_by_dataset: dict[str, int] = {}
        for reading in readings:
            lead, jobs = self._window(reading, missing)
            label = dataset_label(reading.dataset)
            lead_by_dataset[label] = min(lead, lead_by_dataset.get(label, lead))
            wanted += jobs
        for label, lead in lead_by_dataset.items():
            cache_metrics.CACHE_PREFETCH_LEAD.labels(dataset=label).set(lead)
        for label in self._leads - lead_by_dataset.keys():  # no stream of it is left
            cache_metrics.CACHE_PREFETCH_LEAD.remove(label)
        self._leads = set(lead_by_dataset)
        per_block = self.store.file_bytes(self.store.block_bytes)
        self._make_room(readings, len(missing) * per_block)
        # Only what fits: a prefetch the ledger refuses would be fetched again every round.
        room = self.store.capacity_bytes - self.store.used_bytes()
        room -= per_block * len(self._in_flight)
        wanted.sort(key=lambda job: job.distance)
        running = len({id(f) for f in self._in_flight.values()})
        for job in wanted:
            if running >= 2 * self._threads:
                break
            if job.blocks <= self._in_flight.keys():
                continue
            room -= per_block * len(job.blocks - self._in_flight.keys())
            if room < 0:
                break
            future = self._pool.submit(self._prefetch, job.url, job.ranges, job.max_bytes)
            running += 1
            self._in_flight.update((key, future) for key in job.blocks)
        cache_metrics.record_cache(None, self.fetcher.stats.take())
        if time.monotonic() - self._scanned_at >= _RESCAN_S:
            self.store.scan()  # what crashed writers left reserved comes back
            self._scanned_at = time.monotonic()
        cache_metrics.CACHE_USED_BYTES.set(self.store.used_bytes())

    def _prefetch(self, url: str, ranges: list[tuple[int, int]], max_bytes: int) -> int:
        """Fetch the blocks of ``ranges``; a length of -1 is the whole object, fetched as a
        worker would (one GET, no HEAD first, where the client can), so a prefetch of an
        image costs the store one request, not two; an object of more than ``max_bytes``
        is not fetched (its worker's read of it is ``too_large``)."""
        try:
            if any(length < 0 for _, length in ranges):
                return self.fetcher.prefetch_whole(url, max_bytes)
            return self.fetcher.prefetch(url, ranges)
        except (BadSample, TooLarge) as e:  # the worker that reads it reports it
            logger.debug("prefetch of %s failed: %s", url, e)
            return 0

    def _source(self, ref: SourceRef) -> SourceBlocks | None:
        """The source's rows as blocks; None while they are being worked out. A large source
        (a million images: seconds of hashing) is worked out beside the rounds, which leave
        it out meanwhile, so that no round waits for it."""
        blocks = self._sources.get(ref.key)
        if blocks is not None:
            return blocks
        # Whole objects' sizes are not looked up (a record read per object: seconds of the
        # main process for a million images); their rows read their first block.
        if len(ref.columns.ids) <= _SOURCE_ROWS_INLINE:
            blocks = self._sources[ref.key] = SourceBlocks.of(
                ref.columns, ref.root, self.store.block_bytes
            )
            return blocks
        building = self._building.get(ref.key)
        if building is None:
            self._building[ref.key] = self._builder.submit(
                SourceBlocks.of, ref.columns, ref.root, self.store.block_bytes
            )
            return None
        if not building.done():
            return None
        del self._building[ref.key]
        blocks = self._sources[ref.key] = building.result()
        return blocks

    def _window(self, reading: Reading, missing: set[BlockKey]) -> tuple[int, list[_Job]]:
        """The stream's prefetch lead, and the prefetch jobs of its window: (distance, url,
        ranges). Adds the window's missing blocks to ``missing``."""
        plan, stride = reading.plan, max(reading.stride, 1)
        end = min(plan.num_batches, reading.ahead + self.prefetch_batches * stride)
        lead, counting = 0, True
        jobs: list[_Job] = []
        for k in range(reading.cursor, max(end, reading.cursor), stride):
            complete = True
            for source, rows in self._rows(reading, plan.batch(k)):
                # The batch's blocks in one pass; the per-object work only where some are
                # missing (a warm cache's round is a stat per block and little else).
                uses = upcoming_uses(source, rows, np.zeros(len(rows), np.int64))
                absent: dict[int, set[BlockKey]] = {}
                for obj, b in set(zip(uses.objects.tolist(), uses.blocks.tolist(), strict=True)):
                    key = BlockKey(source.hashes[obj], b)
                    if not os.path.exists(self.store.file(key)):
                        absent.setdefault(obj, set()).add(key)
                if not absent:
                    continue
                complete = False
                if k < reading.ahead:
                    continue
                distance = (k - reading.cursor) // stride
                for obj in sorted(absent):
                    missing |= absent[obj]
                    mine = rows[source.objects[rows] == obj]
                    offsets, lengths = source.offsets[mine].tolist(), source.lengths[mine].tolist()
                    ranges = list(zip(offsets, lengths, strict=True))
                    job = _Job(
                        distance,
                        source.urls[obj],
                        ranges,
                        frozenset(absent[obj]),
                        reading.max_sample_bytes,
                    )
                    jobs.append(job)
            counting = counting and complete
            lead += int(counting)
        return lead, jobs

    def _rows(
        self, reading: Reading, positions: npt.NDArray[np.int64]
    ) -> Iterator[tuple[SourceBlocks, npt.NDArray[np.int64]]]:
        """``positions`` (global over the sources) as rows of each source."""
        starts = np.array([s.start for s in reading.sources[1:]], np.int64)
        which = np.searchsorted(starts, positions, side="right")
        for index, ref in enumerate(reading.sources):
            mine = positions[which == index]
            source = self._source(ref) if len(mine) and ref.remote else None
            if source is not None:
                yield source, mine - ref.start

    # -- eviction ---------------------------------------------------------------------------

    def _make_room(self, readings: list[Reading], window_bytes: int) -> None:
        margin = self.store.capacity_bytes // _MARGIN_FRACTION
        free = self.store.capacity_bytes - self.store.used_bytes()
        want = window_bytes + margin - free
        if want <= -margin:
            return
        # Near full: the listing is kept fresh a few directories a round, so that making
        # room needs no listing of every file.
        self._disk.refresh(_FILES_PER_ROUND)
        if want <= 0:
            return
        now = time.monotonic()
        if now - self._uses_at >= _USES_MAX_AGE_S:
            horizon = _HORIZON_SAMPLES // max(len(readings), 1)
            self._uses = [use for r in readings for use in self._future(r, horizon)]
            self._uses_at = now
        cached = self._disk.cached()
        uses = next_uses(self._uses, cached)
        chosen = victims(cached, uses, want, farther_than=self.prefetch_batches)
        evicted = self._disk.delete(cached, chosen)
        self.evicted += evicted
        cache_metrics.CACHE_EVICTED.inc(evicted)

    def _future(self, reading: Reading, horizon: int) -> Iterator[Uses]:
        """The blocks the stream reads from its cursor to the end of its next epoch (within
        ``horizon`` samples), each with how many of the stream's batches from now."""
        stride = max(reading.stride, 1)
        plans = [(reading.plan, reading.cursor, 0)]
        rest = len(range(reading.cursor, reading.plan.num_batches, stride))
        following = reading.next_plan()
        if following is not None:
            plans.append((following, reading.next_start, rest))
        budget = horizon
        for plan, first, offset in plans:
            ks = np.arange(first, plan.num_batches, stride, dtype=np.int64)
            ks = ks[: max(budget // plan.batch_size, 1)]
            rows = (ks[:, None] * plan.batch_size + np.arange(plan.batch_size)).ravel()
            when = np.repeat(np.arange(len(ks), dtype=np.int64) + offset, plan.batch_size)
            inside = rows < len(plan.positions)
            positions, when = plan.positions[rows[inside]], when[inside]
            budget -= len(positions)
            starts = np.array([s.start for s in reading.sources[1:]], np.int64)
            which = np.searchsorted(starts, positions, side="right")
            for index, ref in enumerate(reading.sources):
                chosen = which == index
                source = self._source(ref) if ref.remote and chosen.any() else None
                if source is not None:
                    yield upcoming_uses(source, positions[chosen] - ref.start, when[chosen])
            if budget <= 0:
                break
