"""Whole-object reads (one image per object): one GET and no HEAD, the size bound checked
from the GET's answer, and a cached small object read back whole and checked, against a
real SeaweedFS (``tests/s3server.py``) and the node cache on a temp dir."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import obstore
import pytest
from s3server import ThrowawayS3, store_env, throwaway_s3

from batchd_server.pipelines.base import BadSample
from batchd_server.storage.blocks import (
    DIGEST_BYTES,
    HEADER_BYTES,
    BlockKey,
    BlockStore,
    object_hash,
)
from batchd_server.storage.cache import CacheStats, CachingFetcher
from batchd_server.storage.objects import ObjectFiles
from batchd_server.storage.s3 import S3Fetcher

pytestmark = pytest.mark.slow(seconds=20)

BUCKET = "whole"
ROOT = f"s3://{BUCKET}/imgs"
BLOB = bytes(range(256)) * 300  # 75 KiB: five 16 KiB chunks, one block


@pytest.fixture(scope="module")
def s3() -> Iterator[ThrowawayS3]:
    with throwaway_s3() as server:
        server.create_bucket(BUCKET)
        store = server.store(BUCKET)
        for i in range(4):
            obstore.put(store, f"imgs/{i}.jpg", BLOB[i:] + BLOB[:i])
        with store_env(server):
            yield server


class NoHead(S3Fetcher):
    """The store's fetcher, counting the HEADs it is asked for."""

    def __init__(self) -> None:
        super().__init__(retry_s=2.0)
        self.heads = 0

    def size(self, url: str) -> int:
        self.heads += 1
        return super().size(url)

    def head(self, url: str) -> tuple[int, str | None]:  # what the node cache asks
        self.heads += 1
        return super().head(url)


def _cached(inner: S3Fetcher, cache: Path) -> CachingFetcher:
    return CachingFetcher(inner, BlockStore(cache, capacity_bytes=1 << 30), stats=CacheStats())


def test_a_whole_object_costs_one_get_and_no_head(s3: ThrowawayS3, tmp_path: Path) -> None:
    """Read, and fetched ahead, straight from the store and through the node cache."""
    inner = NoHead()
    for fetcher in (inner, _cached(inner, tmp_path / "cache")):
        files = ObjectFiles(ROOT, fetcher, inner.size, max_sample_bytes=1 << 20)
        assert bytes(files.read("0.jpg")) == BLOB
        files.prefetch(["1.jpg", "2.jpg"])
        assert bytes(files.read("1.jpg")) == BLOB[1:] + BLOB[:1]
        assert bytes(files.read("2.jpg", 0, -1)) == BLOB[2:] + BLOB[:2]
        files.close()
    assert inner.heads == 0


@pytest.mark.parametrize("through_cache", [False, True], ids=["store", "cache"])
def test_an_object_over_the_bound_is_too_large_without_a_head(
    s3: ThrowawayS3, tmp_path: Path, through_cache: bool
) -> None:
    """The size comes from the GET's answer; the bound is enforced on read and prefetch."""
    inner = NoHead()
    fetcher = _cached(inner, tmp_path / "cache") if through_cache else inner
    files = ObjectFiles(ROOT, fetcher, inner.size, max_sample_bytes=len(BLOB) - 1)
    with pytest.raises(BadSample) as raised:
        files.read("3.jpg")
    assert raised.value.kind == "too_large"
    assert "--max-sample-bytes" in str(raised.value)
    files.prefetch(["0.jpg"])
    with pytest.raises(BadSample, match="--max-sample-bytes"):
        files.read("0.jpg")
    assert inner.heads == 0
    if through_cache:  # nothing over the bound was kept
        assert isinstance(fetcher, CachingFetcher)
        assert fetcher.store.blocks() == {}


def test_a_cached_object_is_read_without_the_store_and_a_bad_one_is_fetched_again(
    s3: ThrowawayS3, tmp_path: Path
) -> None:
    """A second fetcher (another worker) reads the cached object from disk; a flipped byte
    in its block is caught, the file replaced and the answer right."""
    url = f"{ROOT}/1.jpg"
    want = BLOB[1:] + BLOB[:1]
    first = _cached(NoHead(), tmp_path / "cache")
    assert first.fetch_whole(url, 1 << 20) == want
    assert first.stats.take().misses == 1
    second = _cached(NoHead(), tmp_path / "cache")
    assert second.has_whole(url)
    assert second.fetch_whole(url, 1 << 20) == want
    counts = second.stats.take()
    assert (counts.hits, counts.misses, counts.fetched_bytes) == (1, 0, 0)
    path = second.store.path(BlockKey(object_hash(url), 0))
    raw = bytearray(path.read_bytes())
    raw[HEADER_BYTES + DIGEST_BYTES * 5 + 40_000] ^= 0xFF  # in the content's third chunk
    path.write_bytes(bytes(raw))
    assert second.fetch_whole(url, 1 << 20) == want
    counts = second.stats.take()
    assert (counts.corrupt, counts.misses) == (1, 1)
    assert path.read_bytes()[-len(want) :] == want
    assert not _cached(NoHead(), tmp_path / "other").has_whole(url)
