"""A ring a client borrows a slot of (another share-group member's) is mapped read-only: a
batch read there cannot be written, by array or by mapping, though the file itself would let
this process write it; and delivered to a PyTorch loop it is a copy (a tensor has no
read-only flag). Segments are real files in /dev/shm."""

from __future__ import annotations

import secrets
from collections.abc import Iterator

import pytest

from batchd._device import CpuDelivery
from batchd._proto.batchd.v1 import loader_pb2
from batchd._transport.shm import SHM_DIR, ShmRing

from wire_double import TAG


def _segment() -> loader_pb2.RingLayout:
    """A real 2-slot ring segment in /dev/shm (mode 0600, this process's: writable)."""
    layout = loader_pb2.RingLayout(
        shm_name=f"{TAG}{secrets.token_hex(8)}",
        segment_bytes=64 + 2 * 256,
        header_bytes=64,
        slot_bytes=256,
        slots=2,
        token=secrets.token_bytes(16),
    )
    with open(SHM_DIR / layout.shm_name, "wb") as f:
        f.write(layout.token.ljust(layout.segment_bytes, b"\0"))
    (SHM_DIR / layout.shm_name).chmod(0o600)
    return layout


@pytest.fixture
def rings() -> Iterator[tuple[loader_pb2.RingLayout, loader_pb2.RingLayout]]:
    own, other = _segment(), _segment()
    try:
        yield own, other
    finally:
        for layout in (own, other):
            (SHM_DIR / layout.shm_name).unlink(missing_ok=True)


def _lent(other: loader_pb2.RingLayout) -> loader_pb2.StreamBatchesResponse:
    view = loader_pb2.FieldView(name="array", dtype="<f4", shape=[4], offset=0, nbytes=16)
    return loader_pb2.StreamBatchesResponse(
        batch_index=3, slot=1, rows=4, fields=[view], lease=9, ring=other
    )


def test_a_borrowed_ring_is_mapped_read_only_and_a_write_raises(rings: tuple) -> None:
    own, other = rings
    ring = ShmRing.open(own)
    assert ring.writable  # its own ring: read-write, as CUDA registration needs
    try:
        batch = ring.batch(_lent(other))
        assert batch.borrowed
        array = batch.arrays["array"]
        assert not array.flags.writeable
        with pytest.raises(ValueError, match="read-only"):
            array[0] = 1.0
        with pytest.raises(ValueError, match="WRITEABLE"):
            array.flags.writeable = True
        borrowed = ring._borrowed[other.shm_name]
        assert not borrowed.writable
        with pytest.raises(TypeError, match="readonly"):
            borrowed._mmap[100] = 1  # type: ignore[index]
        # The owner's bytes are unchanged.
        data = (SHM_DIR / other.shm_name).read_bytes()
        assert data[64 + 256 : 64 + 256 + 16] == b"\0" * 16
        del batch, array
    finally:
        ring.close()


def test_a_borrowed_batch_reaches_a_torch_loop_as_a_copy_and_its_slot_goes_back(
    rings: tuple,
) -> None:
    """A tensor cannot be read-only: a borrowed batch is copied out, and its lease given back
    at once, so writing the tensor changes nothing in the other member's ring."""
    torch = pytest.importorskip("torch", reason="the torch path of CpuDelivery")
    own, other = rings
    ring = ShmRing.open(own)
    try:
        delivery = CpuDelivery(zero_copy=False, prefetch=2, slots=6, release=lambda _: None)
        tensors, acks = delivery.deliver(ring.batch(_lent(other)))
        assert isinstance(tensors["array"], torch.Tensor) and acks == [9]
        tensors["array"].add_(1.0)
        data = (SHM_DIR / other.shm_name).read_bytes()
        assert data[64 + 256 : 64 + 256 + 16] == b"\0" * 16
        assert delivery.copies == 1
    finally:
        ring.close()
