"""An object rewritten in place under the same key, read through the node cache: never a mix
of two versions' bytes. The cache holds one version per object (the one its record names),
fills every missing block with that version (``If-Match``) whichever process fills it, and
when the store says the object changed it drops the object's blocks and reads what was asked
whole from the new version, with a warning. Against a real SeaweedFS
(``tests/s3server.py``) and real node caches on a temp dir; "two processes" are two block
stores on one directory with fetchers of their own (each its own ledger descriptor and its
own idea of the object's version), as a worker and the cache manager's prefetch are.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import obstore
import pytest
from s3server import ThrowawayS3, store_env, throwaway_s3

from batchd_server.cache_policy.plan_blocks import SourceBlocks
from batchd_server.catalog.types import SampleColumns
from batchd_server.pipelines.base import BadSample
from batchd_server.storage.blocks import RECORD_BYTES, BlockKey, BlockStore, object_hash
from batchd_server.storage.cache import CacheStats, CachingFetcher, object_url
from batchd_server.storage.s3 import S3Fetcher
from tests.cache_support import BLOCK, small_store

pytestmark = pytest.mark.slow(seconds=20)

BUCKET = "versions"
OLD = np.random.default_rng(1).bytes(4 * BLOCK)
NEW = np.random.default_rng(2).bytes(4 * BLOCK)


@pytest.fixture(scope="module")
def s3() -> Iterator[ThrowawayS3]:
    with throwaway_s3() as server:
        server.create_bucket(BUCKET)
        with store_env(server):
            yield server


@pytest.fixture
def url(s3: ThrowawayS3, request: pytest.FixtureRequest) -> str:
    """A fresh object of :data:`OLD` bytes, one per test."""
    key = f"objs/{request.node.name}.bin"
    obstore.put(s3.store(BUCKET), key, OLD)
    return f"s3://{BUCKET}/{key}"


def rewrite(s3: ThrowawayS3, url: str, data: bytes) -> None:
    """Write ``data`` over the object, in place, under the same key."""
    obstore.put(s3.store(BUCKET), url.removeprefix(f"s3://{BUCKET}/"), data)


def caching(store: BlockStore, inner: S3Fetcher | None = None) -> CachingFetcher:
    """A process's fetcher through the node cache: its own store client and versions."""
    return CachingFetcher(inner or S3Fetcher(retry_s=2.0), store, stats=CacheStats())


def ledger_is_exact(store: BlockStore) -> None:
    """The ledger is what the files take: a recount from the disk changes nothing."""
    before = store.used_bytes()
    store.scan()
    assert store.used_bytes() == before, "the ledger drifted from the files"


def cached_blocks(store: BlockStore, url: str) -> list[int]:
    h = object_hash(url)
    return sorted(k.index for k in store.blocks() if k.object == h)


