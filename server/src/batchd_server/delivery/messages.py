"""The messages of a stream: the ``StreamStart`` that begins it, and those that carry a ready
batch to its client: a notice (shm) or its bytes (inline).

Both the doorbell (shm streams) and the StreamBatches RPC (inline streams) start streams and
send batches, so the messages are read and built here, in a module that imports neither.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Final

from batchd._proto.batchd.v1 import loader_pb2 as pb
from batchd._wire.ring import HEADER_BYTES, pack
from batchd_server.metrics.delivery import BYTES_SERVED
from batchd_server.sessions import ReadyBatch, RingRef, Session, Stream

__all__ = ["INLINE_CHUNK_BYTES", "inline_messages", "ring_layout", "shm_notice", "start_stream"]

INLINE_CHUNK_BYTES: Final = 4 << 20
"""Inline batches travel in messages of at most this many bytes of data."""


def start_stream(session: Session, start: pb.StreamStart, *, shm: bool) -> Stream:
    """``session``'s stream as ``start`` asks for it; an shm stream keeps the leases the
    client says it holds (an inline stream has none).

    Raises:
        InvalidArgument, NotFound: as ``Session.start_stream``.
    """
    return session.start_stream(
        start.epoch,
        start.start_batch,
        start_sample=start.start_sample,
        order_world_size=start.order_world_size,
        held_leases=start.held_leases if shm else None,
        stride=start.stride,
        rotation=start.rotation,
        join_share=start.join_share,
        read_shared=start.read_shared and shm,
    )


def shm_notice(ready: ReadyBatch, seq: int) -> pb.StreamBatchesResponse:
    """The doorbell notice of an shm batch of the stream ``seq`` (counted as served)."""
    views, total = _views(ready, inline=False)
    BYTES_SERVED.labels(transport="shm").inc(total)
    notice = pb.StreamBatchesResponse(
        batch_index=ready.batch_index,
        slot=ready.slot,
        rows=ready.rows,
        fields=views,
        failed_sample_ids=ready.failed_sample_ids,
        lease=ready.lease,
        seq=seq,
    )
    if ready.ring is not None:  # a loan: the batch is in another member's ring
        notice.ring.CopyFrom(ring_layout(ready.ring))
    return notice


def ring_layout(ring: RingRef, doorbell: str = "") -> pb.RingLayout:
    """``ring`` as a client maps it: the session's own (OpenSession, with its ``doorbell``)
    or another member's (a loan's notice)."""
    return pb.RingLayout(
        shm_name=ring.name,
        segment_bytes=ring.segment_bytes,
        header_bytes=HEADER_BYTES,
        slot_bytes=ring.slot_bytes,
        slots=ring.slots,
        token=ring.token,
        doorbell=doorbell,
    )


def _views(ready: ReadyBatch, *, inline: bool) -> tuple[list[pb.FieldView], int]:
    """The batch's field views and its size inline: inline fields are packed as
    ``batchd._wire.ring.pack`` places them, so the client can view them without realigning."""
    packed, total = pack(f.nbytes for f in ready.fields)
    views = [
        pb.FieldView(
            name=f.name,
            dtype=f.dtype,
            shape=f.shape,
            offset=inline_offset if inline else f.offset,
            nbytes=f.nbytes,
        )
        for f, inline_offset in zip(ready.fields, packed, strict=True)
    ]
    return views, total


def inline_messages(session: Session, ready: ReadyBatch) -> Iterator[pb.StreamBatchesResponse]:
    """The messages of an inline batch: its fields packed, in chunks of INLINE_CHUNK_BYTES."""
    views, total = _views(ready, inline=True)
    payload = bytearray(total)
    memory = session.slot_memory(ready.slot)
    for f, view in zip(ready.fields, views, strict=True):
        payload[view.offset : view.offset + f.nbytes] = memory[f.offset : f.offset + f.nbytes]
    del memory
    BYTES_SERVED.labels(transport="inline").inc(total)
    for start in range(0, max(total, 1), INLINE_CHUNK_BYTES):
        chunk = bytes(payload[start : start + INLINE_CHUNK_BYTES])
        more = start + INLINE_CHUNK_BYTES < total
        if start == 0:
            yield pb.StreamBatchesResponse(
                batch_index=ready.batch_index,
                slot=-1,
                rows=ready.rows,
                fields=views,
                failed_sample_ids=ready.failed_sample_ids,
                data=chunk,
                more=more,
                inline_bytes=total,
            )
        else:
            yield pb.StreamBatchesResponse(
                batch_index=ready.batch_index, slot=-1, data=chunk, more=more
            )
