"""The object-store parts on their own, against a real SeaweedFS (``tests/s3server.py``):
the credential chain's additions (profiles, http endpoints), ObjectFiles' confinement,
coalescing and failure handling, and the listing that ingest verifies with."""

from __future__ import annotations

import io
import os
import re
import tarfile
from collections.abc import Iterator, Sequence
from pathlib import Path

import numpy as np
import obstore
import pytest
import sqlalchemy as sa
from s3server import FaultyProxy, ThrowawayS3, store_env, throwaway_s3
from sqlalchemy.engine import Engine

from batchd_server.catalog.ingest import ingest_tar
from batchd_server.catalog.object_roots import ObjectListing, object_shards
from batchd_server.errors import DataError
from batchd_server.pipelines.base import BadSample
from batchd_server.storage.aws import store_config
from batchd_server.storage.objects import ObjectFiles
from batchd_server.storage.ranges import Ranges
from batchd_server.storage.s3 import S3Fetcher, list_objects

pytestmark = pytest.mark.slow(seconds=30)

BUCKET = "parts"
BLOB = bytes(range(256)) * 64  # 16 KiB


@pytest.fixture(scope="module")
def s3() -> Iterator[ThrowawayS3]:
    with throwaway_s3() as server:
        server.create_bucket(BUCKET)
        store = server.store(BUCKET)
        for name in ("a.bin", "b.bin", "c.bin", "sub/d.bin"):
            obstore.put(store, f"root/{name}", BLOB)
        yield server


class Counting:
    """A RangeFetcher around another that counts its calls and ranges."""

    def __init__(self, inner: S3Fetcher) -> None:
        self.inner = inner
        self.calls: list[tuple[str, int]] = []

    def fetch(self, url: str, ranges: Sequence[tuple[int, int]]) -> list[bytes]:
        self.calls.append((url, len(ranges)))
        return self.inner.fetch(url, ranges)


def _files(fetcher: Counting, root: str = f"s3://{BUCKET}/root") -> ObjectFiles:
    return ObjectFiles(root, fetcher, fetcher.inner.size, max_sample_bytes=1 << 20)


def _write(path: Path, text: str) -> Path:
    path.write_text(text)
    return path


def test_a_profiles_keys_region_and_endpoint_apply_when_the_environment_has_no_keys(
    tmp_path: Path,
) -> None:
    """Static keys from the credentials file, region and endpoint_url from the config file;
    keys in the environment win over the profile; an http endpoint is allowed."""
    creds = _write(
        tmp_path / "credentials", "[ci]\naws_access_key_id = AK\naws_secret_access_key = SK\n"
    )
    config = _write(
        tmp_path / "config", "[profile ci]\nregion = eu-west-3\nendpoint_url = http://h:1\n"
    )
    env = {
        "AWS_PROFILE": "ci",
        "AWS_SHARED_CREDENTIALS_FILE": str(creds),
        "AWS_CONFIG_FILE": str(config),
    }
    extra, provider = store_config(env)
    assert provider is None
    assert extra == {
        "access_key_id": "AK",
        "secret_access_key": "SK",
        "region": "eu-west-3",
        "endpoint": "http://h:1",
        "allow_http": True,
    }
    extra, _ = store_config({**env, "AWS_ACCESS_KEY_ID": "E", "AWS_REGION": "us-east-2"})
    assert "access_key_id" not in extra and "region" not in extra
    extra, _ = store_config({**env, "AWS_ENDPOINT_URL": "https://s3.example"})
    assert "endpoint" not in extra and "allow_http" not in extra


def test_a_profile_alone_reaches_the_store(s3: ThrowawayS3, tmp_path: Path) -> None:
    """With no AWS_* keys or endpoint in the environment, a named profile's keys and
    endpoint_url list the bucket."""
    creds = _write(
        tmp_path / "credentials",
        f"[t]\naws_access_key_id = {s3.access_key}\naws_secret_access_key = {s3.secret_key}\n",
    )
    config = _write(tmp_path / "config", f"[profile t]\nendpoint_url = {s3.endpoint}\n")
    saved = {k: v for k, v in os.environ.items() if k.startswith("AWS_")}
    for key in saved:
        del os.environ[key]
    os.environ.update(
        AWS_PROFILE="t", AWS_SHARED_CREDENTIALS_FILE=str(creds), AWS_CONFIG_FILE=str(config)
    )
    try:
        found = dict(list_objects(f"s3://{BUCKET}/root", retry_s=2))
    finally:
        for key in [k for k in os.environ if k.startswith("AWS_")]:
            del os.environ[key]
        os.environ.update(saved)
    assert found == {name: len(BLOB) for name in ("a.bin", "b.bin", "c.bin", "sub/d.bin")}


