"""The doorbell's resources are bounded: connections still owing their hello are capped (one
more is closed at once, with a warning), a ring serves one stream however fast START frames
come (the newest wins), and cancels of streams that are over leave nothing behind. A real
server; a raw socket speaking the frames of ``batchd._wire.frames``."""

from __future__ import annotations

import contextlib
import logging
import socket
import tracemalloc
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
from sqlalchemy.engine import Engine

from batchd._proto.batchd.v1 import loader_pb2 as pb
from batchd._proto.batchd.v1 import loader_pb2_grpc
from batchd._wire.frames import (
    ACCEPTED,
    BATCH,
    CANCEL,
    END,
    HEARTBEAT,
    HELLO,
    HELLO_TIMEOUT_S,
    RELEASE,
    START,
    WELCOME,
    FrameReader,
    encode_frame,
    parse,
)
from batchd_server.api import RunningServer
from batchd_server.delivery.doorbell import MAX_PENDING_HELLOS

from serving import RECORD_FLOATS, record_dataset, serve

# The embedded catalog: what is under test does not depend on the backend.
pytestmark = pytest.mark.backend("sqlite")

_RECORDS = pb.Pipeline(array=pb.ArrayPipeline(shape=[RECORD_FLOATS], dtype="float32", raw=True))
_N, _BATCH_SIZE = 64, 8


@pytest.fixture
def server(engine: Engine, tmp_path: Path) -> Iterator[RunningServer]:
    record_dataset(engine, tmp_path / "r", n=_N)
    url = engine.url.render_as_string(hide_password=False)
    with serve(url, tmp_path, workers=1) as srv:
        yield srv


@pytest.fixture
def opened(server: RunningServer) -> Iterator[Any]:
    """An open shm session of ``records`` (its OpenSessionResponse)."""
    with grpc.insecure_channel(server.address) as channel:
        stub = loader_pb2_grpc.LoaderStub(channel)
        request = pb.OpenSessionRequest(
            dataset="records", batch_size=_BATCH_SIZE, pipeline=_RECORDS
        )
        reply = stub.OpenSession(request, timeout=60)
        assert reply.ring.doorbell, "the session has a ring and a doorbell"
        yield reply
        stub.CloseSession(pb.CloseSessionRequest(session_id=reply.session_id), timeout=30)


def _connect(server: RunningServer, timeout_s: float = 30.0) -> socket.socket:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(timeout_s)
    sock.connect(str(server.registry.shm_dir / server.sessions.doorbell))
    return sock


def _hello(sock: socket.socket, reply: Any) -> FrameReader:
    """Say hello for ``reply``'s session; the reader, past the WELCOME."""
    hello = pb.DoorbellHello(session_id=reply.session_id, token=reply.ring.token)
    sock.sendall(encode_frame(HELLO, hello.SerializeToString()))
    reader = FrameReader(sock)
    frame = reader.read()
    assert frame is not None and frame[0] == WELCOME, frame
    return reader


def _start(reply: Any, seq: int) -> bytes:
    start = pb.StreamStart(session_id=reply.session_id, epoch=0, seq=seq, heartbeat=True)
    return encode_frame(START, start.SerializeToString())


def _frames(reader: FrameReader) -> Iterator[tuple[int, Any]]:
    """(kind, message) of each frame but heartbeats, until the server hangs up."""
    while (frame := reader.read()) is not None:
        kind, payload = frame
        if kind in (ACCEPTED, BATCH):
            yield kind, parse(pb.StreamBatchesResponse, payload)
        elif kind == END:
            yield kind, parse(pb.DoorbellEnd, payload)
        else:
            assert kind == HEARTBEAT, kind


