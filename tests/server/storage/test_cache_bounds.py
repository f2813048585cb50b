"""What one read through the node cache may cost: a whole object of unknown size is read up
to ``--max-sample-bytes`` (not up to the cache's capacity), and a miss the full cache cannot
keep fetches the ranges asked, not a whole block per record."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from batchd_server.cache_policy.manager import CacheManager, Reading, SourceRef
from batchd_server.catalog.types import SampleColumns
from batchd_server.planning.sampling import EpochPlan
from batchd_server.storage.base import TooLarge
from batchd_server.storage.blocks import BlockKey, BlockStore, object_hash
from batchd_server.storage.cache import CacheStats, CachingFetcher
from tests.cache_support import BLOCK, ROOT_URL, StatDirFetcher, small_store


class BoundedWholeFetcher(StatDirFetcher):
    """Reads a whole object in one request, as S3's GET does: an object over ``max_bytes``
    is refused from its size, its body unread. Records the bound each call was given."""

    def __init__(self, root: Path) -> None:
        super().__init__(root)
        self.bounds: list[int] = []

    def fetch_whole(self, url: str, max_bytes: int) -> bytes:
        self.bounds.append(max_bytes)
        path = self._path(url)
        if path.stat().st_size > max_bytes:
            raise TooLarge(url, path.stat().st_size)
        return path.read_bytes()


class UnboundedWholeFetcher(StatDirFetcher):
    """A client that reads a whole object whatever the bound (a careless one)."""

    def fetch_whole(self, url: str, max_bytes: int) -> bytes:
        return self._path(url).read_bytes()


@pytest.fixture
def images(tmp_path: Path) -> Path:
    root = tmp_path / "objects"
    root.mkdir()
    rng = np.random.default_rng(2)
    for i in range(3):
        (root / f"i{i}.bin").write_bytes(rng.bytes(8 * BLOCK))
    return root


def whole_rows(names: list[str]) -> SampleColumns:
    """One row per object, each the whole object of unknown size (an image folder's rows)."""
    paths = [n.encode() for n in names]
    n = len(paths)
    return SampleColumns(
        ids=np.arange(n, dtype=np.int64),
        labels=np.zeros(n, np.int64),
        lengths=np.zeros(n, np.int32),
        byte_offsets=np.full(n, -1, np.int64),
        byte_lengths=np.full(n, -1, np.int64),
        path_bytes=np.frombuffer(b"".join(paths), np.uint8),
        path_offsets=np.concatenate([[0], np.cumsum([len(p) for p in paths])]).astype(np.int64),
        row_groups=np.full(n, -1, np.int32),
        row_indexes=np.full(n, -1, np.int32),
    )


def test_a_prefetched_whole_object_is_bounded_by_max_sample_bytes(
    images: Path, tmp_path: Path
) -> None:
    """The cache manager prefetches whole objects of unknown size with the session's
    ``max_sample_bytes`` as the bound, not the cache's capacity: objects over it are
    neither read into the main process's memory nor kept (their workers' reads are
    ``too_large``)."""
    columns = whole_rows([f"i{i}.bin" for i in range(3)])
    plan = EpochPlan(np.array([2, 0, 1], np.int64), 1, 3)
    source = SourceRef("w", 0, columns, ROOT_URL)
    reading = Reading("imgs", plan, 0, 0, 1, (source,), lambda: None, max_sample_bytes=2 * BLOCK)
    inner = BoundedWholeFetcher(images)
    store = BlockStore(tmp_path / "c", capacity_bytes=1 << 30, block_bytes=BLOCK)
    manager = CacheManager(
        CachingFetcher(inner, store, stats=CacheStats()),
        lambda: [reading],
        prefetch_batches=3,
        threads=2,
    )
    try:
        manager.tick()
        manager.drain()
        assert sorted(inner.bounds) == [2 * BLOCK] * 3
        assert store.blocks() == {}
    finally:
        manager.close()


def test_a_whole_read_keeps_nothing_over_its_bound_whatever_the_client(
    images: Path, tmp_path: Path
) -> None:
    fetcher = CachingFetcher(
        UnboundedWholeFetcher(images), small_store(tmp_path / "c"), stats=CacheStats()
    )
    url = f"{ROOT_URL}/i0.bin"
    with pytest.raises(TooLarge):
        fetcher.fetch_whole(url, 2 * BLOCK)
    assert fetcher.store.blocks() == {}
    assert fetcher.fetch_whole(url, 8 * BLOCK) == (images / "i0.bin").read_bytes()


def test_a_miss_the_full_cache_cannot_keep_fetches_only_what_was_asked(
    images: Path, tmp_path: Path
) -> None:
    """With no room left, a read of 40 bytes in each of two blocks asks the store for those
    80 bytes in one request (not two whole blocks), is right, keeps nothing, and is counted;
    with room again, a miss fetches and keeps its whole block."""
    inner = StatDirFetcher(images)
    store = small_store(tmp_path / "c", capacity=BLOCK)  # less than one block file
    fetcher = CachingFetcher(inner, store, stats=CacheStats())
    url = inner.url("i1.bin")
    data = (images / "i1.bin").read_bytes()
    ranges = [(BLOCK + 7, 40), (3 * BLOCK + 100, 40)]
    assert fetcher.fetch(url, ranges) == [data[o : o + n] for o, n in ranges]
    assert inner.requests == [(url, ranges)]
    counts = fetcher.stats.take()
    assert counts.unkept == 2 and counts.fetched_bytes == 80
    assert store.blocks() == {}
    store.capacity_bytes = 1 << 30
    inner.requests.clear()
    assert fetcher.fetch(url, [(BLOCK + 7, 40)]) == [data[BLOCK + 7 : BLOCK + 47]]
    assert inner.requests == [(url, [(BLOCK, BLOCK)])]
    assert set(store.blocks()) == {BlockKey(object_hash(url), 1)}


def test_an_objects_record_counts_in_the_capacity(images: Path, tmp_path: Path) -> None:
    """Each object's record of its size takes a file system block: it counts in the cache's
    size (a million images' records are 4 GiB), is refused when there is no room, and goes
    with the object (``forget``)."""
    from batchd_server.storage.blocks import RECORD_BYTES

    inner = StatDirFetcher(images)
    store = small_store(tmp_path / "c")
    fetcher = CachingFetcher(inner, store, stats=CacheStats())
    for i in range(3):
        fetcher.fetch(inner.url(f"i{i}.bin"), [(0, 10)])
    assert store.used_bytes() == 3 * (store.file_bytes(BLOCK) + RECORD_BYTES)
    assert len(store.listing()[1]) == 3
    store.forget(inner.url("i0.bin"))
    assert store.used_bytes() == 2 * (store.file_bytes(BLOCK) + RECORD_BYTES)
    store.capacity_bytes = store.used_bytes() + RECORD_BYTES - 1  # no room for a record
    fresh = CachingFetcher(inner, store, stats=CacheStats())
    assert fresh.size(inner.url("i0.bin")) == 8 * BLOCK
    assert len(store.listing()[1]) == 2, "the record did not fit: not kept"