def test_a_read_across_cached_and_missing_blocks_of_a_rewritten_object_is_all_new(
    s3: ThrowawayS3, url: str, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    store = small_store(tmp_path / "cache")
    fetcher = caching(store)
    assert bytes(fetcher.fetch(url, [(0, 2 * BLOCK)])[0]) == OLD[: 2 * BLOCK]
    assert cached_blocks(store, url) == [0, 1]
    rewrite(s3, url, NEW)
    with caplog.at_level(logging.WARNING):
        got = bytes(fetcher.fetch(url, [(BLOCK, 2 * BLOCK)])[0])  # block 1 cached, 2 not
    assert got == NEW[BLOCK : 3 * BLOCK], "a sample mixed two versions, or kept the old one"
    assert "changed in place" in caplog.text
    # The old version's blocks are gone; what is cached now is the new version's.
    assert bytes(fetcher.fetch(url, [(0, 4 * BLOCK)])[0]) == NEW
    assert store.meta(url) is not None and store.meta(url).version is not None  # type: ignore[union-attr]
    ledger_is_exact(store)
    store.close()


def test_a_process_that_first_saw_the_new_version_does_not_mix_it_with_cached_old_blocks(
    s3: ThrowawayS3, url: str, tmp_path: Path
) -> None:
    """The cache manager's prefetch cached block 0 of the old version; the object is
    rewritten; a worker that has never read it (its first GET would see the new version)
    reads blocks 0 and 1: all of one version, the new one. The prefetch, which still knows
    the old version, then reads the new one too."""
    prefetch_store = small_store(tmp_path / "cache")
    worker_store = small_store(tmp_path / "cache")
    prefetch, worker = caching(prefetch_store), caching(worker_store)
    assert prefetch.prefetch(url, [(0, BLOCK)]) == 1
    rewrite(s3, url, NEW)
    assert bytes(worker.fetch(url, [(0, 2 * BLOCK)])[0]) == NEW[: 2 * BLOCK]
    assert bytes(prefetch.fetch(url, [(0, 3 * BLOCK)])[0]) == NEW[: 3 * BLOCK]
    prefetch.prefetch(url, [(0, 4 * BLOCK)])
    assert bytes(worker.fetch(url, [(0, 4 * BLOCK)])[0]) == NEW
    ledger_is_exact(worker_store)
    prefetch_store.close()
    worker_store.close()


def test_a_block_of_another_version_is_never_served(tmp_path: Path) -> None:
    """A block written as one version (a fill that raced a rewrite) is a miss to a reader of
    another, whatever process wrote it, and a fill of the reader's version replaces it."""
    from batchd_server.storage.block_format import version_tag

    store = small_store(tmp_path / "cache")
    key = BlockKey(object_hash("s3://b/k"), 0)
    assert store.write(key, OLD[:BLOCK], version=version_tag('"v1"'))
    found = store.read(key, [(0, 10)], version_tag('"v2"'))
    assert found is not None and found.parts is None
    assert store.read_whole(key, BLOCK, version_tag('"v2"')) is None
    assert store.write(key, NEW[:BLOCK], replace=True, version=version_tag('"v2"'))
    found = store.read(key, [(0, 10)], version_tag('"v2"'))
    assert found is not None and found.parts is not None
    assert bytes(found.cut(0, 10)) == NEW[:10]
    ledger_is_exact(store)
    store.close()


class RewrittenAfterHead(S3Fetcher):
    """A store whose object is rewritten again right after the node cache asks its new
    version (between its HEAD and its GET)."""

    def __init__(self, s3: ThrowawayS3, data: bytes) -> None:
        super().__init__(retry_s=2.0)
        self.s3, self.data, self.heads = s3, data, 0

    def head(self, url: str) -> tuple[int, str | None]:
        answer = super().head(url)
        self.heads += 1
        if self.heads == 2:  # the HEAD after the first change
            rewrite(self.s3, url, self.data)
        return answer


def test_an_object_that_changes_again_while_read_anew_is_an_unreadable_sample(
    s3: ThrowawayS3, url: str, tmp_path: Path
) -> None:
    store = small_store(tmp_path / "cache")
    fetcher = caching(store, RewrittenAfterHead(s3, OLD[::-1]))
    fetcher.fetch(url, [(0, BLOCK)])
    rewrite(s3, url, NEW)
    with pytest.raises(BadSample) as failed:
        fetcher.fetch(url, [(0, 2 * BLOCK)])
    assert failed.value.kind == "unreadable"
    assert "changed while it was read" in str(failed.value)
    ledger_is_exact(store)
    # The next read (the next epoch) is of the latest version, whole.
    assert bytes(fetcher.fetch(url, [(0, 4 * BLOCK)])[0]) == OLD[::-1]
    ledger_is_exact(store)
    store.close()


def test_the_cache_plans_the_urls_the_reader_reads() -> None:
    """The cache manager's plan names objects by the reader's one path rule
    (``storage/paths.py``): a path the reader refuses is refused here too, and planned
    nothing, not fetched under another name."""
    assert object_url("s3://b/p/", "a/b.tar") == "s3://b/p/a/b.tar"
    with pytest.raises(BadSample) as refused:
        object_url("s3://b/p", "/a/b.tar")
    assert refused.value.kind == "unsafe_path"
    paths = [b"/abs.tar", b"ok.tar"]
    ends = np.cumsum([len(p) for p in paths])
    columns = SampleColumns(
        ids=np.arange(2, dtype=np.int64),
        labels=np.zeros(2, np.int64),
        lengths=np.zeros(2, np.int32),
        byte_offsets=np.zeros(2, np.int64),
        byte_lengths=np.full(2, 10, np.int64),
        path_bytes=np.frombuffer(b"".join(paths), np.uint8),
        path_offsets=np.concatenate([[0], ends]).astype(np.int64),
        row_groups=np.full(2, -1, np.int32),
        row_indexes=np.full(2, -1, np.int32),
    )
    source = SourceBlocks.of(columns, "s3://b/p", BLOCK)
    assert "s3://b/p/ok.tar" in source.urls
    assert "s3://b/p/abs.tar" not in source.urls
    assert source.last[0] < source.first[0], "a refused path was planned"
    assert source.last[1] >= source.first[1]


def test_a_record_without_a_version_is_asked_again(
    s3: ThrowawayS3, url: str, tmp_path: Path
) -> None:
    """An earlier batchd's record (size only) pins no version: it reads as no record, so the
    object's size and version are asked of the store and recorded anew."""
    store = small_store(tmp_path / "cache")
    h = object_hash(url)
    record = tmp_path / "cache" / "blocks" / h[:2] / f"{h}.json"
    record.write_text(json.dumps({"url": url, "size": len(OLD)}))
    assert store.meta(url) is None
    fetcher = caching(store)
    assert bytes(fetcher.fetch(url, [(0, BLOCK)])[0]) == OLD[:BLOCK]
    meta = store.meta(url)
    assert meta is not None and meta.version is not None
    store.close()


def test_blocks_the_cache_has_no_room_for_are_of_the_cached_version_too(
    s3: ThrowawayS3, url: str, tmp_path: Path
) -> None:
    """A cache with room for one block (and the record): the blocks it cannot keep are
    fetched as spans (not streamed into files), of the recorded version too."""
    probe = small_store(tmp_path / "probe")
    store = small_store(tmp_path / "cache", capacity=RECORD_BYTES + probe.file_bytes(BLOCK) + 100)
    probe.close()
    fetcher = caching(store)
    assert bytes(fetcher.fetch(url, [(0, 10)])[0]) == OLD[:10]
    assert cached_blocks(store, url) == [0]
    rewrite(s3, url, NEW)
    assert bytes(fetcher.fetch(url, [(5, 3 * BLOCK)])[0]) == NEW[5 : 5 + 3 * BLOCK]
    assert fetcher.stats.take().unkept > 0, "no block went the unkept way"
    ledger_is_exact(store)
    store.close()
