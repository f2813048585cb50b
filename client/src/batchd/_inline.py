"""The ``inline`` transport: batch bytes inside one gRPC ``StreamBatches`` call per stream.

The server packs each batch's fields (as ``batchd._ring.pack`` places them) into messages
of a few MiB; the client joins them into one buffer of its own per batch, which the batch's
arrays then own. Requests (the StreamStart, then acks by batch index) go in through a queue
that gRPC's sending thread drains; responses are read on demand by the Loader's thread.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Iterator, Sequence
from typing import Any, Final

import grpc
import numpy as np

from batchd._proto.batchd.v1 import loader_pb2, loader_pb2_grpc
from batchd._stats import BatchTiming
from batchd._status import disagreement, error_from_rpc
from batchd._stream import ReceivedBatch

__all__ = ["InlineAssembler", "InlineStream"]

_QUEUE_POLL_S: Final = 0.5


class InlineAssembler:
    """Joins the chunks of inline batches into one buffer per batch."""

    def __init__(self) -> None:
        self._head: loader_pb2.StreamBatchesResponse | None = None
        self._buffer = np.empty(0, dtype=np.uint8)
        self._filled = 0

    def feed(self, msg: loader_pb2.StreamBatchesResponse) -> ReceivedBatch | None:
        """Take one message; the batch once its last chunk is in, else None."""
        if self._head is None:
            self._head = msg
            # A fresh buffer per batch: the batch's arrays own it, so it needs no copy later.
            self._buffer = np.empty(msg.inline_bytes, dtype=np.uint8)
            self._filled = 0
        head = self._head
        end = self._filled + len(msg.data)
        if end > len(self._buffer):
            raise disagreement(
                f"batch {head.batch_index}: inline chunks carry more than the announced "
                f"{len(self._buffer)} bytes"
            )
        self._buffer[self._filled : end] = np.frombuffer(msg.data, dtype=np.uint8)
        self._filled = end
        if msg.more:
            return None
        self._head = None
        if self._filled != len(self._buffer):
            raise disagreement(
                f"batch {head.batch_index}: inline chunks carry {self._filled} of the announced "
                f"{len(self._buffer)} bytes"
            )
        return ReceivedBatch.viewing(self._buffer, head, inline=True)


def _requests(
    pending: queue.Queue[loader_pb2.StreamBatchesRequest | None], stop: threading.Event
) -> Iterator[loader_pb2.StreamBatchesRequest]:
    """What gRPC's sending thread sends; None (or ``stop``) half-closes the stream."""
    while True:
        try:
            request = pending.get(timeout=_QUEUE_POLL_S)
        except queue.Empty:
            # The call may have ended without our sentinel (server error, cancel): then
            # nobody will put one, and this thread must not wait forever.
            if stop.is_set():
                return
            continue
        if request is None:
            return
        yield request


class InlineStream:
    """One inline ``StreamBatches`` call: StreamStart first, then Acks; batches out in order.

    Requests go in through a queue that gRPC's sending thread drains; responses are read on
    demand.

    Args:
        stub: The Loader stub of the session's channel.
        start: The call's first message.
        target: For error messages.
        timeout_s: For error messages (the stream itself has no deadline: an epoch takes
            as long as training takes).
    """

    def __init__(
        self,
        stub: loader_pb2_grpc.LoaderStub,
        start: loader_pb2.StreamStart,
        *,
        target: str,
        timeout_s: float,
    ) -> None:
        self._assembler = InlineAssembler()
        self._target = target
        self._timeout_s = timeout_s
        self._pending: queue.Queue[loader_pb2.StreamBatchesRequest | None] = queue.Queue()
        self._stop = threading.Event()
        self._pending.put(loader_pb2.StreamBatchesRequest(start=start))
        self._call: Any = stub.StreamBatches(_requests(self._pending, self._stop))
        self._ended = False

    def ack(self, keys: Sequence[int], timings: Sequence[BatchTiming]) -> None:
        """Tell the server the batches of these indices arrived (each is a credit for one
        more), with the loop's timings of the batches handed to it since the last ack."""
        if keys or timings:
            ack = loader_pb2.Ack(
                batch_indices=keys,
                wait_s=sum(t.wait_s for t in timings),
                batch_wait_s=[t.wait_s for t in timings],
                batch_step_s=[t.step_s for t in timings],
            )
            self._pending.put(loader_pb2.StreamBatchesRequest(ack=ack))

    def receive(self) -> ReceivedBatch | None:
        """The next batch, blocking until it is complete; None when the server ended the call.

        Raises:
            BatchdError: the call failed (the server's error, mapped by ``error_from_rpc``),
                or the server broke the wire format (DataLoss).
        """
        while True:
            msg = self._next_message()
            if msg is None:
                return None
            batch = self._assembler.feed(msg)
            if batch is not None:
                return batch

    def finish(self, timings: Sequence[BatchTiming]) -> None:
        """Send the last timings, half-close the requests and read the responses to their
        end (after the last batch).

        Raises:
            DataLoss: the server sent more batches than the epoch has.
            BatchdError: the call ended with an error.
        """
        self.ack((), timings)
        self._pending.put(None)
        try:
            extra = self._next_message()
            if extra is not None:
                raise disagreement(
                    f"the server sent batch {extra.batch_index} after the epoch's last batch",
                    on="the epoch's plan",
                )
        finally:
            self._stop.set()

    def cancel(self) -> None:
        """Abandon the call (the consumer stopped early). Idempotent."""
        self._stop.set()
        self._pending.put(None)
        if not self._ended:
            self._ended = True
            self._call.cancel()

    def _next_message(self) -> loader_pb2.StreamBatchesResponse | None:
        if self._ended:
            return None
        try:
            msg: loader_pb2.StreamBatchesResponse = next(self._call)
        except StopIteration:
            self._ended = True
            self._stop.set()
            return None
        except grpc.RpcError as e:
            self._ended = True
            self._stop.set()
            raise error_from_rpc(
                e, target=self._target, method="StreamBatches", timeout_s=self._timeout_s
            ) from e
        return msg
