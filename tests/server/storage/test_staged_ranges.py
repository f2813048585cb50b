"""A batch's byte ranges inside objects (tar members) staged together: one request per
object for the whole batch, every sample's bytes served from it, against a real SeaweedFS
(``tests/s3server.py``)."""

from __future__ import annotations

import threading
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import obstore
import pytest
from s3server import ThrowawayS3, store_env, throwaway_s3

from batchd_server.pipelines.base import BadSample
from batchd_server.storage.blocks import BlockStore
from batchd_server.storage.cache import CacheStats, CachingFetcher
from batchd_server.storage.objects import ObjectFiles
from batchd_server.storage.ranges import Ranges
from batchd_server.storage.s3 import S3Fetcher

pytestmark = pytest.mark.slow(seconds=20)

BUCKET = "staged"
ROOT = f"s3://{BUCKET}/shards"
SHARDS = {f"s{i}.tar": np.random.default_rng(i).bytes(300_000) for i in range(2)}


@pytest.fixture(scope="module")
def s3() -> Iterator[ThrowawayS3]:
    with throwaway_s3() as server:
        server.create_bucket(BUCKET)
        store = server.store(BUCKET)
        for name, data in SHARDS.items():
            obstore.put(store, f"shards/{name}", data)
        with store_env(server):
            yield server


class Counting(S3Fetcher):
    """The store's fetcher, keeping the ranges of every request."""

    def __init__(self) -> None:
        super().__init__(retry_s=2.0)
        self.calls: list[tuple[str, list[tuple[int, int]]]] = []

    def fetch(self, url: str, ranges: Any) -> list[bytes | memoryview]:
        self.calls.append((url, [(int(o), int(n)) for o, n in ranges]))
        return super().fetch(url, ranges)

    def stream(self, url: str, offset: int, length: int) -> Iterator[memoryview]:
        self.calls.append((url, [(offset, length)]))
        yield from super().stream(url, offset, length)

    def stream_version(
        self, url: str, offset: int, length: int, version: str | None
    ) -> Iterator[memoryview]:
        self.calls.append((url, [(offset, length)]))  # the node cache's misses come here
        yield from super().stream_version(url, offset, length, version)


def _batch() -> tuple[list[str], Any, Any, Any]:
    paths = sorted(SHARDS)
    # Overlapping ranges share a run (the fourth inside the first), and an empty one is in
    # the batch (the last), so every sample's place in its run is exercised.
    files = np.array([0, 1, 0, 0, 1, 0, 1], np.intp)
    offsets = np.array([1000, 5000, 200_000, 1500, 100, 50_000, 7000], np.int64)
    lengths = np.array([2000, 3000, 1000, 1000, 4000, 10_000, 0], np.int64)
    return paths, files, offsets, lengths


def _expected(paths: Sequence[str], files: Any, offsets: Any, lengths: Any) -> list[bytes]:
    return [
        SHARDS[paths[f]][o : o + n]
        for f, o, n in zip(files.tolist(), offsets.tolist(), lengths.tolist(), strict=True)
    ]


@pytest.mark.parametrize("through_cache", [False, True])
def test_a_staged_batch_is_one_request_per_object_and_serves_every_sample(
    s3: ThrowawayS3, tmp_path: Path, through_cache: bool
) -> None:
    inner = Counting()
    fetcher: Any = inner
    if through_cache:
        store = BlockStore(tmp_path / "cache", capacity_bytes=1 << 30)
        fetcher = CachingFetcher(inner, store, stats=CacheStats())
    files = ObjectFiles(ROOT, fetcher, inner.size, max_sample_bytes=1 << 20)
    paths, which, offsets, lengths = _batch()
    files.begin_batch()
    files.stage(Ranges(paths, which, offsets, lengths))
    assert sorted(url for url, _ in inner.calls) == [f"{ROOT}/{p}" for p in paths]
    before = len(inner.calls)
    got = [
        bytes(files.read(paths[f], o, n))
        for f, o, n in zip(which.tolist(), offsets.tolist(), lengths.tolist(), strict=True)
    ]
    assert got == _expected(paths, which, offsets, lengths)
    assert len(inner.calls) == before  # every sample came from the staged bytes
    files.begin_batch()  # the next batch: staged bytes are gone, a read asks again
    assert bytes(files.read(paths[0], 1000, 2000)) == SHARDS[paths[0]][1000:3000]
    assert len(inner.calls) == before + (0 if through_cache else 1)
    files.close()