@pytest.mark.parametrize("path", ["../x.bin", "/a.bin", "sub//d.bin", "./a.bin", "a\x00.bin", ""])
def test_paths_that_leave_the_prefix_are_refused_before_any_request(path: str) -> None:
    """Absolute, ``..``, ``.``, empty components and NUL are unsafe_path, and no fetch runs."""
    fetcher = Counting(S3Fetcher())
    with pytest.raises(BadSample) as caught:
        _files(fetcher).read(path, 0, 4)
    assert caught.value.kind == "unsafe_path"
    assert fetcher.calls == []


def test_a_batch_over_three_objects_costs_one_fetch_per_object_and_returns_the_bytes(
    s3: ThrowawayS3,
) -> None:
    """Neighbouring ranges of each object become one run; the bytes are each range's."""
    with store_env(s3):
        fetcher = Counting(S3Fetcher())
        files = _files(fetcher)
        paths = ["a.bin", "b.bin", "sub/d.bin"]
        which = np.array([0, 1, 2, 0, 1, 2, 0], np.intp)
        offsets = np.array([0, 100, 5000, 9000, 200, 5100, 16000], np.int64)
        lengths = np.array([10, 20, 30, 40, 50, 60, 384], np.int64)
        data, starts = files.read_ranges(Ranges(paths, which, offsets, lengths))
        for i in range(len(offsets)):
            got = bytes(data[starts[i] : starts[i] + lengths[i]])
            assert got == BLOB[offsets[i] : offsets[i] + lengths[i]]
        assert sorted(fetcher.calls) == [(f"s3://{BUCKET}/root/{p}", 1) for p in sorted(paths)], (
            "one run per object"
        )
        files.close()


@pytest.fixture
def proxy(s3: ThrowawayS3) -> Iterator[FaultyProxy]:
    """A misbehaving network in front of the store, and this process pointed at it."""
    faulty = FaultyProxy(s3.ports["s3"])
    try:
        with store_env(s3):
            os.environ["AWS_ENDPOINT_URL"] = faulty.endpoint
            yield faulty
    finally:
        faulty.close()


def test_throttling_is_retried_and_a_store_that_keeps_throttling_is_transient(
    proxy: FaultyProxy,
) -> None:
    """Three 503 SlowDown answers cost retries, not the sample; a store that answers 503
    through the whole retry window makes the sample ``transient``, never ``missing``."""
    files = _files(Counting(S3Fetcher()))
    proxy.throttle = 3
    assert bytes(files.read("b.bin", 10, 20)) == BLOB[10:30]
    assert proxy.throttled == 3
    files.close()
    # A window of several seconds, so that even on a loaded machine (CI runs two test files
    # at once) the store has answered 503 before the window closes: a window shorter than
    # one slow round trip ends the read with the client's timeout, not the store's answer.
    files = _files(Counting(S3Fetcher(retry_s=3.0)))
    proxy.throttle = 1 << 30
    with pytest.raises(BadSample, match="503") as caught:
        files.read("c.bin", 0, 4)
    assert caught.value.kind == "transient"
    files.close()


def test_a_worker_keeps_several_requests_in_flight(proxy: FaultyProxy) -> None:
    """The ranges of three objects, and three whole objects fetched ahead, are requested at
    once: the proxy holds every GET until three are in flight, so fetching one after the
    other would break its barrier and fail the read."""
    import threading

    files = _files(Counting(S3Fetcher(retry_s=2)))
    proxy.hold = threading.Barrier(3, timeout=10)
    paths = ["a.bin", "b.bin", "c.bin"]
    data, starts = files.read_ranges(
        Ranges(paths, np.arange(3, dtype=np.intp), np.array([1, 2, 3]), np.array([4, 4, 4]))
    )
    assert [bytes(data[s : s + 4]) for s in starts] == [BLOB[1:5], BLOB[2:6], BLOB[3:7]]
    proxy.hold = threading.Barrier(3, timeout=10)
    files.prefetch(paths)
    assert [bytes(files.read(p)) for p in paths] == [BLOB] * 3
    proxy.hold = None
    files.close()


def test_the_images_of_a_batch_of_64_are_fetched_in_one_round_trip(
    s3: ThrowawayS3, proxy: FaultyProxy
) -> None:
    """A store far away makes a small object's fetch cost its latency: a worker asks for all
    64 whole objects of a batch at once (the proxy holds every GET until 64 are in flight,
    so 8 at a time, as before, would break its barrier and fail the reads)."""
    import threading

    store = s3.store(BUCKET)
    paths = [f"many/{i:02d}.bin" for i in range(64)]
    for i, path in enumerate(paths):
        obstore.put(store, f"root/{path}", BLOB[i:])
    files = _files(Counting(S3Fetcher(retry_s=2)))
    proxy.hold = threading.Barrier(64, timeout=20)
    try:
        files.prefetch(paths)
        assert [bytes(files.read(p)) for p in paths] == [BLOB[i:] for i in range(64)]
    finally:
        proxy.hold = None
        files.close()


