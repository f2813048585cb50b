"""The doorbell's framing: ``encode_frame`` writes frames, ``FrameReader`` cuts a byte stream
back into them, ``parse`` turns a payload into its message. Over real ``socketpair()``s.

Several tests make the reading socket non-blocking: each ``recv`` then returns exactly the
bytes sent since the last one, so the test decides where the reader's reads are cut (a
``recv`` that finds nothing raises ``BlockingIOError``, and the bytes already read stay
buffered for the next ``read()``).
"""

from __future__ import annotations

import itertools
import socket
import threading
import tracemalloc
from collections.abc import Iterator

import pytest
from google.protobuf.message import Message
from hypothesis import given, settings
from hypothesis import strategies as st

from batchd._proto.batchd.v1 import loader_pb2
from batchd._wire.frames import (
    BATCH,
    END,
    HELLO,
    MAX_FRAME_BYTES,
    RELEASE,
    WELCOME,
    FrameReader,
    encode_frame,
    parse,
)
from batchd.errors import DataLoss

Frame = tuple[int, bytes]
KINDS = (HELLO, WELCOME, BATCH, RELEASE, END)
HANG_GUARD_S = 30.0
"""A blocking read that gets no bytes for this long fails the test instead of hanging it."""


@pytest.fixture
def pair() -> Iterator[tuple[socket.socket, socket.socket]]:
    """A connected unix stream socket pair: (the reader's end, the writer's end)."""
    reading, writing = socket.socketpair()
    reading.settimeout(HANG_GUARD_S)
    try:
        yield reading, writing
    finally:
        reading.close()
        writing.close()


def _sample_frames() -> list[Frame]:
    """Frames as the doorbell sends them: real messages, an empty payload, and a batch
    notice whose failed ids make it larger than one ``recv`` of the reader (64 KiB)."""
    hello = loader_pb2.DoorbellHello(session_id="s" * 32, token=b"t" * 16)
    notice = loader_pb2.StreamBatchesResponse(batch_index=3, slot=1, rows=16)
    big = loader_pb2.StreamBatchesResponse(batch_index=4, failed_sample_ids=range(1, 40_000))
    ack = loader_pb2.Ack(leases=[1, 2, 3], wait_s=0.25)
    messages = [(HELLO, hello), (BATCH, notice), (BATCH, big), (RELEASE, ack)]
    frames = [(kind, message.SerializeToString()) for kind, message in messages]
    frames.insert(1, (WELCOME, b""))
    assert len(frames[3][1]) > 1 << 16
    return frames


def _stream(frames: list[Frame]) -> bytes:
    return b"".join(encode_frame(kind, payload) for kind, payload in frames)


def _feed_in_pieces(pieces: list[bytes]) -> tuple[list[Frame], list[int]]:
    """Send each piece with its own ``send`` to a non-blocking reader, reading everything
    it makes whole after each piece; then close and read to the end.

    Returns:
        The frames read, and for each the index of the piece after which it came out.
    """
    reading, writing = socket.socketpair()
    try:
        reading.setblocking(False)
        reader = FrameReader(reading)
        frames: list[Frame] = []
        after: list[int] = []
        for i, piece in enumerate(pieces):
            writing.sendall(piece)
            while True:
                try:
                    frame = reader.read()
                except BlockingIOError:
                    break
                assert frame is not None, "EOF before the writer closed"
                frames.append(frame)
                after.append(i)
        writing.close()
        reading.setblocking(True)
        assert reader.read() is None
        return frames, after
    finally:
        reading.close()
        writing.close()


def test_a_frame_is_its_length_little_endian_then_its_kind_then_its_payload() -> None:
    """The wire format both packages rely on: 4-byte LE payload length, kind byte, payload."""
    assert encode_frame(BATCH, b"abc") == b"\x03\x00\x00\x00Babc"
    assert encode_frame(WELCOME) == b"\x00\x00\x00\x00W"


def test_frames_sent_byte_by_byte_come_out_whole_and_only_after_their_last_byte() -> None:
    """One ``send`` per byte: every frame is returned, unchanged, right after its last byte
    arrives and not before."""
    frames = [f for f in _sample_frames() if len(f[1]) < 1 << 16]  # not 100 Ki sends
    stream = _stream(frames)
    got, after = _feed_in_pieces([stream[i : i + 1] for i in range(len(stream))])
    assert got == frames
    ends, end = [], 0
    for kind, payload in frames:
        end += len(encode_frame(kind, payload))
        ends.append(end - 1)
    assert after == ends


def test_several_frames_in_one_send_are_returned_one_by_one(
    pair: tuple[socket.socket, socket.socket],
) -> None:
    """A peer ahead of the reader: one ``send`` of every frame, then each ``read()`` returns
    the next frame, in order, and None once the peer has closed."""
    reading, writing = pair
    frames = [f for f in _sample_frames() if len(f[1]) < 1 << 16]
    writing.sendall(_stream(frames))
    writing.close()
    reader = FrameReader(reading)
    assert [reader.read() for _ in frames] == frames
    assert reader.read() is None


