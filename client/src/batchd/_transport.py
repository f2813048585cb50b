"""How batch bytes reach the client: the server's shm ring, or chunks inside the stream.

``shm``: the server writes each batch into a slot of a shared-memory segment and says, on the
session's doorbell socket (``_doorbell.py``), where its fields are and under which lease;
the client maps the segment once per session and reads the slot in place, and gives the
slot back by acking the lease. The segment starts with a token the server also sends in
``RingLayout.token``: a client that reads the same bytes there has the server's segment
(same host, same ``/dev/shm``), not a same-named file of another machine or container.

``inline``: the bytes travel in ``StreamBatchesResponse.data``, a few MiB per message; the
client reassembles each batch into one buffer of its own.

One pass over an epoch is a stream: :class:`ShmStream` runs on the session's doorbell
(start, batch notices, acks, end: no gRPC at all), :class:`BatchStream` is one inline
``StreamBatches`` call (requests go in through a queue that gRPC's sending thread drains,
batches come out of the call in order).
"""

from __future__ import annotations

import contextlib
import mmap
import os
import queue
import threading
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

import grpc
import numpy as np
import numpy.typing as npt

from batchd._doorbell import (
    ACCEPTED,
    BATCH,
    CANCEL,
    END,
    START,
    ClientDoorbell,
    DoorbellRefused,
    parse,
)
from batchd._proto.batchd.v1 import loader_pb2, loader_pb2_grpc
from batchd._status import error_from_rpc, error_named
from batchd.errors import DataLoss, FailedPrecondition, NotFound, Unavailable

__all__ = [
    "SHM_DIR",
    "BatchStream",
    "InlineAssembler",
    "ReceivedBatch",
    "ShmRing",
    "ShmStream",
    "ShmUnusable",
    "select_transport",
]

SHM_DIR: Final = Path("/dev/shm")
_QUEUE_POLL_S: Final = 0.5
_SHM_REMEDY: Final = (
    "run the trainer where it shares /dev/shm with the server (Kubernetes: the same pod with "
    "an emptyDir of medium Memory mounted at /dev/shm in both containers; docker: "
    "--ipc=container:<server> or one shared /dev/shm volume), or pass transport='auto' or "
    "'inline'"
)


@dataclass(frozen=True)
class ReceivedBatch:
    """One batch as it arrived: every field a NumPy view of where its bytes are."""

    index: int
    slot: int
    """The ring slot holding it (shm), -1 inline."""
    rows: int
    arrays: dict[str, npt.NDArray[Any]]
    """Field name → ``[rows, ...]`` view: into the slot (shm) or into ``owned`` bytes."""
    failed_sample_ids: tuple[int, ...]
    extent_bytes: int
    """Bytes from the start of the slot or inline buffer to the end of the last field."""
    offsets: dict[str, int]
    """Field name → byte offset from the start of the slot or inline buffer."""
    owned: bool
    """True when the bytes are a buffer of this batch alone (inline), not a ring slot."""
    memory: npt.NDArray[np.uint8]
    """The slot (shm) or inline buffer every field is a view of: it lives as long as any
    of them (NumPy points a view of a view at the first array)."""
    lease: int = 0
    """The slot's lease (shm), acked to give the slot back; 0 inline."""

    @property
    def ack_key(self) -> int:
        """What acknowledges this batch: its lease (shm) or its index (inline)."""
        return self.lease if not self.owned else self.index


class ShmUnusable(Exception):
    """The server's segment cannot be used from here; the message says why."""


_DTYPES: dict[str, np.dtype[Any]] = {}


