"""Transports without a server: mapping a ring segment, choosing shm or inline, and joining
inline chunks. Segments are real files in /dev/shm, laid out by the test."""

from __future__ import annotations

import math
import secrets
from collections.abc import Iterator
from typing import Any

import grpc
import numpy as np
import pytest

from batchd._proto.batchd.v1 import loader_pb2, loader_pb2_grpc
from batchd._transport.inline import InlineAssembler
from batchd._transport.select import _CHOICES, Transport, select_transport
from batchd._transport.shm import SHM_DIR, ShmRing
from batchd._wire.specs import TRANSPORTS
from batchd.errors import DataLoss, FailedPrecondition

from wire_double import TAG, inline_chunks


@pytest.fixture
def segment() -> Iterator[tuple[loader_pb2.RingLayout, np.ndarray]]:
    """A real segment in /dev/shm laid out as a 2-slot ring, and its layout; removed after."""
    name = f"{TAG}{secrets.token_hex(8)}"
    layout = loader_pb2.RingLayout(
        shm_name=name,
        segment_bytes=64 + 2 * 256,
        header_bytes=64,
        slot_bytes=256,
        slots=2,
        token=secrets.token_bytes(16),
    )
    path = SHM_DIR / name
    with open(path, "wb") as f:
        f.write(layout.token.ljust(layout.segment_bytes, b"\0"))
    try:
        yield layout, np.memmap(path, dtype=np.uint8, mode="r+")
    finally:
        path.unlink(missing_ok=True)


def _response(index: int, slot: int, fields: list[tuple[str, str, list[int], int]]) -> Any:
    views = []
    for name, dtype, shape, offset in fields:
        nbytes = int(np.prod(shape)) * np.dtype(dtype).itemsize
        views.append(
            loader_pb2.FieldView(name=name, dtype=dtype, shape=shape, offset=offset, nbytes=nbytes)
        )
    return loader_pb2.StreamBatchesResponse(
        batch_index=index, slot=slot, rows=shape[0] if fields else 0, fields=views
    )


def _opened(layout: loader_pb2.RingLayout) -> loader_pb2.OpenSessionResponse:
    return loader_pb2.OpenSessionResponse(session_id="s" * 32, ring=layout)


@pytest.fixture
def stub() -> Iterator[loader_pb2_grpc.LoaderStub]:
    """A stub on a channel that never connects: choosing inline makes no call."""
    channel = grpc.insecure_channel("unix:///nonexistent/batchd-test.sock")
    try:
        yield loader_pb2_grpc.LoaderStub(channel)
    finally:
        channel.close()


def _select(
    requested: str, layout: loader_pb2.RingLayout, stub: loader_pb2_grpc.LoaderStub
) -> Transport:
    return select_transport(requested, _opened(layout), stub=stub, target="test")


def _inline(chosen: Transport) -> bool:
    """``chosen`` is inline: no ring, and its streams say so on the wire."""
    return (chosen.name, chosen.kind, chosen.ring) == ("inline", loader_pb2.TRANSPORT_INLINE, None)


def test_every_transport_choice_the_loader_accepts_has_one_row_in_the_table() -> None:
    """The selection table and the wire's list of choices name the same transports."""
    assert sorted(_CHOICES) == sorted(TRANSPORTS)


def test_a_ring_with_the_right_token_maps_and_reads_its_slots_in_place(segment: Any) -> None:
    """The server's segment maps, and a batch's fields are views of its slot."""
    layout, memory = segment
    ring = ShmRing.open(layout)
    assert ring.writable
    try:
        slot1 = 64 + 256
        memory[slot1 : slot1 + 24].view("<i8")[:] = [7, 8, 9]
        memory[slot1 + 64 : slot1 + 88].view("<f4")[:] = np.arange(6)
        batch = ring.batch(
            _response(5, 1, [("sample_id", "<i8", [3], 0), ("array", "<f4", [3, 2], 64)])
        )
        assert batch.index == 5 and not batch.inline and batch.extent_bytes == 88
        assert batch.arrays["array"].base is batch.memory  # what the lend path watches
        assert batch.arrays["sample_id"].tolist() == [7, 8, 9]
        assert batch.arrays["array"].tolist() == [[0, 1], [2, 3], [4, 5]]
        with pytest.raises(DataLoss, match="does not fit"):
            ring.batch(_response(5, 1, [("array", "<f4", [40, 2], 64)]))
        with pytest.raises(DataLoss, match="slot 2"):
            ring.batch(_response(5, 2, [("sample_id", "<i8", [3], 0)]))
        del batch
    finally:
        ring.close()