def test_a_frame_larger_than_one_recv_is_assembled_whole(
    pair: tuple[socket.socket, socket.socket],
) -> None:
    """A payload several times the reader's receive size comes back byte for byte."""
    reading, writing = pair
    payload = bytes(range(256)) * 2048  # 512 KiB: more than the socket buffer, too
    sender = threading.Thread(target=writing.sendall, args=(encode_frame(END, payload),))
    sender.start()
    try:
        assert FrameReader(reading).read() == (END, payload)
    finally:
        sender.join(HANG_GUARD_S)
    assert not sender.is_alive()


@settings(max_examples=200, deadline=None)
@given(st.data())
def test_any_partition_of_a_stream_of_frames_yields_the_same_frames(data: st.DataObject) -> None:
    """However a stream of several frames is cut into ``send``s (cuts inside headers,
    inside payloads, between frames), the reader returns exactly those frames."""
    frame = st.tuples(st.sampled_from(KINDS), st.binary(max_size=300))
    frames = data.draw(st.lists(frame, min_size=2, max_size=10), label="frames")
    stream = _stream(frames)
    cuts = data.draw(st.sets(st.integers(1, len(stream) - 1)), label="cuts")
    bounds = [0, *sorted(cuts), len(stream)]
    pieces = [stream[a:b] for a, b in itertools.pairwise(bounds)]
    got, _ = _feed_in_pieces(pieces)
    assert got == frames


@pytest.mark.parametrize("announced", [MAX_FRAME_BYTES + 1, (1 << 32) - 1])
def test_an_oversized_frame_is_data_loss_at_its_header_with_nothing_allocated(
    pair: tuple[socket.socket, socket.socket], announced: int
) -> None:
    """A header announcing more than MAX_FRAME_BYTES fails at once, naming both numbers,
    without waiting for (or allocating) the announced payload."""
    reading, writing = pair
    writing.sendall(announced.to_bytes(4, "little") + bytes([BATCH]) + b"x" * 100)
    reader = FrameReader(reading)
    tracemalloc.start()
    try:
        with pytest.raises(DataLoss, match=rf"{announced} bytes.*more than {MAX_FRAME_BYTES}"):
            reader.read()  # the writer stays open: waiting for the payload would hang
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 1 << 20, f"{peak} bytes allocated for a refused frame"


def test_a_frame_of_exactly_max_frame_bytes_is_not_refused_at_its_header(
    pair: tuple[socket.socket, socket.socket],
) -> None:
    """MAX_FRAME_BYTES itself is allowed: the reader waits for the payload (here the peer
    then hangs up, which is a frame cut short, not an oversized one)."""
    reading, writing = pair
    writing.sendall(MAX_FRAME_BYTES.to_bytes(4, "little") + bytes([BATCH]) + b"x" * 100)
    writing.close()
    with pytest.raises(DataLoss, match="closed in the middle of a frame"):
        FrameReader(reading).read()


@pytest.mark.parametrize("kept", [1, 4, 5, 9], ids=lambda n: f"{n}-bytes")
def test_a_connection_closed_mid_frame_is_data_loss(
    pair: tuple[socket.socket, socket.socket], kept: int
) -> None:
    """The peer hanging up inside a header or a payload is DataLoss, not a short frame."""
    reading, writing = pair
    frame = encode_frame(BATCH, b"0123456789")
    writing.sendall(encode_frame(WELCOME) + frame[:kept])
    writing.close()
    reader = FrameReader(reading)
    assert reader.read() == (WELCOME, b"")
    with pytest.raises(DataLoss, match="closed in the middle of a frame"):
        reader.read()


def test_a_connection_closed_between_frames_reads_as_none_every_time(
    pair: tuple[socket.socket, socket.socket],
) -> None:
    """A clean hang-up after a whole frame is the end of the stream: None, and None again."""
    reading, writing = pair
    writing.sendall(encode_frame(RELEASE, b"\x08\x01"))
    writing.close()
    reader = FrameReader(reading)
    assert reader.read() == (RELEASE, b"\x08\x01")
    assert reader.read() is None
    assert reader.read() is None


def test_parse_returns_the_message_a_payload_holds() -> None:
    """A payload from the wire parses into the message that was sent."""
    hello = loader_pb2.DoorbellHello(session_id="abc", token=b"\x00\x01")
    assert parse(loader_pb2.DoorbellHello, hello.SerializeToString()) == hello
    assert parse(loader_pb2.Ack, b"") == loader_pb2.Ack()


@pytest.mark.parametrize(
    "garbage",
    [b"\xff", b"\x0a\xff\x01", b"\x12\x05ab", b"\x08\x80\x80\x80\x80\x80\x80\x80\x80\x80\x80"],
    ids=["bad-tag", "truncated-length", "short-bytes", "overlong-varint"],
)
@pytest.mark.parametrize("message", [loader_pb2.DoorbellHello, loader_pb2.Ack])
def test_garbage_payload_is_data_loss_naming_the_message_type(
    message: type[Message], garbage: bytes
) -> None:
    """Bytes that are not a protobuf message are DataLoss naming the type expected and
    saying that client and server disagree on the wire format."""
    with pytest.raises(DataLoss, match=rf"does not hold a {message.__name__}.*disagree"):
        parse(message, garbage)