def _views(
    buffer: npt.NDArray[np.uint8], base: int, limit: int, msg: loader_pb2.StreamBatchesResponse
) -> tuple[dict[str, npt.NDArray[Any]], dict[str, int], int]:
    """Every field of ``msg`` as a view of ``buffer[base : base + limit]``, checked to fit."""
    arrays: dict[str, npt.NDArray[Any]] = {}
    offsets: dict[str, int] = {}
    extent = 0
    for view in msg.fields:
        dtype = _DTYPES.get(view.dtype)
        if dtype is None:
            dtype = _DTYPES.setdefault(view.dtype, np.dtype(view.dtype))
        shape = tuple(view.shape)
        expected = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
        end = view.offset + view.nbytes
        if view.offset < 0 or end > limit or view.nbytes != expected or dtype.byteorder == ">":
            raise DataLoss(
                f"batch {msg.batch_index}: the server described field {view.name!r} as "
                f"{view.dtype}{list(shape)} at bytes {view.offset}..{end} of a {limit}-byte "
                "buffer, which does not fit; client and server disagree on the wire format "
                "(upgrade both to the same batchd version)"
            )
        start = base + view.offset
        arrays[view.name] = buffer[start : start + view.nbytes].view(dtype).reshape(shape)
        offsets[view.name] = view.offset
        extent = max(extent, end)
    return arrays, offsets, extent


class ShmRing:
    """The server's ring segment of one session, mapped into this process.

    Raises:
        ShmUnusable: (from :meth:`open`) it cannot be opened, or it is not the server's.
    """

    def __init__(self, layout: loader_pb2.RingLayout, mapping: mmap.mmap, writable: bool) -> None:
        self.layout = layout
        self.writable = writable
        """Mapped read-write (needed to register it with CUDA)."""
        self._mmap: mmap.mmap | None = mapping
        self.bytes: npt.NDArray[np.uint8] = np.frombuffer(mapping, dtype=np.uint8)
        """The whole segment; its ``.ctypes.data`` is the mapping's address."""
        self.doorbell: ClientDoorbell | None = None
        """The session's doorbell connection, once :func:`select_transport` made it."""

    @classmethod
    def open(cls, layout: loader_pb2.RingLayout, shm_dir: Path = SHM_DIR) -> ShmRing:
        """Map the segment ``layout`` names and check its token."""
        name = layout.shm_name
        if not name or "/" in name or name in (".", ".."):
            raise ShmUnusable(f"the server named no usable segment ({name!r})")
        if not layout.token:
            raise ShmUnusable("the server sent no token to check the segment against")
        path = shm_dir / name
        writable = True
        try:
            fd = os.open(path, os.O_RDWR | os.O_CLOEXEC)
        except PermissionError:
            # A segment shared through a group may be readable only; fine for CPU delivery.
            writable = False
            try:
                fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
            except OSError as e:
                raise ShmUnusable(f"cannot open {path}: {e.strerror}") from e
        except OSError as e:
            raise ShmUnusable(f"cannot open {path}: {e.strerror}") from e
        try:
            size = os.fstat(fd).st_size
            if size < layout.segment_bytes or layout.segment_bytes < len(layout.token):
                raise ShmUnusable(
                    f"{path} is {size} bytes, the server's segment is {layout.segment_bytes}: "
                    "a different file of the same name"
                )
            access = mmap.ACCESS_WRITE if writable else mmap.ACCESS_READ
            mapping = mmap.mmap(fd, layout.segment_bytes, access=access)
        except OSError as e:
            raise ShmUnusable(f"cannot map {path}: {e.strerror}") from e
        finally:
            os.close(fd)
        if mapping[: len(layout.token)] != layout.token:
            mapping.close()
            raise ShmUnusable(
                f"{path} does not start with the server's token: this client does not see the "
                "server's /dev/shm (another host or container)"
            )
        return cls(layout, mapping, writable)

    def batch(self, msg: loader_pb2.StreamBatchesResponse) -> ReceivedBatch:
        """The batch ``msg`` describes, as views of its slot."""
        layout = self.layout
        if not 0 <= msg.slot < layout.slots or self._mmap is None:
            raise DataLoss(
                f"batch {msg.batch_index} arrived in slot {msg.slot}, but the ring has "
                f"{layout.slots} slots; client and server disagree on the wire format"
            )
        # A slot-sized array of its own: every field view points at it, so it dies exactly
        # when the last view (or tensor) of the batch does (the lend path watches that).
        slot = np.frombuffer(
            self._mmap,
            dtype=np.uint8,
            count=layout.slot_bytes,
            offset=layout.header_bytes + msg.slot * layout.slot_bytes,
        )
        arrays, offsets, extent = _views(slot, 0, layout.slot_bytes, msg)
        return ReceivedBatch(
            index=msg.batch_index,
            slot=msg.slot,
            rows=msg.rows,
            arrays=arrays,
            failed_sample_ids=tuple(msg.failed_sample_ids),
            extent_bytes=extent,
            offsets=offsets,
            owned=False,
            memory=slot,
            lease=msg.lease,
        )

    def close(self) -> None:
        """Unmap, or leave the unmapping to the last zero-copy view still alive. Idempotent."""
        if self.doorbell is not None:
            self.doorbell.close()
        if self._mmap is None:
            return
        mapping, self._mmap = self._mmap, None
        self.bytes = np.empty(0, dtype=np.uint8)
        # A zero-copy batch the user still holds points into the mapping (close() raises
        # BufferError then); unmapping now would make touching it a segfault. The views
        # keep the mmap object alive, and it unmaps itself when the last one goes.
        with contextlib.suppress(BufferError):
            mapping.close()


