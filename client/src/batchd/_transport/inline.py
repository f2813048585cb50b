"""The ``inline`` transport: batch bytes inside one gRPC ``StreamBatches`` call per stream.

The server packs each batch's fields (as ``batchd._wire.ring.pack`` places them) into messages
of a few MiB; the client joins them into one buffer of its own per batch, which the batch's
arrays then own. Requests (the StreamStart, then acks by batch index) go in through a queue
that gRPC's sending thread drains; responses are read on demand by the Loader's thread.

The stream's first message is bounded: the StreamStart asks the server to answer
``accepted`` as soon as the stream started (``accept_first``), and a call that has not said
so within ``timeout_s`` is cancelled and raises Unavailable (a server whose every RPC thread
is taken queues the call without ever starting it). Once accepted, batches take as long as
they take: gRPC keepalive notices a server that went silent, and the server's own task
deadline bounds a batch.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Iterator, Sequence
from typing import Any, Final

import grpc
import numpy as np

from batchd._proto.batchd.v1 import loader_pb2, loader_pb2_grpc
from batchd._rpc_errors import error_from_rpc
from batchd._stats import BatchTiming
from batchd._transport.stream import BatchStream, HeldSlots, ReceivedBatch
from batchd._wire.status import disagreement
from batchd.errors import Unavailable

__all__ = ["InlineAssembler", "InlineStream", "InlineTransport"]

_QUEUE_POLL_S: Final = 0.5


class InlineAssembler:
    """Joins the chunks of inline batches into one buffer per batch.

    Args:
        max_bytes: The most bytes one batch may announce (the session's slot size: a batch
            never holds more than its slot); None: no bound.
    """

    def __init__(self, max_bytes: int | None = None) -> None:
        self._max_bytes = max_bytes
        self._head: loader_pb2.StreamBatchesResponse | None = None
        self._buffer = np.empty(0, dtype=np.uint8)
        self._filled = 0

    def feed(self, msg: loader_pb2.StreamBatchesResponse) -> ReceivedBatch | None:
        """Take one message; the batch once its last chunk is in, else None."""
        if self._head is None:
            if msg.inline_bytes < 0 or (
                self._max_bytes is not None and msg.inline_bytes > self._max_bytes
            ):
                raise disagreement(
                    f"batch {msg.batch_index}: the server announces {msg.inline_bytes} inline "
                    f"bytes, more than the session's slot of {self._max_bytes} bytes"
                )
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
        max_batch_bytes: The session's slot size, which no batch's bytes may exceed.
        timeout_s: How long the server may take to accept the stream (the stream itself
            has no deadline: an epoch takes as long as training takes).
    """

    def __init__(
        self,
        stub: loader_pb2_grpc.LoaderStub,
        start: loader_pb2.StreamStart,
        *,
        target: str,
        timeout_s: float,
        max_batch_bytes: int | None = None,
    ) -> None:
        self._assembler = InlineAssembler(max_batch_bytes)
        self._target = target
        self._timeout_s = timeout_s
        self._pending: queue.Queue[loader_pb2.StreamBatchesRequest | None] = queue.Queue()
        self._stop = threading.Event()
        start.accept_first = True
        self._pending.put(loader_pb2.StreamBatchesRequest(start=start))
        self._accepted = False
        self._late = False
        self._lock = threading.Lock()
        self._started_at = time.monotonic()
        self._call: Any = stub.StreamBatches(_requests(self._pending, self._stop))
        self._ended = False
        self._timer = threading.Timer(timeout_s, self._not_accepted)
        self._timer.daemon = True
        self._timer.start()

    def _not_accepted(self) -> None:
        """The timer: the server did not accept the stream in time; cancel the call."""
        with self._lock:
            if self._accepted or self._ended:
                return
            self._late = True
        self._call.cancel()

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
        self._timer.cancel()
        self._stop.set()
        self._pending.put(None)
        if not self._ended:
            self._ended = True
            self._call.cancel()

    def _next_message(self) -> loader_pb2.StreamBatchesResponse | None:
        while True:
            msg = self._next_any()
            if msg is None or self._accepted:
                return msg
            with self._lock:
                self._accepted = True
            self._timer.cancel()
            if not (msg.accepted and not msg.data and not msg.fields):
                return msg  # a server without accept_first: its first batch says it all

    def _next_any(self) -> loader_pb2.StreamBatchesResponse | None:
        if self._ended:
            return None
        try:
            msg: loader_pb2.StreamBatchesResponse = next(self._call)
        except StopIteration:
            self._end()
            return None
        except grpc.RpcError as e:
            self._end()
            if self._late:
                waited = time.monotonic() - self._started_at
                raise Unavailable(
                    f"StreamBatches on {self._target!r} was not accepted within "
                    f"{self._timeout_s:g} s (waited {waited:.1f} s): the server is overloaded "
                    "(every RPC thread busy) or wedged. Pass a larger timeout_s if it is "
                    "merely slow"
                ) from e
            raise error_from_rpc(
                e, target=self._target, method="StreamBatches", timeout_s=self._timeout_s
            ) from e
        return msg

    def _end(self) -> None:
        with self._lock:
            self._ended = True
        self._timer.cancel()
        self._stop.set()


class InlineTransport:
    """The inline transport of one session: each stream is one ``StreamBatches`` call on
    the session's channel.

    Args:
        stub: The Loader stub of the session's channel.
        target: For error messages.
        max_batch_bytes: The session's slot size, which no batch's bytes may exceed (None:
            no bound).
        reason: Why inline was chosen, for the log.
    """

    name: Final = "inline"
    kind: Final = loader_pb2.TRANSPORT_INLINE
    ring: Final = None
    """No ring is mapped: every batch is a buffer of its own."""

    def __init__(
        self,
        stub: loader_pb2_grpc.LoaderStub,
        *,
        target: str,
        max_batch_bytes: int | None,
        reason: str,
    ) -> None:
        self._stub = stub
        self._target = target
        self._max_batch_bytes = max_batch_bytes
        self.reason = reason

    def open_stream(
        self, start: loader_pb2.StreamStart, *, held: HeldSlots, timeout_s: float
    ) -> BatchStream:
        """Start ``start``'s call (``held`` holds no slot inline: a batch owns its buffer)."""
        return InlineStream(
            self._stub,
            start,
            target=self._target,
            timeout_s=timeout_s,
            max_batch_bytes=self._max_batch_bytes,
        )

    def close(self) -> None:
        """Nothing to free: the channel is the connection's."""