def test_a_stage_that_fails_leaves_each_sample_to_report_itself(s3: ThrowawayS3) -> None:
    inner = Counting()
    files = ObjectFiles(ROOT, inner, inner.size, max_sample_bytes=1 << 20)
    paths = ["s0.tar", "nope.tar"]
    which = np.array([0, 1], np.intp)
    files.begin_batch()
    files.stage(Ranges(paths, which, np.array([10, 10], np.int64), np.array([5, 5], np.int64)))
    files.begin_batch()  # a batch starts again after a store's failure
    assert bytes(files.read("s0.tar", 10, 5)) == SHARDS["s0.tar"][10:15]
    with pytest.raises(BadSample) as missing:
        files.read("nope.tar", 10, 5)
    assert missing.value.kind == "missing"
    assert "nope.tar" in str(missing.value)
    files.close()


def test_objects_on_the_nodes_disk_are_read_in_the_readers_thread(
    s3: ThrowawayS3, tmp_path: Path
) -> None:
    """A batch over two objects, one already in the node cache: the cached one is read in
    the reader's own thread (a handoff to a fetch thread costs more than the read), the other
    is fetched by a fetch thread; both serve the right bytes."""
    inner = Counting()
    store = BlockStore(tmp_path / "cache", capacity_bytes=1 << 30)
    fetcher = CachingFetcher(inner, store, stats=CacheStats())
    threads: dict[str, str] = {}
    real = fetcher.fetch

    def fetch(url: str, ranges: Any) -> list[bytes | memoryview]:
        threads[url] = threading.current_thread().name
        return real(url, ranges)

    fetcher.fetch = fetch  # type: ignore[method-assign]
    files = ObjectFiles(ROOT, fetcher, inner.size, max_sample_bytes=1 << 20)
    paths, which, offsets, lengths = _batch()
    files.read(paths[0], 0, 10)  # s0.tar's one block is on the disk now
    threads.clear()
    data, starts = files.read_ranges(Ranges(paths, which, offsets, lengths))
    got = [bytes(data[a : a + n]) for a, n in zip(starts.tolist(), lengths.tolist(), strict=True)]
    assert got == _expected(paths, which, offsets, lengths)
    assert threads[f"{ROOT}/{paths[0]}"] == threading.current_thread().name
    assert threads[f"{ROOT}/{paths[1]}"].startswith("batchd-fetch")
    files.close()


def test_a_batch_staged_from_the_nodes_disk_is_views_of_its_reads_not_a_copy(
    s3: ThrowawayS3, tmp_path: Path
) -> None:
    """Warm, a staged batch asks the store nothing, and each sample is a view of the bytes
    read from its block's file (no second copy of the batch into one buffer)."""
    inner = Counting()
    store = BlockStore(tmp_path / "cache", capacity_bytes=1 << 30)
    files = ObjectFiles(
        ROOT, CachingFetcher(inner, store, stats=CacheStats()), inner.size, max_sample_bytes=1 << 20
    )
    paths, which, offsets, lengths = _batch()
    files.begin_batch()
    files.stage(Ranges(paths, which, offsets, lengths))
    before = len(inner.calls)
    files.begin_batch()
    files.stage(Ranges(paths, which, offsets, lengths))
    assert len(inner.calls) == before
    views = [
        files.read(paths[f], o, n)
        for f, o, n in zip(which.tolist(), offsets.tolist(), lengths.tolist(), strict=True)
    ]
    assert [bytes(v) for v in views] == _expected(paths, which, offsets, lengths)
    assert len(inner.calls) == before
    assert all(isinstance(v.obj, bytes) for v in views if len(v))
    files.close()