def test_token_mismatch_falls_back_to_inline_or_fails_when_shm_is_forced(
    segment: Any, stub: Any
) -> None:
    """A same-named segment with other bytes is not the server's: auto goes inline, shm fails."""
    layout, _ = segment
    other = loader_pb2.RingLayout()
    other.CopyFrom(layout)
    other.token = secrets.token_bytes(16)
    chosen = _select("auto", other, stub)
    assert _inline(chosen) and "token" in chosen.reason
    with pytest.raises(FailedPrecondition, match=r"token.*emptyDir"):
        _select("shm", other, stub)


def test_a_segment_without_a_reachable_doorbell_is_not_used(segment: Any, stub: Any) -> None:
    """The ring maps, but nobody answers on its doorbell: auto goes inline, shm says why."""
    layout, _ = segment
    for doorbell in ("", f"{TAG}{secrets.token_hex(8)}-bell"):
        layout.doorbell = doorbell
        chosen = _select("auto", layout, stub)
        assert _inline(chosen) and "doorbell" in chosen.reason
        with pytest.raises(FailedPrecondition, match="doorbell"):
            _select("shm", layout, stub)


def test_missing_segment_falls_back_to_inline_or_fails_when_shm_is_forced(stub: Any) -> None:
    """No such segment here: auto goes inline; shm says why and what to change."""
    layout = loader_pb2.RingLayout(
        shm_name=f"{TAG}{secrets.token_hex(8)}", segment_bytes=128, slot_bytes=64, slots=1
    )
    layout.token = b"t" * 16
    chosen = _select("auto", layout, stub)
    assert _inline(chosen) and "cannot open" in chosen.reason
    with pytest.raises(FailedPrecondition, match="transport='auto' or 'inline'"):
        _select("shm", layout, stub)
    traversal = loader_pb2.RingLayout(shm_name="../etc/passwd", segment_bytes=1, token=b"t")
    assert _inline(_select("auto", traversal, stub))


def test_inline_transport_never_opens_the_segment(segment: Any, stub: Any) -> None:
    """transport='inline' is honoured even where shm would work."""
    layout, _ = segment
    chosen = _select("inline", layout, stub)
    assert _inline(chosen) and chosen.reason == "transport='inline' was asked for"


def test_inline_chunks_are_joined_into_one_owned_buffer() -> None:
    """Chunks cut across field boundaries come back as the right arrays, owned by the batch."""
    ids, values = np.array([3, 1, 2], "<i8"), np.arange(6, dtype="<f4").reshape(3, 2)
    data = ids.tobytes().ljust(64, b"\0") + values.tobytes()
    head = _response(4, -1, [("sample_id", "<i8", [3], 0), ("array", "<f4", [3, 2], 64)])
    head.failed_sample_ids[:] = [9]
    assembler = InlineAssembler()
    results = [assembler.feed(m) for m in inline_chunks(head, data, 7)]
    assert results[:-1] == [None] * (len(results) - 1) and len(results) == math.ceil(88 / 7)
    batch = results[-1]
    assert batch is not None and batch.inline and batch.slot == -1
    assert batch.index == 4 and batch.failed_sample_ids == (9,)
    assert batch.arrays["sample_id"].tolist() == [3, 1, 2]
    assert np.array_equal(batch.arrays["array"], values)
    empty = _response(5, -1, [("sample_id", "<i8", [0], 0)])
    assert InlineAssembler().feed(inline_chunks(empty, b"", 7)[0]).arrays["sample_id"].shape == (0,)


def test_inline_chunks_that_disagree_with_the_announced_size_are_data_loss() -> None:
    """More or fewer bytes than inline_bytes is a broken stream, not a silent truncation."""
    head = _response(0, -1, [("sample_id", "<i8", [2], 0)])
    too_many = inline_chunks(head, bytes(16), 8)
    too_many[0].inline_bytes = 8
    assembler = InlineAssembler()
    assembler.feed(too_many[0])
    with pytest.raises(DataLoss, match="more than the announced"):
        assembler.feed(too_many[1])
    short = _response(0, -1, [("sample_id", "<i8", [2], 0)])
    message = inline_chunks(short, bytes(8), 8)[0]
    message.inline_bytes = 16
    with pytest.raises(DataLoss, match="8 of the announced 16"):
        InlineAssembler().feed(message)


def test_an_inline_batch_larger_than_the_sessions_slot_is_refused_before_allocating() -> None:
    """A server that announces more bytes than the session's slot can hold (a broken or
    hostile peer) is a DataLoss at the first chunk: the client allocates nothing for it."""
    head = _response(0, -1, [("sample_id", "<i8", [2], 0)])
    message = inline_chunks(head, bytes(16), 16)[0]
    message.inline_bytes = 1 << 50
    with pytest.raises(DataLoss, match="more than the session's slot of 4096 bytes"):
        InlineAssembler(max_bytes=4096).feed(message)
    message.inline_bytes = 16
    assert InlineAssembler(max_bytes=4096).feed(message) is not None
