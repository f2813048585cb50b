"""What one pass over an epoch looks like to the Loader, whatever carries the bytes.

Two transports implement :class:`BatchStream`: :class:`batchd._transport.shm.ShmStream`
(batches in the server's shared-memory ring, news of them on the session's doorbell socket)
and :class:`batchd._transport.inline.InlineStream` (batch bytes inside one gRPC
``StreamBatches`` call). ``batchd._transport.select.select_transport`` picks a session's
:class:`~batchd._transport.select.Transport`, whose ``open_stream`` starts each stream
(``batchd._connection.Connection.start_stream`` asks it); the Loader's epoch loop is written
against the protocol only.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np
import numpy.typing as npt

from batchd._proto.batchd.v1 import loader_pb2
from batchd._stats import BatchTiming
from batchd._wire.status import disagreement

__all__ = ["BatchStream", "HeldSlots", "ReceivedBatch", "field_views"]


@dataclass(frozen=True)
class ReceivedBatch:
    """One batch as it arrived: every field a NumPy view of where its bytes are."""

    index: int
    slot: int
    """The ring slot holding it (shm), -1 inline."""
    rows: int
    arrays: dict[str, npt.NDArray[Any]]
    """Field name → ``[rows, ...]`` view into ``memory``."""
    failed_sample_ids: tuple[int, ...]
    extent_bytes: int
    """Bytes from the start of ``memory`` to the end of the last field."""
    offsets: dict[str, int]
    """Field name → byte offset from the start of ``memory``."""
    inline: bool
    """True when ``memory`` is a buffer of this batch alone (inline transport), False when
    it is a slot of the server's ring that must be given back."""
    memory: npt.NDArray[np.uint8]
    """The slot (shm) or inline buffer every field is a view of: it lives as long as any
    of them (NumPy points a view of a view at the first array)."""
    lease: int = 0
    """The slot's lease (shm), acked to give the slot back; 0 inline."""
    borrowed: bool = False
    """shm: the slot is another session's, lent by the session's share group
    (``StreamBatchesResponse.ring``); the lease gives it back all the same."""

    @classmethod
    def viewing(
        cls,
        memory: npt.NDArray[np.uint8],
        msg: loader_pb2.StreamBatchesResponse,
        *,
        inline: bool,
        borrowed: bool = False,
    ) -> ReceivedBatch:
        """The batch ``msg`` describes, its fields viewed in ``memory`` (a slot or an inline
        buffer).

        Raises:
            DataLoss: a field does not fit ``memory``.
        """
        arrays, offsets, extent = field_views(memory, len(memory), msg)
        return cls(
            index=msg.batch_index,
            slot=-1 if inline else msg.slot,
            rows=msg.rows,
            arrays=arrays,
            failed_sample_ids=tuple(msg.failed_sample_ids),
            extent_bytes=extent,
            offsets=offsets,
            inline=inline,
            memory=memory,
            lease=0 if inline else msg.lease,
            borrowed=borrowed,
        )

    @property
    def ack_key(self) -> int:
        """What acknowledges this batch: its index (inline) or its lease (shm)."""
        return self.index if self.inline else self.lease


class BatchStream(Protocol):
    """One stream: the batches of one epoch from a start batch, in order, with acks back.

    The Loader drives a stream from one thread: :meth:`receive` until the epoch's last
    batch, acks as batches are done with, then :meth:`finish` (the epoch ended normally)
    or :meth:`cancel` (the loop stopped early, or failed). Acks are flow-control credits:
    the server keeps at most the session's slots' worth of batches ahead of them.
    """

    def receive(self) -> ReceivedBatch | None:
        """The next batch, blocking until it is complete; None when the server ended the
        stream.

        Raises:
            BatchdError: the stream failed (the server's error, mapped to its class), the
                connection was lost (Unavailable), or the server broke the protocol
                (DataLoss).
        """
        ...

    def ack(self, keys: Sequence[int], timings: Sequence[BatchTiming]) -> None:
        """Give back the batches of these ``ReceivedBatch.ack_key``s (each is a credit for
        one more), reporting the ``timings`` of batches handed to the loop since the last
        report (for the server's metrics; they may wait for a later frame). Never raises for
        a server that is gone: the next receive says so."""
        ...

    def finish(self, timings: Sequence[BatchTiming]) -> None:
        """After the epoch's last batch: report every timing still pending (with
        ``timings``), then wait for the server's end of the stream.

        Raises:
            DataLoss: the server sent more batches than the epoch has.
            BatchdError: the stream ended with an error.
        """
        ...

    def cancel(self) -> None:
        """Abandon the stream (the consumer stopped early). Idempotent; never raises."""
        ...


class HeldSlots(Protocol):
    """What a new stream tells the server of the session's delivery (``batchd._device``):
    the slots the training loop still holds, and whether it may read another session's."""

    def lent(self) -> list[int]:
        """Leases of batches the training loop still owns; they outlive streams."""
        ...

    @property
    def reads_shared(self) -> bool:
        """A batch may be in another session's ring (``StreamStart.read_shared``)."""
        ...


_DTYPES: dict[str, np.dtype[Any]] = {}


def field_views(
    buffer: npt.NDArray[np.uint8], limit: int, msg: loader_pb2.StreamBatchesResponse
) -> tuple[dict[str, npt.NDArray[Any]], dict[str, int], int]:
    """Every field ``msg`` describes as a view of ``buffer[:limit]``, checked to fit.

    Returns:
        Field name → view, field name → offset, and the end of the last field.

    Raises:
        DataLoss: a field does not fit the buffer or its shape.
    """
    arrays: dict[str, npt.NDArray[Any]] = {}
    offsets: dict[str, int] = {}
    extent = 0
    for view in msg.fields:
        dtype = _DTYPES.get(view.dtype)
        if dtype is None:
            dtype = _DTYPES.setdefault(view.dtype, np.dtype(view.dtype))
        shape = tuple(view.shape)
        expected = math.prod(shape) * dtype.itemsize  # a hostile shape cannot overflow it
        end = view.offset + view.nbytes
        if view.offset < 0 or end > limit or view.nbytes != expected or dtype.byteorder == ">":
            raise disagreement(
                f"batch {msg.batch_index}: the server described field {view.name!r} as "
                f"{view.dtype}{list(shape)} at bytes {view.offset}..{end} of a {limit}-byte "
                "buffer, which does not fit"
            )
        arrays[view.name] = buffer[view.offset : end].view(dtype).reshape(shape)
        offsets[view.name] = view.offset
        extent = max(extent, end)
    return arrays, offsets, extent
