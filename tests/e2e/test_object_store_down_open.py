"""A job restarted while its object store is down: a new server on the node cache's
directory opens new sessions on an ``s3://`` dataset whose bytes are all cached and serves
their epochs from the cache, while its health report and ``batchd_object_store_up`` say the
store is down; without the node cache the open is still refused, clearly. SeaweedFS on
loopback (``tests/s3server.py``) is stopped to take the store down."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from s3server import ThrowawayS3, bucket_in_env
from sqlalchemy.engine import Engine

import batchd
from batchd import errors
from batchd_server.api import RunningServer
from batchd_server.api.health import REASON_KEY
from batchd_server.catalog.ingest import ingest_imagefolder
from batchd_server.demo_data import write_demo_images
from batchd_server.metrics.object_store import OBJECT_STORE_UP
from batchd_server.storage.roots import STORE_STATUS

from chaos_harness import wait_until
from serving import serve

pytestmark = pytest.mark.slow(seconds=90)

BUCKET = "outage"
IMAGE = batchd.Image(size=24)


@pytest.fixture
def s3() -> Iterator[ThrowawayS3]:
    with bucket_in_env(BUCKET) as server:
        STORE_STATUS.forget()
        yield server
    STORE_STATUS.forget()


def _server(url: str, tmp: Path, cache: Path | None) -> Any:
    return serve(
        url, tmp, cache_dir=cache, cache_size_bytes=64 << 20, object_store_retry_s=1.0,
        object_store_list_cache_s=0.0,
    )  # fmt: skip


def _epoch(server: RunningServer) -> list[np.ndarray]:
    with batchd.Loader(
        server.address, dataset="s3images", batch_size=8, pipeline=IMAGE, seed=3,
        device="cpu", on_error="raise",
    ) as loader:  # fmt: skip
        out = []
        for batch in loader:
            assert loader.last_failed_sample_ids == ()
            out.append(np.asarray(batch["image"]))
        return out


def _health_note(server: RunningServer) -> str:
    with grpc.insecure_channel(server.address) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        response, call = stub.Check.with_call(health_pb2.HealthCheckRequest(service=""))
    assert response.status == health_pb2.HealthCheckResponse.SERVING
    notes = [v for k, v in call.trailing_metadata() or () if k == REASON_KEY]
    return notes[0].decode() if notes else ""


def test_a_new_session_opens_and_trains_from_the_cache_while_the_store_is_down(
    s3: ThrowawayS3, sqlite_engine: Engine, tmp_path: Path
) -> None:
    write_demo_images(tmp_path / "images", 24, seed=5)
    s3.upload_tree(tmp_path / "images", BUCKET, "images")
    ingest_imagefolder(sqlite_engine, dataset="s3images", root=f"s3://{BUCKET}/images")
    url = sqlite_engine.url.render_as_string(hide_password=False)
    cache = tmp_path / "cache"
    for name in ("a", "b", "c"):
        (tmp_path / name).mkdir()
    try:
        with _server(url, tmp_path / "a", cache) as server:
            first = _epoch(server)  # fills the cache
            assert OBJECT_STORE_UP.labels(BUCKET)._value.get() == 1
            assert _health_note(server) == ""
        s3.stop()
        with _server(url, tmp_path / "b", cache) as server:  # the job restarted
            again = _epoch(server)
            assert OBJECT_STORE_UP.labels(BUCKET)._value.get() == 0
            # The health report is made every --health-interval-s: wait for the next one.
            wait_until(lambda: _health_note(server) != "", "the health report's note", 30)
            note = _health_note(server)
            assert "object store did not answer" in note and s3.endpoint not in note
        with (
            _server(url, tmp_path / "c", None) as server,
            pytest.raises(errors.FailedPrecondition, match=f"cannot reach s3://{BUCKET}/images")
            as refused,
        ):  # fmt: skip
            _epoch(server)
        assert str(s3.ports["s3"]) not in str(refused.value), "the endpoint is the operator's"
    finally:
        if s3.process is None:
            s3.start()
    assert len(first) == len(again)
    for x, y in zip(first, again, strict=True):
        assert np.array_equal(np.sort(x.reshape(len(x), -1), axis=0),
                              np.sort(y.reshape(len(y), -1), axis=0))  # fmt: skip
