"""The node cache evicts by the live sessions' plans (Belady's rule) and prefetches ahead of
each stream's cursor, within the cache's size."""

from __future__ import annotations

import math
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from batchd_server.cache_policy.eviction import NEVER, CachedBlocks, next_uses, victims
from batchd_server.cache_policy.manager import CacheManager, Reading, SourceRef
from batchd_server.cache_policy.plan_blocks import SourceBlocks, Uses, hashes64, upcoming_uses
from batchd_server.catalog.types import SampleColumns
from batchd_server.errors import FailedPrecondition
from batchd_server.metrics import node_cache as cache_metrics
from batchd_server.planning.sampling import EpochPlan
from batchd_server.storage.blocks import (
    DIGEST_BYTES,
    HEADER_BYTES,
    RECORD_BYTES,
    BlockKey,
    BlockStore,
    object_hash,
)
from batchd_server.storage.cache import CacheStats, CachingFetcher
from tests.cache_support import ROOT_URL, StatDirFetcher

BLOCK = 1024
RECORD = 256
"""Four records a block."""


def key(i: int) -> BlockKey:
    return BlockKey(f"{i:040x}", 0)


def chosen(
    cached: dict[BlockKey, tuple[int, float]],
    uses: dict[BlockKey, int],
    nbytes: int,
    farther_than: int = -1,
) -> list[BlockKey]:
    """:func:`victims` over dictionaries, by key."""
    blocks = CachedBlocks.of(cached)
    when = np.array([uses.get(k, NEVER) for k in blocks.keys], np.int64)
    return [blocks.keys[i] for i in victims(blocks, when, nbytes, farther_than=farther_than)]


def test_victims_are_the_unread_first_then_the_farthest_read() -> None:
    """Blocks no session reads go first (oldest first), then the one read farthest; a block
    read within the prefetch window never goes."""
    cached = {key(i): (100, float(10 - i)) for i in range(6)}
    uses = {key(0): 5, key(1): 1, key(3): 9, key(4): 3}  # 2 and 5 are never read again
    assert chosen(cached, uses, 250) == [key(5), key(2), key(3)]
    assert chosen(cached, uses, 10_000, farther_than=4) == [key(5), key(2), key(3), key(0)]
    assert chosen(cached, uses, 0) == []


def uses_of(hashes: list[str], objects: list[int], blocks: list[int], when: list[int]) -> Uses:
    return Uses(
        hashes,
        hashes64(hashes),
        np.array(objects, np.int32),
        np.array(blocks, np.int64),
        np.array(when, np.int64),
    )


def test_next_uses_are_the_first_read_of_each_block_over_all_sessions() -> None:
    h = ["a" * 40]
    a = uses_of(h, [0] * 4, [3, 1, 3, 2], [0, 1, 2, 5])
    b = uses_of(h, [0] * 2, [2, 7], [1, 4])
    late = uses_of(h, [0] * 2, [1, 3], [9, 0])  # out of order: the least still counts
    cached = CachedBlocks.of({BlockKey("a" * 40, i): (1, 0.0) for i in (1, 2, 3, 7, 9)})
    assert next_uses([a, b, late], cached).tolist() == [1, 1, 0, 4, NEVER]


def textbook_opt_misses(reads: list[int], capacity: int) -> int:
    """Belady's OPT, straight from its definition."""
    cache: set[int] = set()
    misses = 0
    for t, block in enumerate(reads):
        if block in cache:
            continue
        misses += 1
        if len(cache) >= capacity:

            def next_read(b: int, t: int = t) -> float:
                later = [u for u in range(t + 1, len(reads)) if reads[u] == b]
                return later[0] if later else math.inf

            cache.remove(max(sorted(cache), key=next_read))
        cache.add(block)
    return misses


def lru_misses(reads: list[int], capacity: int) -> int:
    cache: list[int] = []
    misses = 0
    for block in reads:
        if block in cache:
            cache.remove(block)
        else:
            misses += 1
            if len(cache) >= capacity:
                cache.pop(0)
        cache.append(block)
    return misses