def select_transport(
    requested: str, session: loader_pb2.OpenSessionResponse, shm_dir: Path = SHM_DIR
) -> tuple[loader_pb2.Transport, ShmRing | None, str]:
    """The transport to use for a session, its mapped ring (shm) and why it was chosen.

    Args:
        requested: ``"auto"``, ``"shm"`` or ``"inline"``.
        session: The server's answer to OpenSession (its ring and doorbell).
        shm_dir: Where the server's segments are.

    Raises:
        FailedPrecondition: ``"shm"`` was asked for and the segment cannot be used.
    """
    if requested == "inline":
        return loader_pb2.TRANSPORT_INLINE, None, "transport='inline' was asked for"
    layout = session.ring
    try:
        ring = ShmRing.open(layout, shm_dir)
        try:
            ring.doorbell = _connect_doorbell(layout, session.session_id, shm_dir)
        except BaseException:
            ring.close()
            raise
    except ShmUnusable as e:
        if requested == "shm":
            raise FailedPrecondition(
                f"transport='shm' cannot be used: {e}. To fix it, {_SHM_REMEDY}"
            ) from e
        return loader_pb2.TRANSPORT_INLINE, None, f"shm unusable ({e})"
    return loader_pb2.TRANSPORT_SHM, ring, "the server's segment is mapped"


def _connect_doorbell(
    layout: loader_pb2.RingLayout, session_id: str, shm_dir: Path
) -> ClientDoorbell:
    name = layout.doorbell
    if not name or "/" in name or name in (".", ".."):
        raise ShmUnusable(f"the server named no usable doorbell ({name!r})")
    try:
        return ClientDoorbell.connect(shm_dir / name, session_id, layout.token)
    except DoorbellRefused as e:
        raise ShmUnusable(str(e)) from e


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
            raise DataLoss(
                f"batch {head.batch_index}: inline chunks carry more than the announced "
                f"{len(self._buffer)} bytes; client and server disagree on the wire format"
            )
        self._buffer[self._filled : end] = np.frombuffer(msg.data, dtype=np.uint8)
        self._filled = end
        if msg.more:
            return None
        self._head = None
        if self._filled != len(self._buffer):
            raise DataLoss(
                f"batch {head.batch_index}: inline chunks carry {self._filled} of the announced "
                f"{len(self._buffer)} bytes"
            )
        arrays, offsets, extent = _views(self._buffer, 0, len(self._buffer), head)
        return ReceivedBatch(
            index=head.batch_index,
            slot=-1,
            rows=head.rows,
            arrays=arrays,
            failed_sample_ids=tuple(head.failed_sample_ids),
            extent_bytes=extent,
            offsets=offsets,
            owned=True,
            memory=self._buffer,
        )


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