def test_a_missing_object_names_its_url_and_a_range_past_the_end_is_unreadable(
    s3: ThrowawayS3,
) -> None:
    with store_env(s3):
        files = _files(Counting(S3Fetcher()))
        with pytest.raises(BadSample, match=f"s3://{BUCKET}/root/nope.bin") as caught:
            files.read("nope.bin")
        assert caught.value.kind == "missing"
        with pytest.raises(BadSample) as caught:
            files.read("a.bin", len(BLOB) - 4, 8)
        assert caught.value.kind == "unreadable"
        assert bytes(files.read("sub/d.bin")) == BLOB
        files.prefetch(["a.bin", "c.bin"])
        assert bytes(files.read("c.bin")) == BLOB
        files.close()


def test_after_a_transient_failure_the_rest_of_the_batch_fails_at_once(
    s3: ThrowawayS3,
) -> None:
    """A store that is down: the first read retries and fails ``transient``, naming the
    object's URL but not the endpoint (the message reaches tenants); the next read of the
    same batch fails without a request; a new batch tries again."""
    with store_env(s3):
        os.environ["AWS_ENDPOINT_URL"] = "http://127.0.0.1:9"  # nothing listens there
        fetcher = Counting(S3Fetcher(retry_s=0.3))
        files = _files(fetcher)
        for path in ("a.bin", "b.bin"):
            with pytest.raises(BadSample, match=re.escape(f"s3://{BUCKET}/root/a.bin")) as caught:
                files.read(path, 0, 4)
            assert caught.value.kind == "transient"
            assert "127.0.0.1" not in str(caught.value)
        assert len(fetcher.calls) == 1
        files.begin_batch()
        with pytest.raises(BadSample):
            files.read("b.bin", 0, 4)
        assert len(fetcher.calls) == 2
        files.close()


def test_shard_patterns_match_keys_within_one_component_and_a_miss_names_the_root(
    s3: ThrowawayS3,
) -> None:
    """``*`` stays within a path component; brace lists expand; a pattern that matches no
    key is a DataError naming the root."""
    with store_env(s3):
        listing = ObjectListing(f"s3://{BUCKET}/root")
        assert [s.rel for s in object_shards(listing, ["*.bin"])] == ["a.bin", "b.bin", "c.bin"]
        assert [s.rel for s in object_shards(listing, ["{c,a}.bin", "sub/*"])] == [
            "c.bin",
            "a.bin",
            "sub/d.bin",
        ]
        with pytest.raises(DataError, match=f"matches no object under --root s3://{BUCKET}/root"):
            object_shards(listing, ["x-{0..2}.tar"])


def test_tar_ingest_from_the_store_reads_headers_and_labels_not_payloads(
    s3: ThrowawayS3, proxy: FaultyProxy, sqlite_engine: Engine
) -> None:
    """A shard of 8 samples of 256 KiB each: ingest catalogs every sample with its label and
    byte range while fetching under a tenth of the shard (headers in 8 KiB blocks)."""
    payloads = [np.random.default_rng(i).bytes(256 << 10) for i in range(8)]
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w") as tar:
        for i, payload in enumerate(payloads):
            for name, data in ((f"s{i}.npy", payload), (f"s{i}.cls", str(i % 3).encode())):
                info = tarfile.TarInfo(name)
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))
    shard = buffer.getvalue()
    obstore.put(s3.store(BUCKET), "tars/big-train-0.tar", shard)  # not through the proxy
    before = proxy.body_bytes
    report = ingest_tar(
        sqlite_engine, dataset="big", root=f"s3://{BUCKET}/tars", shards=["big-train-*.tar"]
    )
    fetched = proxy.body_bytes - before
    assert report.inserted == 8
    assert fetched < len(shard) / 10, (fetched, len(shard))
    with sqlite_engine.connect() as conn:
        rows = conn.execute(sa.text("SELECT key, byte_offset, byte_length, label FROM samples"))
        for key, offset, length, label in rows:
            i = int(key.rsplit("#s", 1)[1])
            assert shard[offset : offset + length] == payloads[i] and label == i % 3


def test_a_streamed_range_is_the_objects_bytes_and_fails_as_a_fetch_does(
    s3: ThrowawayS3,
) -> None:
    """``S3Fetcher.stream`` (the node cache's misses): a range's bytes in order, fewer when
    the range runs past the end; a missing object is ``missing`` naming its URL, a range
    that starts past the end ``unreadable``."""
    with store_env(s3):
        fetcher = S3Fetcher()
        url = f"s3://{BUCKET}/root/a.bin"
        assert b"".join(fetcher.stream(url, 100, 5000)) == BLOB[100:5100]
        assert b"".join(fetcher.stream(url, len(BLOB) - 10, 100)) == BLOB[-10:]
        with pytest.raises(BadSample, match=f"s3://{BUCKET}/root/nope.bin") as caught:
            list(fetcher.stream(f"s3://{BUCKET}/root/nope.bin", 0, 10))
        assert caught.value.kind == "missing"
        with pytest.raises(BadSample) as caught:
            list(fetcher.stream(url, len(BLOB) + 1, 10))
        assert caught.value.kind == "unreadable"