def test_a_connection_beyond_the_pending_hello_cap_is_closed_at_once_with_a_warning(
    server: RunningServer, opened: Any, caplog: pytest.LogCaptureFixture
) -> None:
    """MAX_PENDING_HELLOS connections that say nothing: one more is closed well before the
    hello timeout and a WARNING says why; the silent ones are still served, and a hello
    answered frees its place for the next connection."""
    caplog.set_level(logging.WARNING, logger="batchd_server.delivery.doorbell")
    with contextlib.ExitStack() as stack:
        silent = [stack.enter_context(_connect(server)) for _ in range(MAX_PENDING_HELLOS)]
        with _connect(server, timeout_s=HELLO_TIMEOUT_S / 2) as extra:
            assert extra.recv(1) == b"", "the connection past the cap is closed at once"
        warnings = [r.getMessage() for r in caplog.records if r.name.endswith(".doorbell")]
        assert any("refused" in m and f"{MAX_PENDING_HELLOS} connections" in m for m in warnings), (
            warnings
        )
        _hello(silent[0], opened)  # a silent one is served once it speaks
        with _connect(server) as late:
            _hello(late, opened)  # the place the hello freed takes a new connection


def test_the_newest_of_a_burst_of_starts_is_the_only_stream_on_the_ring(
    server: RunningServer, opened: Any
) -> None:
    """Twenty START frames at once: every earlier seq ends, no frame of one comes after
    the last seq's ACCEPTED, and the last stream delivers its whole epoch, once."""
    last = 20
    with _connect(server) as sock:
        reader = _hello(sock, opened)
        sock.sendall(b"".join(_start(opened, seq) for seq in range(1, last + 1)))
        ended: set[int] = set()
        batches: list[int] = []
        accepted = False
        for kind, msg in _frames(reader):
            if msg.seq != last:
                assert not accepted, f"a frame of stream {msg.seq} after {last} was accepted"
                if kind == BATCH:
                    ack = pb.Ack(leases=[msg.lease])
                    sock.sendall(encode_frame(RELEASE, ack.SerializeToString()))
                if kind == END:
                    ended.add(msg.seq)
                continue
            if kind == ACCEPTED:
                accepted = True
            elif kind == BATCH:
                assert accepted
                batches.append(msg.batch_index)
                ack = pb.Ack(leases=[msg.lease])
                sock.sendall(encode_frame(RELEASE, ack.SerializeToString()))
            else:
                assert not msg.error_class, msg.message
                break
    assert ended == set(range(1, last)), sorted(ended)
    assert batches == list(range(opened.num_batches)), batches


def test_cancels_of_streams_that_are_over_leave_nothing_behind(
    server: RunningServer, opened: Any
) -> None:
    """20,000 CANCEL frames for streams that never ran or already ended: the doorbell keeps
    no memory of them, and the next stream runs."""
    with _connect(server) as sock:
        reader = _hello(sock, opened)
        cancels = b"".join(
            encode_frame(CANCEL, pb.DoorbellCancel(seq=seq).SerializeToString())
            for seq in range(1, 20_001)
        )
        tracemalloc.start()
        try:
            before = tracemalloc.take_snapshot()
            sock.sendall(cancels)
            # Frames are handled in order: once this start is accepted, so were the cancels.
            sock.sendall(_start(opened, 20_001))
            kind, msg = next(_frames(reader))
            after = tracemalloc.take_snapshot()
        finally:
            tracemalloc.stop()
        assert (kind, msg.seq) == (ACCEPTED, 20_001)
    only = [tracemalloc.Filter(True, "*/delivery/doorbell.py")]
    grown = sum(
        s.size_diff
        for s in after.filter_traces(only).compare_to(before.filter_traces(only), "filename")
    )
    assert grown < 64 << 10, f"the doorbell holds {grown} more bytes after 20,000 cancels"


def test_a_start_whose_seq_does_not_grow_is_refused_and_the_running_stream_goes_on(
    server: RunningServer, opened: Any
) -> None:
    """START 5, then START 3: seq 3 ends at once with InvalidArgument; stream 5 is the one
    accepted, untouched."""
    with _connect(server) as sock:
        reader = _hello(sock, opened)
        sock.sendall(_start(opened, 5) + _start(opened, 3))
        refusal, accepted = None, False
        for kind, msg in _frames(reader):
            assert (kind, msg.seq) != (END, 5), f"stream 5 ended: {msg}"
            if (kind, msg.seq) == (END, 3):
                refusal = msg
            accepted = accepted or (kind, msg.seq) == (ACCEPTED, 5)
            if refusal is not None and accepted:
                break
    assert refusal is not None
    assert refusal.error_class == "InvalidArgument" and "seq=5" in refusal.message