@settings(max_examples=60, deadline=None)
@given(
    reads=st.lists(st.integers(0, 11), min_size=1, max_size=60),
    capacity=st.integers(1, 6),
)
def test_evicting_by_the_plan_misses_as_few_as_belady_optimum(
    reads: list[int], capacity: int
) -> None:
    """Replaying a plan's reads through a cache that evicts with next_uses/victims misses
    exactly as often as Belady's optimum, and never more than LRU."""
    hashes = [f"{i:040x}" for i in range(12)]
    cached: dict[BlockKey, tuple[int, float]] = {}
    misses = 0
    for t, block in enumerate(reads):
        k = BlockKey(hashes[block], 0)
        if k in cached:
            continue
        misses += 1
        if len(cached) >= capacity:
            rest = reads[t + 1 :]
            blocks = CachedBlocks.of(cached)
            use = uses_of(hashes, rest, [0] * len(rest), list(range(1, len(rest) + 1)))
            (victim,) = victims(blocks, next_uses([use], blocks), 1)
            del cached[blocks.keys[victim]]
        cached[k] = (1, float(t))
    assert misses == textbook_opt_misses(reads, capacity)
    assert misses <= lru_misses(reads, capacity)


# -- the manager, over real files, a real plan and real block files ---------------------


@pytest.fixture
def shards(tmp_path: Path) -> Path:
    root = tmp_path / "objects"
    root.mkdir()
    rng = np.random.default_rng(3)
    for i in range(3):
        (root / f"s{i}.bin").write_bytes(rng.bytes(8 * BLOCK))
    return root


def columns_of(names: list[str], records: int) -> SampleColumns:
    """``records`` records of RECORD bytes in each file, in file order."""
    paths = [n.encode() for n in names for _ in range(records)]
    n = len(paths)
    ends = np.cumsum([len(p) for p in paths])
    return SampleColumns(
        ids=np.arange(n, dtype=np.int64),
        labels=np.zeros(n, np.int64),
        lengths=np.zeros(n, np.int32),
        byte_offsets=np.tile(np.arange(records, dtype=np.int64) * RECORD, len(names)),
        byte_lengths=np.full(n, RECORD, np.int64),
        path_bytes=np.frombuffer(b"".join(paths), np.uint8),
        path_offsets=np.concatenate([[0], ends]).astype(np.int64),
        row_groups=np.full(n, -1, np.int32),
        row_indexes=np.full(n, -1, np.int32),
    )


def blocks_of(plan: EpochPlan, columns: SampleColumns, ks: range) -> set[BlockKey]:
    source = SourceBlocks.of(columns, ROOT_URL, BLOCK, lambda _: -1)
    rows = np.concatenate([plan.batch(k) for k in ks])
    uses = upcoming_uses(source, rows, np.zeros(len(rows), np.int64))
    return {
        BlockKey(uses.hashes[o], b)
        for o, b in zip(uses.objects.tolist(), uses.blocks.tolist(), strict=True)
    }


