"""What one object-store read may cost, and what it may mix, against a real SeaweedFS
(``tests/s3server.py``): the budget ahead holds while sizes are unknown, a worker process
has one pool of fetch threads, coalesced gaps are capped, an object rewritten in place is
never served as two versions' bytes, and a zero-length sample is an empty payload."""

from __future__ import annotations

import json
import logging
import os
import threading
from collections.abc import Iterator, Sequence
from pathlib import Path

import numpy as np
import obstore
import pytest
from s3server import FaultyProxy, ThrowawayS3, store_env, throwaway_s3
from sqlalchemy.engine import Engine

from batchd_server.catalog.ingest import ingest_manifest
from batchd_server.catalog.object_roots import ObjectListing, object_shards
from batchd_server.errors import DataError, FailedPrecondition
from batchd_server.pipelines.base import BadSample
from batchd_server.storage import clouds
from batchd_server.storage.base import TooLarge
from batchd_server.storage.fetch_pool import FETCH_THREADS, AheadBudget
from batchd_server.storage.objects import ObjectFiles
from batchd_server.storage.options import StoreOptions
from batchd_server.storage.ranges import Ranges, plan_reads
from batchd_server.storage.roots import STORE_STATUS, check_object_root
from batchd_server.storage.s3 import S3Fetcher, split_url

pytestmark = pytest.mark.slow(seconds=30)

BUCKET = "bounds"
ROOT = f"s3://{BUCKET}/root"
MIB = 1 << 20


@pytest.fixture(scope="module")
def s3() -> Iterator[ThrowawayS3]:
    with throwaway_s3() as server:
        server.create_bucket(BUCKET)
        store = server.store(BUCKET)
        obstore.put(store, "root/empty.bin", b"")
        obstore.put(store, "root/small.bin", b"small")
        obstore.put(store, "root/shard.bin", bytes(range(256)) * (32 * 1024))  # 8 MiB
        with store_env(server):
            yield server