class BatchStream:
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

    def ack(self, batch_indices: Sequence[int], wait_s: float) -> None:
        """Tell the server these batches arrived (each is a credit for one more)."""
        if batch_indices:
            ack = loader_pb2.Ack(batch_indices=batch_indices, wait_s=wait_s)
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

    def finish(self) -> None:
        """Half-close the requests and read the responses to their end (after the last batch).

        Raises:
            DataLoss: the server sent more batches than the epoch has.
            BatchdError: the call ended with an error.
        """
        self._pending.put(None)
        try:
            extra = self._next_message()
            if extra is not None:
                raise DataLoss(
                    f"the server sent batch {extra.batch_index} after the epoch's last batch; "
                    "client and server disagree on the epoch's plan"
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


class ShmStream:
    """One shm stream, run on the session's doorbell: start, batches, acks, end.

    The constructor waits for the server to accept the start, so a session the server
    forgot raises NotFound here, before any batch is awaited.

    Args:
        start: The stream's StreamStart (``seq`` and ``held_leases`` set).
        ring: The session's mapped ring, with its doorbell.

    Raises:
        BatchdError: the server refused the stream (NotFound when the session is gone).
    """

    def __init__(self, start: loader_pb2.StreamStart, *, ring: ShmRing) -> None:
        assert ring.doorbell is not None, "select_transport connects the doorbell"
        self._ring = ring
        self._bell = ring.doorbell
        self._seq = start.seq
        self._ended = False
        self._bell.send(START, start)
        try:
            kind, _ = self._next_frame()
        except Unavailable as e:
            # The server hangs up a session's doorbell when it closes the session (its lease
            # expired while the loop was busy elsewhere, say): the session is gone.
            raise NotFound(
                f"session {start.session_id} is gone (its doorbell is closed: {e})"
            ) from e
        if kind != ACCEPTED:
            raise DataLoss(
                f"the server answered a StreamStart with a frame of kind {kind!r}; client and "
                "server disagree on the wire format (upgrade both to the same batchd version)"
            )

    def _next_frame(self) -> tuple[int, Any]:
        """The next frame of this stream (others' are skipped); an error end raises."""
        while True:
            kind, payload = self._bell.read()
            if kind in (ACCEPTED, BATCH):
                msg: Any = parse(loader_pb2.StreamBatchesResponse, payload)
            elif kind == END:
                msg = parse(loader_pb2.DoorbellEnd, payload)
            else:
                raise DataLoss(
                    f"the doorbell sent a frame of kind {kind!r}; client and server disagree "
                    "on the wire format (upgrade both to the same batchd version)"
                )
            if msg.seq != self._seq:
                continue  # a frame of an earlier stream, still on its way when it ended
            if kind == END:
                self._ended = True
                if msg.error_class:
                    raise error_named(msg.error_class, msg.message)
            return kind, msg

    def ack(self, leases: Sequence[int], wait_s: float) -> None:
        """Give these slots back to the server (each is a credit for one more batch)."""
        self._bell.ack(list(leases), wait_s)

    def receive(self) -> ReceivedBatch | None:
        """The next batch of this stream; None when the server ended it.

        Raises:
            BatchdError: the stream failed (the server's error), the doorbell closed
                (Unavailable), or the server broke the wire format (DataLoss).
        """
        if self._ended:
            return None
        kind, msg = self._next_frame()
        if kind == BATCH:
            return self._ring.batch(msg)
        if kind == END:
            return None
        raise DataLoss("the server accepted an shm stream twice; client and server disagree")

    def finish(self) -> None:
        """Wait for the server's end of the stream after the epoch's last batch.

        Raises:
            DataLoss: the server sent more batches than the epoch has.
            BatchdError: the stream ended with an error.
        """
        while not self._ended:
            kind, msg = self._next_frame()
            if kind == BATCH:
                raise DataLoss(
                    f"the server sent batch {msg.batch_index} after the epoch's last batch; "
                    "client and server disagree on the epoch's plan"
                )

    def cancel(self) -> None:
        """Abandon the stream (the consumer stopped early). Idempotent."""
        if not self._ended:
            self._ended = True
            self._bell.send(CANCEL, loader_pb2.DoorbellCancel(seq=self._seq))
