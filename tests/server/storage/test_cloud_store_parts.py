"""The object-store parts against Google Cloud Storage's and Azure Blob Storage's emulators
(fake-gcs-server and Azurite on loopback, ``tests/cloudservers.py``): the fetcher's ranges,
whole objects, streamed ranges and sizes, listings, what a missing object, a range past the
end, an object rewritten in place, refused credentials and a dead endpoint become."""

from __future__ import annotations

import base64
import logging
from collections.abc import Iterator

import pytest
from cloudservers import CloudServer, make_server

from batchd_server.pipelines.base import BadSample
from batchd_server.storage.s3 import S3Fetcher, StoreUnreachable, check_reachable, list_objects

pytestmark = pytest.mark.slow(seconds=1)

BUCKET = "parts"
DATA = bytes(range(256)) * 64  # 16 KiB


@pytest.fixture(scope="module", params=["gs", "az"])
def cloud(request: pytest.FixtureRequest) -> Iterator[CloudServer]:
    server = make_server(request.param)
    try:
        server.start()
        server.create_bucket(BUCKET)
        server.put(BUCKET, "root/a.bin", DATA)
        server.put(BUCKET, "root/sub/b.bin", b"b" * 10)
        server.put(BUCKET, "root/empty.bin", b"")
        server.put(BUCKET, "rootless.bin", b"not under root/")
        yield server
    finally:
        server.close()


@pytest.fixture
def env(cloud: CloudServer, monkeypatch: pytest.MonkeyPatch) -> CloudServer:
    for name, value in cloud.env().items():
        monkeypatch.setenv(name, value)
    return cloud


def test_ranges_whole_objects_streams_and_sizes_are_the_objects_bytes(env: CloudServer) -> None:
    """Byte ranges (several in one call, an empty one, the last byte), a whole object, a
    streamed range and a HEAD all give the bytes and size that were uploaded."""
    fetcher = S3Fetcher(retry_s=1)
    url = f"{env.scheme}://{BUCKET}/root/a.bin"
    got = fetcher.fetch(url, [(0, 10), (5000, 0), (4096, 300), (len(DATA) - 1, 1)])
    assert [bytes(b) for b in got] == [DATA[:10], b"", DATA[4096:4396], DATA[-1:]]
    assert bytes(fetcher.fetch_whole(url, 1 << 20)) == DATA
    assert b"".join(fetcher.stream(url, 100, 9000)) == DATA[100:9100]
    assert fetcher.size(url) == len(DATA)
    assert bytes(fetcher.fetch_whole(f"{env.scheme}://{BUCKET}/root/empty.bin", 10)) == b""


def test_a_listing_is_the_objects_under_the_prefix_and_nothing_beside_it(env: CloudServer) -> None:
    root = f"{env.scheme}://{BUCKET}/root"
    assert sorted(list_objects(root, retry_s=1)) == [
        ("a.bin", len(DATA)), ("empty.bin", 0), ("sub/b.bin", 10),
    ]  # fmt: skip
    check_reachable(root, retry_s=1)


def test_a_missing_object_names_its_url_and_a_range_past_the_end_is_unreadable(
    env: CloudServer,
) -> None:
    fetcher = S3Fetcher(retry_s=1)
    gone = f"{env.scheme}://{BUCKET}/root/gone.bin"
    with pytest.raises(BadSample, match=f"{gone}: no such object") as caught:
        fetcher.fetch(gone, [(0, 4)])
    assert caught.value.kind == "missing"
    with pytest.raises(BadSample) as caught:
        fetcher.fetch(f"{env.scheme}://{BUCKET}/root/sub/b.bin", [(100, 4)])
    assert caught.value.kind == "unreadable"


def test_an_object_rewritten_in_place_is_never_served_mixed(
    env: CloudServer, caplog: pytest.LogCaptureFixture
) -> None:
    """As on S3: after a rewrite, a reader's next ranges come whole from the new version,
    with a warning. (Azurite answers If-Match with 412; fake-gcs-server ignores If-Match, and
    the new ETag in its answers tells the fetcher instead.)"""
    url = f"{env.scheme}://{BUCKET}/root/v.bin"
    env.put(BUCKET, "root/v.bin", b"A" * 8192)
    fetcher = S3Fetcher(retry_s=1)
    assert [bytes(b) for b in fetcher.fetch(url, [(0, 4), (4096, 4)])] == [b"AAAA"] * 2
    env.put(BUCKET, "root/v.bin", b"B" * 8192)
    with caplog.at_level(logging.WARNING, "batchd_server.storage.s3_gets"):
        again = fetcher.fetch(url, [(0, 4), (4096, 4)])
    assert [bytes(b) for b in again] == [b"BBBB"] * 2
    assert "changed in place" in caplog.text


def test_a_dead_endpoint_is_unreachable_naming_the_url_and_the_variable_to_check(
    cloud: CloudServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Nothing listens: the listing fails with the root's URL and the store's endpoint
    variable in the message, and no credential."""
    env = cloud.env()
    for name, value in env.items():
        monkeypatch.setenv(name, value.replace(str(cloud.port), "9"))  # type: ignore[attr-defined]
    root = f"{cloud.scheme}://{BUCKET}/root"
    with pytest.raises(StoreUnreachable, match=f"cannot reach {root}") as caught:
        check_reachable(root, retry_s=0.2)
    hint = "STORAGE_EMULATOR_HOST" if cloud.scheme == "gs" else "BlobEndpoint"
    assert hint in str(caught.value) and "127.0.0.1" not in str(caught.value)
    if cloud.secret:
        assert cloud.secret not in str(caught.value)


@pytest.mark.parametrize("cloud", ["az"], indirect=True)  # fake-gcs-server checks none
def test_refused_credentials_are_transient_and_name_the_azure_settings(
    cloud: CloudServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Azurite refuses a wrong account key: reads are ``transient`` bad samples saying to
    check the Azure credentials, never quoting a key. (fake-gcs-server checks no
    credentials.)"""
    wrong = base64.b64encode(b"w" * 64).decode()
    for name, value in cloud.env().items():
        monkeypatch.setenv(name, value.replace(cloud.secret, wrong))
    url = f"{cloud.scheme}://{BUCKET}/root/a.bin"
    with pytest.raises(BadSample, match="AZURE_STORAGE_CONNECTION_STRING") as caught:
        S3Fetcher(retry_s=0.2).fetch(url, [(0, 4)])
    assert caught.value.kind == "transient"
    assert wrong not in str(caught.value) and cloud.secret not in str(caught.value)
    with pytest.raises(StoreUnreachable) as refused:
        check_reachable(f"{cloud.scheme}://{BUCKET}/root", retry_s=0.2)
    assert refused.value.denied
    malformed = "not-base64-" + cloud.secret[:8]
    for name, value in cloud.env().items():
        monkeypatch.setenv(name, value.replace(cloud.secret, malformed))
    with pytest.raises(BadSample, match="settings for az:// stores make no client") as caught:
        S3Fetcher(retry_s=0.2).fetch(url, [(0, 4)])
    assert malformed not in str(caught.value) and caught.value.kind == "transient"
    with pytest.raises(StoreUnreachable, match="AZURE_STORAGE_CONNECTION_STRING"):
        check_reachable(f"{cloud.scheme}://{BUCKET}/root", retry_s=0.2)
