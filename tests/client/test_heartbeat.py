"""The client's side of the doorbell's deadlines, over real sockets: the WELCOME announces
the heartbeat, heartbeats keep a wait alive, silence for a few intervals (or past a
deadline) is ``DoorbellSilent`` (an ``Unavailable``), and the server's heartbeat send never
blocks. A server that is really stopped is ``tests/e2e/test_deadlines.py``."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from batchd._proto.batchd.v1 import loader_pb2
from batchd._transport.doorbell import ClientDoorbell, DoorbellSilent
from batchd._wire.frames import (
    BATCH,
    HEARTBEAT,
    SILENT_HEARTBEATS,
    WELCOME,
    FrameReader,
    FrameWriter,
    encode_frame,
)
from batchd.errors import Unavailable


@pytest.fixture
def pair() -> Iterator[tuple[socket.socket, socket.socket]]:
    """(the client's end, the server's end) of a unix stream socket pair."""
    client, server = socket.socketpair()
    try:
        yield client, server
    finally:
        client.close()
        server.close()


def _bell(sock: socket.socket, heartbeat_s: float) -> ClientDoorbell:
    return ClientDoorbell(sock, FrameReader(sock), Path("/dev/shm/bell"), heartbeat_s)


def _heartbeat(interval_s: float) -> bytes:
    return encode_frame(
        HEARTBEAT, loader_pb2.DoorbellHeartbeat(interval_s=interval_s).SerializeToString()
    )


def test_frames_within_the_window_are_read_and_silence_after_them_is_unavailable(
    pair: tuple[socket.socket, socket.socket],
) -> None:
    """Heartbeats and a batch notice come out as frames; once the server says nothing more
    for SILENT_HEARTBEATS intervals, the read raises DoorbellSilent naming the heartbeat."""
    client, server = pair
    server.sendall(_heartbeat(0.25) * 3 + encode_frame(BATCH, b"") + _heartbeat(0.25))
    bell = _bell(client, heartbeat_s=0.25)
    kinds = [bell.read()[0] for _ in range(5)]
    assert kinds == [HEARTBEAT] * 3 + [BATCH, HEARTBEAT]
    with pytest.raises(DoorbellSilent) as raised:
        bell.read()
    assert isinstance(raised.value, Unavailable)
    message = str(raised.value)
    assert f"for {SILENT_HEARTBEATS * 0.25:g} s" in message and "heartbeat every 0.25 s" in message


def test_a_read_with_a_deadline_gives_up_even_without_heartbeats(
    pair: tuple[socket.socket, socket.socket],
) -> None:
    client, _server = pair
    bell = _bell(client, heartbeat_s=0.0)
    with pytest.raises(DoorbellSilent, match="in time"):
        bell.read(deadline=time.monotonic() + 0.2)


def test_a_closed_doorbell_is_unavailable_not_silent(
    pair: tuple[socket.socket, socket.socket],
) -> None:
    client, server = pair
    bell = _bell(client, heartbeat_s=10.0)
    server.close()
    with pytest.raises(Unavailable) as raised:
        bell.read()
    assert not isinstance(raised.value, DoorbellSilent)


@pytest.mark.parametrize("interval_s", [0.5, 0.0])
def test_connect_learns_the_heartbeat_interval_from_the_welcome(
    tmp_path: Path, interval_s: float
) -> None:
    """The WELCOME frame carries the interval; an empty one (an older server) promises none."""
    path = tmp_path / "bell"
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(str(path))
    listener.listen(1)

    def welcome() -> None:
        conn, _ = listener.accept()
        with conn:
            assert FrameReader(conn).read() is not None  # the hello
            payload = loader_pb2.DoorbellHeartbeat(interval_s=interval_s).SerializeToString()
            conn.sendall(encode_frame(WELCOME, payload))
            conn.recv(1)  # until the client hangs up

    server = threading.Thread(target=welcome, daemon=True)
    server.start()
    try:
        bell = ClientDoorbell.connect(path, "s" * 32, b"t" * 16)
        assert bell.heartbeat_s == interval_s
        bell.close()
        server.join(30)
    finally:
        listener.close()


def test_a_heartbeat_is_never_sent_when_it_could_block(
    pair: tuple[socket.socket, socket.socket],
) -> None:
    """``try_send`` (the server's heartbeat) gives up, without waiting, when another thread
    is sending or the peer's buffer is full; otherwise it sends."""
    _client, server = pair
    writer = FrameWriter(server)
    beat = loader_pb2.DoorbellHeartbeat(interval_s=1.0)
    assert writer.try_send(HEARTBEAT, beat)
    with writer.lock:
        assert not writer.try_send(HEARTBEAT, beat)
    server.setblocking(False)
    try:
        while True:  # nobody reads the client's end: fill the buffer
            server.send(b"x" * 65536)
    except BlockingIOError:
        pass
    server.setblocking(True)
    assert not writer.try_send(HEARTBEAT, beat)
    assert not writer.closed
