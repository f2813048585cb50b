"""What goes wrong on a session's side channels is in the server's log, at WARNING, naming
the session by a short prefix of its id (the id itself lets anyone who has it stream the
session's batches): a malformed doorbell frame, and an ack the server fails to apply. Real
server, real doorbell socket, real StreamBatches call."""

from __future__ import annotations

import logging
import socket
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
from sqlalchemy.engine import Engine

from batchd._proto.batchd.v1 import loader_pb2 as pb
from batchd._proto.batchd.v1 import loader_pb2_grpc
from batchd._wire.frames import HELLO, RELEASE, WELCOME, FrameReader, encode_frame
from batchd_server.metrics import stall

from chaos_harness import wait_until
from serving import RECORD_FLOATS, record_dataset, serve

# The embedded catalog: what is under test does not depend on the backend.
pytestmark = pytest.mark.backend("sqlite")

_RECORDS = pb.Pipeline(array=pb.ArrayPipeline(shape=[RECORD_FLOATS], dtype="float32", raw=True))


def _warnings(caplog: pytest.LogCaptureFixture, logger: str) -> list[str]:
    return [
        r.getMessage() for r in caplog.records if r.name == logger and r.levelno >= logging.WARNING
    ]


def _open(stub: loader_pb2_grpc.LoaderStub) -> Any:
    request = pb.OpenSessionRequest(dataset="records", batch_size=8, pipeline=_RECORDS)
    return stub.OpenSession(request, timeout=60)


def test_a_malformed_doorbell_frame_is_a_warning_naming_the_session_by_a_prefix(
    engine: Engine, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """After a proper hello, a release frame whose payload is not an Ack: the server hangs
    up and logs a WARNING with the session id's first 8 characters and the problem; no
    doorbell log line holds the whole id."""
    record_dataset(engine, tmp_path / "r", n=32)
    url = engine.url.render_as_string(hide_password=False)
    caplog.set_level(logging.DEBUG)
    with serve(url, tmp_path, workers=1) as srv, grpc.insecure_channel(srv.address) as channel:
        reply = _open(loader_pb2_grpc.LoaderStub(channel))
        session_id = reply.session_id
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
            sock.settimeout(30)
            sock.connect(str(srv.registry.shm_dir / reply.ring.doorbell))
            hello = pb.DoorbellHello(session_id=session_id, token=reply.ring.token)
            sock.sendall(encode_frame(HELLO, hello.SerializeToString()))
            frame = FrameReader(sock).read()
            assert frame is not None and frame[0] == WELCOME
            sock.sendall(encode_frame(RELEASE, b"\xff\xff\xff\xff"))
            assert sock.recv(1 << 16) == b"", "the server hangs up on a malformed frame"
        logged = _warnings(caplog, "batchd_server.delivery.doorbell")
        assert any(session_id[:8] in m and "Ack" in m for m in logged), logged
    doorbell = [r.getMessage() for r in caplog.records if r.name.endswith(".doorbell")]
    assert all(session_id not in m for m in doorbell), doorbell


def test_an_ack_the_server_fails_to_apply_is_a_warning_not_silence(
    engine: Engine,
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The stall metrics fail on an inline stream's ack (a server bug, injected): the
    server logs a WARNING naming the session by its prefix and the error."""

    def broken(*args: object, **kwargs: object) -> None:
        raise RuntimeError("stall metrics exploded")

    monkeypatch.setattr(stall, "record_client_timings", broken)
    record_dataset(engine, tmp_path / "r", n=32)
    url = engine.url.render_as_string(hide_password=False)
    with serve(url, tmp_path, workers=1) as srv, grpc.insecure_channel(srv.address) as channel:
        stub = loader_pb2_grpc.LoaderStub(channel)
        session_id = _open(stub).session_id

        def requests() -> Iterator[pb.StreamBatchesRequest]:
            start = pb.StreamStart(session_id=session_id, transport=pb.TRANSPORT_INLINE)
            yield pb.StreamBatchesRequest(start=start)
            yield pb.StreamBatchesRequest(ack=pb.Ack(batch_indices=[0]))

        def _acks_logged() -> list[str]:
            logged = _warnings(caplog, "batchd_server.api.session_rpcs")
            return [m for m in logged if "stall metrics exploded" in m]

        call = stub.StreamBatches(requests(), timeout=60)
        next(call)
        wait_until(lambda: bool(_acks_logged()), "the ack's failure to be logged", 30)
        call.cancel()
        logged = _acks_logged()
        assert any(session_id[:8] in m and session_id not in m for m in logged), logged
        stub.CloseSession(pb.CloseSessionRequest(session_id=session_id), timeout=10)