@pytest.fixture
def reading(shards: Path) -> Reading:
    columns = columns_of([f"s{i}.bin" for i in range(3)], 32)
    positions = np.random.default_rng(1).permutation(len(columns.ids)).astype(np.int64)
    plan = EpochPlan(positions, 8, len(positions) // 8)
    source = SourceRef("catalog-1", 0, columns, ROOT_URL)
    return Reading("cached", plan, 2, 4, 1, (source,), lambda: None)


def make_manager(
    shards: Path, cache: Path, capacity: int, readings: list[Reading], prefetch: int
) -> Iterator[CacheManager]:
    store = BlockStore(cache, capacity_bytes=capacity, block_bytes=BLOCK)
    fetcher = CachingFetcher(StatDirFetcher(shards), store, stats=CacheStats())
    manager = CacheManager(fetcher, lambda: readings, prefetch_batches=prefetch, threads=2)
    try:
        yield manager
    finally:
        manager.close()


def test_the_manager_prefetches_the_batches_ahead_of_the_cursor(
    shards: Path, tmp_path: Path, reading: Reading
) -> None:
    """A few rounds (each starts at most 2 x threads requests) fetch exactly the blocks of
    batches 4 and 5 (ahead = 4, window 2), and the prefetch lead counts from the cursor the
    batches wholly cached."""
    for manager in make_manager(shards, tmp_path / "c", 1 << 30, [reading], prefetch=2):
        rounds(manager, 3)
        cached = set(manager.store.blocks())
        assert cached == blocks_of(reading.plan, reading.sources[0].columns, range(4, 6))
        # Batches 2 and 3 are the workers' (being read): caching them completes the lead.
        for k in (2, 3):
            for url, ranges in _ranges(reading, k):
                manager.fetcher.fetch(url, ranges)
        rounds(manager, 1)
        lead = cache_metrics.CACHE_PREFETCH_LEAD.labels(dataset="cached")._value.get()
        assert lead == 4


def rounds(manager: CacheManager, n: int) -> None:
    for _ in range(n):
        manager.tick()
        manager.drain()


def _ranges(reading: Reading, k: int) -> list[tuple[str, list[tuple[int, int]]]]:
    source = SourceBlocks.of(reading.sources[0].columns, ROOT_URL, BLOCK, lambda _: -1)
    rows = reading.plan.batch(k)
    out = []
    for obj in np.unique(source.objects[rows]).tolist():
        mine = rows[source.objects[rows] == obj]
        offsets, lengths = source.offsets[mine].tolist(), source.lengths[mine].tolist()
        out.append((source.urls[obj], list(zip(offsets, lengths, strict=True))))
    return out


def test_a_full_cache_gives_up_unread_blocks_then_the_farthest_never_the_window(
    shards: Path, tmp_path: Path, reading: Reading
) -> None:
    """A full cache (2 blocks of an object no plan reads, the 2 blocks the plan reads last and
    2 it reads soon after the window) makes room for the window's blocks by deleting the
    unread ones, then the one read last: exactly what Belady's rule gives up."""
    columns = reading.sources[0].columns
    window = blocks_of(reading.plan, columns, range(4, 6))
    first_read: dict[BlockKey, int] = {}
    for k in range(reading.cursor, reading.plan.num_batches):
        for b in blocks_of(reading.plan, columns, range(k, k + 1)):
            first_read.setdefault(b, k)
    late = sorted((b for b in first_read if b not in window), key=first_read.__getitem__)
    soon, last = late[:2], late[-2:]
    assert first_read[soon[1]] < first_read[last[0]] < first_read[last[1]]
    per_block = HEADER_BYTES + DIGEST_BYTES + BLOCK  # one chunk a block: one digest
    records = 4 * RECORD_BYTES  # each object's record of its size
    capacity = (len(window) + 4) * per_block + records
    urls = {object_hash(u): u for u in (f"{ROOT_URL}/s{i}.bin" for i in range(3))}
    for manager in make_manager(shards, tmp_path / "c", capacity, [reading], prefetch=2):
        fetcher = manager.fetcher
        unread = f"{ROOT_URL}/unread.bin"
        (shards / "unread.bin").write_bytes(bytes(4 * BLOCK))
        fetcher.fetch(unread, [(0, 2 * BLOCK)])
        for b in [*last, *soon]:
            fetcher.fetch(urls[b.object], [(b.index * BLOCK, BLOCK)])
        objects = {object_hash(unread)} | {b.object for b in [*last, *soon]}
        assert manager.store.used_bytes() == 6 * per_block + RECORD_BYTES * len(objects)
        rounds(manager, 3)
        # Room for the window's two missing blocks and the margin: the two unread blocks
        # go, then the farthest read, as many as the margin asks.
        farthest = -(-(2 * per_block + capacity // 20) // per_block) - 2
        assert 1 <= farthest <= 2
        kept = [last[0], soon[1], soon[0]][farthest - 1 :]
        assert set(manager.store.blocks()) == window | set(kept)
        assert manager.evicted == 2 + farthest
        # The unread object's record went with its last block; the others' stay.
        blocks, kept_records = manager.store.listing()
        assert object_hash(unread) not in kept_records
        assert set(kept_records) == {b.object for b in blocks}
        assert manager.store.used_bytes() <= capacity


def test_a_second_server_on_the_same_cache_directory_is_refused(
    shards: Path, tmp_path: Path
) -> None:
    """Two managers would evict by different plans: the second is refused, saying why, and
    the directory is free again once the first closes."""
    for _ in make_manager(shards, tmp_path / "c", 1 << 20, [], prefetch=1):
        with pytest.raises(FailedPrecondition, match="another batchd-server uses the cache"):
            for _ in make_manager(shards, tmp_path / "c", 1 << 20, [], prefetch=1):
                pass
    for manager in make_manager(shards, tmp_path / "c", 1 << 20, [], prefetch=1):
        assert manager.store.used_bytes() == 0


def test_whole_objects_of_unknown_size_are_prefetched_whole(shards: Path, tmp_path: Path) -> None:
    """Rows that are whole objects (an image folder) never seen before, from a client that
    cannot read an object whole in one request: the prefetch asks the store for each one's
    size and caches all its blocks."""
    whole = _whole_columns(columns_of([f"s{i}.bin" for i in range(3)], 1))
    plan = EpochPlan(np.array([2, 0, 1], np.int64), 1, 3)
    reading = Reading("whole", plan, 0, 0, 1, (SourceRef("w", 0, whole, ROOT_URL),), lambda: None)
    for manager in make_manager(shards, tmp_path / "c", 1 << 30, [reading], prefetch=3):
        rounds(manager, 1)
        assert len(manager.store.blocks()) == 3 * 8, "every block of the three objects"
        assert manager.fetcher.known_size(f"{ROOT_URL}/s0.bin") == 8 * BLOCK


class WholeDirFetcher(StatDirFetcher):
    """A StatDirFetcher that also reads a whole object in one request (as S3's GET)."""

    def __init__(self, root: Path) -> None:
        super().__init__(root)
        self.wholes: list[str] = []

    def fetch_whole(self, url: str, max_bytes: int) -> bytes:
        data = self._path(url).read_bytes()
        self.wholes.append(url)
        return data


def test_a_prefetched_whole_object_costs_one_request_and_no_size_request(
    shards: Path, tmp_path: Path
) -> None:
    """Where the client reads a whole object in one GET, the prefetch of an image of unknown
    size asks nothing else of the store (no HEAD first): one request per object, every
    block cached, and a second round asks for nothing."""
    whole = _whole_columns(columns_of([f"s{i}.bin" for i in range(3)], 1))
    plan = EpochPlan(np.array([2, 0, 1], np.int64), 1, 3)
    reading = Reading("whole", plan, 0, 0, 1, (SourceRef("w", 0, whole, ROOT_URL),), lambda: None)
    inner = WholeDirFetcher(shards)
    store = BlockStore(tmp_path / "c", capacity_bytes=1 << 30, block_bytes=BLOCK)
    fetcher = CachingFetcher(inner, store, stats=CacheStats())
    manager = CacheManager(fetcher, lambda: [reading], prefetch_batches=3, threads=2)
    try:
        rounds(manager, 2)
        assert sorted(inner.wholes) == [f"{ROOT_URL}/s{i}.bin" for i in range(3)]
        assert inner.stats == 0, "no size was asked of the store"
        assert inner.requests == []
        assert len(manager.store.blocks()) == 3 * 8
    finally:
        manager.close()


def _whole_columns(columns: SampleColumns) -> SampleColumns:
    """``columns`` with every row a whole object of unknown size (an image folder's rows)."""
    n = len(columns.ids)
    return SampleColumns(
        ids=columns.ids,
        labels=columns.labels,
        lengths=columns.lengths,
        byte_offsets=np.full(n, -1, np.int64),
        byte_lengths=np.full(n, -1, np.int64),
        path_bytes=columns.path_bytes,
        path_offsets=columns.path_offsets,
        row_groups=columns.row_groups,
        row_indexes=columns.row_indexes,
    )


def test_local_sources_are_left_to_the_page_cache(shards: Path, tmp_path: Path) -> None:
    """A session on a local directory (or a mix's local source) is neither prefetched nor
    counted: only object-store roots go through the cache."""
    columns = columns_of(["s0.bin"], 8)
    plan = EpochPlan(np.arange(8, dtype=np.int64), 2, 4)
    local = Reading(
        "local", plan, 0, 0, 1, (SourceRef("l", 0, columns, str(shards)),), lambda: None
    )
    for manager in make_manager(shards, tmp_path / "c", 1 << 30, [local], prefetch=4):
        asked: list[str] = []

        def prefetch(url: str, ranges: object, asked: list[str] = asked) -> int:
            asked.append(url)
            return 0

        manager.fetcher.prefetch = prefetch  # type: ignore[method-assign]
        rounds(manager, 1)
        assert asked == []
        assert manager.store.blocks() == {}


def test_a_cache_too_small_for_the_window_prefetches_only_what_fits(
    shards: Path, tmp_path: Path, reading: Reading
) -> None:
    """Room for two blocks and a window of more, none of them evictable: the prefetch stops
    at two blocks and asks the store for nothing more, round after round."""
    per_block = HEADER_BYTES + DIGEST_BYTES + BLOCK
    for manager in make_manager(shards, tmp_path / "c", 2 * per_block, [reading], prefetch=2):
        inner = manager.fetcher.inner
        assert isinstance(inner, StatDirFetcher)
        rounds(manager, 4)
        asked = {
            (url, offset // BLOCK)
            for url, ranges in inner.requests
            for offset, length in ranges
            for _ in range(max(1, length // BLOCK))
        }
        assert len(manager.store.blocks()) <= 2
        assert len(inner.requests) <= 2 and len(asked) <= 2