class Unsized:
    """A whole-object fetcher of 20 objects of 1 MiB whose sizes nobody knows beforehand.
    It counts, for the fetches run on other threads (a reader's fetches ahead), the bytes
    each may bring (its ``max_bytes``) while it runs, plus those brought and not read yet:
    what fetching ahead holds at once."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.holding = 0
        self.peak = 0
        self.asked: list[int] = []

    def _hold(self, count: int) -> None:
        with self.lock:
            self.holding += count
            self.peak = max(self.peak, self.holding)

    def fetch(self, url: str, ranges: Sequence[tuple[int, int]]) -> list[bytes]:
        raise AssertionError("whole objects only")

    def fetch_whole(self, url: str, max_bytes: int) -> bytes:
        ahead = threading.current_thread() is not threading.main_thread()
        if ahead:
            self.asked.append(max_bytes)
            self._hold(max_bytes)
        try:
            if max_bytes < MIB:
                raise TooLarge(url, MIB)
            data = url.encode()[-1:] * MIB
        finally:
            if ahead:
                self._hold(-max_bytes)
        if ahead:
            self._hold(len(data))
        return data

    def read(self, count: int) -> None:
        with self.lock:
            self.holding = max(self.holding - count, 0)


def test_fetching_ahead_holds_its_budget_while_sizes_are_unknown() -> None:
    """20 objects of unknown size (1 MiB each) fetched ahead under a 4 MiB budget: never
    more than 4 MiB may come or wait at once (a fetch ahead asks for at most what it
    reserved), every object still reads right, and the budget is whole again at the end."""
    fetcher = Unsized()
    budget = AheadBudget(4 * MIB)
    files = ObjectFiles(ROOT, fetcher, lambda url: MIB, max_sample_bytes=64 * MIB, ahead=budget)
    paths = [f"{i % 10}/{i}.jpg" for i in range(20)]
    files.prefetch(paths)
    assert files.ahead_bytes <= budget.limit
    for path in paths:
        data = files.read(path)
        assert bytes(data) == path.encode()[-1:] * MIB
        fetcher.read(len(data))
        files.prefetch(paths[paths.index(path) + 1 :])  # as a worker does batch by batch
    files.close()
    assert max(fetcher.asked) <= budget.limit, "a fetch ahead could bring max_sample_bytes"
    assert fetcher.peak <= budget.limit
    assert budget.used == 0


def test_the_readers_of_a_process_share_one_pool_of_fetch_threads(s3: ThrowawayS3) -> None:
    """100 readers (sessions) each fetching a batch over two objects: the process never has
    more than FETCH_THREADS fetch threads."""
    readers = [ObjectFiles(ROOT, S3Fetcher(), S3Fetcher().size, max_sample_bytes=MIB)
               for _ in range(100)]  # fmt: skip
    batch = Ranges(
        ["shard.bin", "small.bin"],
        np.array([0, 0, 1], np.intp),
        np.array([0, 4096, 0], np.int64),
        np.array([16, 16, 5], np.int64),
    )
    for reader in readers:
        data, starts = reader.read_ranges(batch)
        assert bytes(data[starts[1] : starts[1] + 16]) == bytes(range(16))
    fetch_threads = [t for t in threading.enumerate() if t.name.startswith("batchd-fetch")]
    for reader in readers:
        reader.close()
    assert 0 < len(fetch_threads) <= FETCH_THREADS


def test_coalesced_gaps_add_up_to_at_most_the_bytes_asked() -> None:
    """64 records of 4 KiB, 512 KiB apart: without a cap every gap (under 1 MiB) is fetched
    (32 MiB for 256 KiB asked); with it, the smallest gaps are bridged up to the bound."""
    offsets = np.arange(64, dtype=np.int64) * (512 << 10)
    offsets[1::2] += 1000  # gaps of two widths: the narrower ones are bridged first
    lengths = np.full(64, 4096, np.int64)
    free = plan_reads(offsets, lengths, MIB)
    assert len(free.run_offsets) == 1 and free.total_bytes > 30 * MIB
    capped = plan_reads(offsets, lengths, MIB, max_extra_bytes=MIB)
    asked = int(lengths.sum())
    assert capped.total_bytes - asked <= MIB
    assert len(capped.run_offsets) < 64, "some gaps are still bridged"
    for i in range(64):  # every record is still where its start says
        run = np.searchsorted(capped.run_starts, capped.starts[i], side="right") - 1
        assert capped.run_offsets[run] + capped.starts[i] - capped.run_starts[run] == offsets[i]


def test_a_reader_without_the_cache_fetches_no_more_than_twice_what_it_asked(
    s3: ThrowawayS3,
) -> None:
    """Through a proxy that counts the bytes the store sends: 8 ranges of 4 KiB, 900 KiB
    apart in one object, cost at most the bound on gaps plus what was asked (the client
    merging ranges under 1 MiB apart on its own would fetch about 6 MiB)."""
    proxy = FaultyProxy(s3.ports["s3"])
    try:
        with store_env(s3):
            os.environ["AWS_ENDPOINT_URL"] = proxy.endpoint
            files = ObjectFiles(ROOT, S3Fetcher(), S3Fetcher().size, max_sample_bytes=MIB)
            offsets = np.arange(8, dtype=np.int64) * (900 << 10)
            ranges = Ranges(["shard.bin"], np.zeros(8, np.intp), offsets,
                            np.full(8, 4096, np.int64))  # fmt: skip
            data, starts = files.read_ranges(ranges)
            assert bytes(data[starts[3] : starts[3] + 4]) == bytes(
                (int(offsets[3]) + k) % 256 for k in range(4)
            )
            files.close()
    finally:
        proxy.close()
    assert proxy.body_bytes <= 8 * 4096 + (4 << 20)


def test_an_object_rewritten_in_place_is_never_served_mixed(
    s3: ThrowawayS3, caplog: pytest.LogCaptureFixture
) -> None:
    """A reader reads two ranges of an object, the object is rewritten, the reader reads two
    more: they come whole from the new version (not one range of each), with a warning; a
    streamed range (the node cache's) asks for the version first read and fails
    ``unreadable``, saying the object changed, rather than caching the new bytes as the
    old's."""
    store = s3.store(BUCKET)
    obstore.put(store, "root/v.bin", b"A" * 8192)
    fetcher = S3Fetcher(retry_s=1)
    url = f"{ROOT}/v.bin"
    first = fetcher.fetch(url, [(0, 4), (4096, 4)])
    assert [bytes(b) for b in first] == [b"AAAA", b"AAAA"]
    obstore.put(store, "root/v.bin", b"B" * 8192)
    with caplog.at_level(logging.WARNING, "batchd_server.storage.s3_gets"):
        again = fetcher.fetch(url, [(0, 4), (4096, 4)])
    assert [bytes(b) for b in again] == [b"BBBB", b"BBBB"]
    assert "changed in place" in caplog.text
    streamer = S3Fetcher(retry_s=1)
    assert bytes(streamer.fetch(url, [(0, 2)])[0]) == b"BB"
    obstore.put(store, "root/v.bin", b"C" * 8192)
    with pytest.raises(BadSample, match="changed in place") as caught:
        b"".join(streamer.stream(url, 0, 8192))
    assert caught.value.kind == "unreadable"


def test_a_zero_length_sample_is_an_empty_payload_not_a_transient_failure(
    s3: ThrowawayS3,
) -> None:
    """An empty object (whole, or as a 0-byte range) and a 0-byte range of a full one read
    as b"" alone and inside a batch, without the node cache."""
    files = ObjectFiles(ROOT, S3Fetcher(retry_s=1), S3Fetcher().size, max_sample_bytes=MIB)
    assert bytes(files.read("empty.bin")) == b""
    assert bytes(files.read("empty.bin", 0, 0)) == b""
    assert bytes(files.read("shard.bin", 100, 0)) == b""
    batch = Ranges(["empty.bin", "shard.bin"], np.array([0, 1, 1], np.intp),
                   np.array([0, 0, 7], np.int64), np.array([0, 3, 0], np.int64))  # fmt: skip
    data, starts = files.read_ranges(batch)
    assert bytes(data[starts[1] : starts[1] + 3]) == bytes([0, 1, 2])
    files.stage(batch)
    assert bytes(files.read("empty.bin", 0, 0)) == b""
    files.close()


@pytest.mark.parametrize(
    "bucket", ["ab", "Data", "a_b", "-ab", "ab-", "a..b", "192.168.1.1", "x" * 64]
)
def test_an_invalid_bucket_name_is_a_clear_error_before_any_request(bucket: str) -> None:
    with pytest.raises(ValueError, match="is not a valid bucket name"):
        split_url(f"s3://{bucket}/prefix")
    assert split_url("s3://my-data.v2/a/b") == ("my-data.v2", "a/b")


def test_a_plain_http_endpoint_is_warned_about_once_per_process(
    s3: ThrowawayS3, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two stores made on an http:// endpoint: one warning, naming it (the server's log is
    the operator's, so the endpoint may be there)."""
    monkeypatch.setattr(clouds, "_warned_http", set())
    with caplog.at_level(logging.WARNING, "batchd_server.storage.clouds"):
        for retry_s in (7.5, 7.25):
            clouds.store_of(f"s3://{BUCKET}/x", retry_s=retry_s)
    warned = [r.getMessage() for r in caplog.records if "plain HTTP" in r.getMessage()]
    assert len(warned) == 1 and s3.endpoint in warned[0]


def test_a_roots_listing_at_session_open_is_trusted_for_a_few_seconds(s3: ThrowawayS3) -> None:
    """Ten opens of one root within the setting cost one listing; with it 0, ten."""
    proxy = FaultyProxy(s3.ports["s3"])
    try:
        with store_env(s3):
            os.environ["AWS_ENDPOINT_URL"] = proxy.endpoint
            for list_cache_s, listings in ((60.0, 1), (0.0, 10)):
                STORE_STATUS.forget()
                before = proxy.requests
                for _ in range(10):
                    check_object_root("d", ROOT, StoreOptions(retry_s=1, list_cache_s=list_cache_s))
                assert proxy.requests - before == listings
    finally:
        STORE_STATUS.forget()
        proxy.close()


@pytest.mark.parametrize("path", ["a//b.bin", "./a.bin", "a/./b.bin", "a/", "../x.bin", "/a.bin"])
def test_one_path_rule_at_ingest_and_at_read(
    path: str, sqlite_engine: Engine, tmp_path: Path
) -> None:
    """What a reader of a store refuses as ``unsafe_path``, ingest refuses too, naming the
    row (a path such as ``a//b`` named another key than ``a/b``, and was only found out at
    read time, as a bad sample per epoch)."""
    fetcher = S3Fetcher()
    with pytest.raises(BadSample) as caught:
        ObjectFiles(ROOT, fetcher, fetcher.size, max_sample_bytes=MIB).read(path, 0, 4)
    assert caught.value.kind == "unsafe_path"
    manifest = tmp_path / "m.jsonl"
    manifest.write_text(json.dumps({"path": path, "split": "train"}) + "\n")
    with pytest.raises(DataError, match="line 1: path="):
        ingest_manifest(sqlite_engine, dataset="p", root=ROOT, manifest=manifest, verify=False)


def test_a_shard_url_that_leaves_the_root_is_refused(s3: ThrowawayS3) -> None:
    listing = ObjectListing(ROOT)
    with pytest.raises(DataError, match=r"'\.\.' component"):
        object_shards(listing, [f"{ROOT}/../other/x.tar"])


def test_a_failed_listing_refuses_only_that_open_without_the_node_cache(s3: ThrowawayS3) -> None:
    """Without the node cache a store that does not answer refuses the open, and the next
    open after it answers again lists anew (the failure is not trusted for the setting's
    seconds); with the cache the open goes ahead, and the store is reported down."""
    options = StoreOptions(retry_s=0.2, list_cache_s=60.0)
    STORE_STATUS.forget()
    try:
        with store_env(s3):
            os.environ["AWS_ENDPOINT_URL"] = "http://127.0.0.1:9"  # nothing listens there
            with pytest.raises(FailedPrecondition, match=f"cannot reach {ROOT}") as refused:
                check_object_root("d", ROOT, options)
            assert "127.0.0.1" not in str(refused.value)
            check_object_root("d", ROOT, StoreOptions(retry_s=0.2, cache_dir="/nonexistent"))
            assert STORE_STATUS.down().keys() == {ROOT}
            assert "did not answer" in STORE_STATUS.notes()[0]
        with store_env(s3):
            check_object_root("d", ROOT, options)
        assert STORE_STATUS.down() == {}
    finally:
        STORE_STATUS.forget()
