"""A session is its opener's and reads what the server checked: another client can neither
stream nor close it (nor learn that it exists), the log names it by a prefix of its id, and
a dataset root swapped for a symlink after the check does not lead the workers elsewhere.
Real server, real gRPC calls, real worker processes."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from pathlib import Path

import grpc
import numpy as np
import pytest
from sqlalchemy.engine import Engine

import batchd
from batchd._proto.batchd.v1 import loader_pb2 as pb
from batchd._proto.batchd.v1 import loader_pb2_grpc
from batchd._wire.metadata import CLIENT_ID_KEY

from serving import RECORD_FLOATS, record_dataset, serve

# The embedded catalog: what is under test does not depend on the backend.
pytestmark = pytest.mark.backend("sqlite")

_RECORDS = pb.Pipeline(array=pb.ArrayPipeline(shape=[RECORD_FLOATS], dtype="float32", raw=True))


def _as(client: str) -> list[tuple[str, str]]:
    return [(CLIENT_ID_KEY, client)]


def _stream(stub: loader_pb2_grpc.LoaderStub, session_id: str, client: str) -> list[int]:
    """The batch indices of one inline epoch of ``session_id``, streamed as ``client``."""

    def start() -> Iterator[pb.StreamBatchesRequest]:
        begin = pb.StreamStart(session_id=session_id, transport=pb.TRANSPORT_INLINE)
        yield pb.StreamBatchesRequest(start=begin)

    replies = stub.StreamBatches(start(), timeout=60, metadata=_as(client))
    return [m.batch_index for m in replies if m.fields]


def _not_found(stub: loader_pb2_grpc.LoaderStub, session_id: str, client: str) -> str:
    """The details of the NOT_FOUND that streaming ``session_id`` as ``client`` gets, with
    the id written as ``<id>``."""
    with pytest.raises(grpc.RpcError) as refused:
        _stream(stub, session_id, client)
    assert refused.value.code() == grpc.StatusCode.NOT_FOUND
    return str(refused.value.details()).replace(session_id, "<id>")


def test_another_client_can_neither_stream_nor_close_a_session_nor_learn_it_exists(
    engine: Engine, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Client a opens a session. Client b naming it gets NOT_FOUND on StreamBatches, word for
    word what an unknown id gets, and its CloseSession answers OK as for an unknown id while
    the session stays open; a streams the whole epoch and closes it. The manager's INFO lines
    name the session by its first 8 characters, never the whole id (a credential)."""
    record_dataset(engine, tmp_path / "r", n=32)
    url = engine.url.render_as_string(hide_password=False)
    caplog.set_level(logging.INFO, logger="batchd_server.sessions.manager")
    with serve(url, tmp_path, workers=1) as srv, grpc.insecure_channel(srv.address) as channel:
        stub = loader_pb2_grpc.LoaderStub(channel)
        request = pb.OpenSessionRequest(dataset="records", batch_size=8, pipeline=_RECORDS)
        session_id = stub.OpenSession(request, timeout=60, metadata=_as("a")).session_id
        unknown = "0" * len(session_id)

        assert _not_found(stub, session_id, "b") == _not_found(stub, unknown, "b")
        for named in (session_id, unknown):
            close = pb.CloseSessionRequest(session_id=named)
            assert stub.CloseSession(close, timeout=10, metadata=_as("b")) == (
                pb.CloseSessionResponse()
            )
        assert len(srv.sessions) == 1, "another client's CloseSession closed the session"

        assert _stream(stub, session_id, "a") == [0, 1, 2, 3]
        close = pb.CloseSessionRequest(session_id=session_id)
        stub.CloseSession(close, timeout=10, metadata=_as("a"))
        assert len(srv.sessions) == 0
    logged = [r.getMessage() for r in caplog.records if r.name.endswith("sessions.manager")]
    info = [m for m in logged if session_id[:8] in m]
    assert any("opened for" in m for m in info) and any("closed by" in m for m in info), logged
    assert all(session_id not in m for m in logged), logged


def test_workers_read_the_root_the_server_checked_not_a_symlink_swapped_in_after(
    engine: Engine, tmp_path: Path
) -> None:
    """--data-root: the dataset's root is a symlink to a directory inside the data root, so
    the session opens; then the link is pointed at a directory outside, holding other
    records. The workers still read the directory that was checked: every record is the
    dataset's own."""
    allowed = tmp_path / "allowed"
    records = record_dataset(engine, allowed / "records", n=20)
    root = allowed / "records"
    root.rename(allowed / "real")
    root.symlink_to(allowed / "real")
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "shard-000.bin").write_bytes((records + 0.5).tobytes())
    url = engine.url.render_as_string(hide_password=False)
    spec = batchd.Array((RECORD_FLOATS,), "float32", raw=True)
    with serve(url, tmp_path, workers=1, data_roots=(allowed,)) as srv:
        loader = batchd.Loader(
            srv.address, dataset="records", batch_size=5, pipeline=spec, shuffle=False
        )
        root.unlink()
        root.symlink_to(outside)  # after the server checked the root, before any read
        with loader:
            got = np.concatenate([batch["array"].numpy() for batch in loader])
    assert np.array_equal(got, records), "the workers read the directory swapped in"
