"""The ``shm`` transport: batches in the server's shared-memory ring, news on the doorbell.

The server writes each batch into a slot of a shared-memory segment (laid out as
``batchd._wire.ring`` says) and tells the client, on the session's doorbell socket
(``doorbell.py``), where its fields are and under which lease; the client maps the segment
once per session, reads the slot in place, and gives the slot back by acking the lease.
The segment starts with a token the server also sends in ``RingLayout.token``: a client that
reads the same bytes there has the server's segment (same host, same ``/dev/shm``), not a
same-named file of another machine or container.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Final

import numpy as np
import numpy.typing as npt

from batchd._proto.batchd.v1 import loader_pb2
from batchd._stats import BatchTiming
from batchd._transport.doorbell import ClientDoorbell, DoorbellSilent
from batchd._transport.stream import BatchStream, HeldSlots, ReceivedBatch
from batchd._wire.frames import ACCEPTED, BATCH, CANCEL, END, HEARTBEAT, START, parse
from batchd._wire.ring import slot_offset
from batchd._wire.status import disagreement, error_named
from batchd.errors import NotFound, Unavailable

__all__ = ["SHM_DIR", "ShmRing", "ShmStream", "ShmTransport", "ShmUnusable"]

SHM_DIR: Final = Path("/dev/shm")


class ShmUnusable(Exception):
    """The server's segment cannot be used from here; the message says why."""


class ShmRing:
    """The server's ring segment of one session, mapped into this process.

    Raises:
        ShmUnusable: (from :meth:`open`) it cannot be opened, or it is not the server's.
    """

    def __init__(
        self,
        layout: loader_pb2.RingLayout,
        mapping: mmap.mmap,
        writable: bool,
        shm_dir: Path = SHM_DIR,
    ) -> None:
        self.layout = layout
        self._dir = shm_dir
        self.writable = writable
        """Mapped read-write (needed to register it with CUDA)."""
        self._mmap: mmap.mmap | None = mapping
        self.bytes: npt.NDArray[np.uint8] = np.frombuffer(mapping, dtype=np.uint8)
        """The whole segment; its ``.ctypes.data`` is the mapping's address."""
        self.doorbell: ClientDoorbell | None = None
        """The session's doorbell connection, once ``select_transport`` made it."""
        self._borrowed: dict[str, ShmRing] = {}
        """Other sessions' rings this session's share group lent slots of, by name."""

    @classmethod
    def open(
        cls, layout: loader_pb2.RingLayout, shm_dir: Path = SHM_DIR, *, read_only: bool = False
    ) -> ShmRing:
        """Map the segment ``layout`` names and check its token; ``read_only``: map it so,
        whatever the file allows (another session's ring, whose batches others read too)."""
        name = layout.shm_name
        if not name or "/" in name or name in (".", ".."):
            raise ShmUnusable(f"the server named no usable segment ({name!r})")
        if not layout.token:
            raise ShmUnusable("the server sent no token to check the segment against")
        path = shm_dir / name
        writable = not read_only
        try:
            fd = os.open(path, (os.O_RDWR if writable else os.O_RDONLY) | os.O_CLOEXEC)
        except PermissionError:
            if not writable:
                raise ShmUnusable(f"cannot open {path}: permission denied") from None
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
        return cls(layout, mapping, writable, shm_dir)

    def batch(self, msg: loader_pb2.StreamBatchesResponse) -> ReceivedBatch:
        """The batch ``msg`` describes, as views of its slot: in this ring, or in another
        member's of the session's share group (``msg.ring``, mapped on first use).

        Raises:
            DataLoss: the slot is not in the ring, or the other ring cannot be mapped.
        """
        if msg.HasField("ring"):
            return self._lent_ring(msg.ring).batch_here(msg, borrowed=True)
        return self.batch_here(msg, borrowed=False)

    def _lent_ring(self, layout: loader_pb2.RingLayout) -> ShmRing:
        ring = self._borrowed.get(layout.shm_name)
        if ring is not None and ring.layout.token != layout.token:
            ring.close()  # a later ring of the same name (the server restarted)
            ring = None
        if ring is None:
            try:
                # Read-only: the owner's client and every other reader read the same bytes,
                # so no client may write them (a write raises, as on any read-only array).
                ring = ShmRing.open(layout, self._dir, read_only=True)
            except ShmUnusable as e:
                raise disagreement(
                    f"the server lent a slot of another session's ring, which this client "
                    f"cannot map: {e}"
                ) from e
            self._borrowed[layout.shm_name] = ring
        return ring

    def forget_borrowed(self) -> None:
        """Unmap the other sessions' rings (each once the last view of it is gone): a
        stream starts, and maps again those it is lent slots of."""
        borrowed, self._borrowed = self._borrowed, {}
        for ring in borrowed.values():
            ring.close()

    def batch_here(self, msg: loader_pb2.StreamBatchesResponse, *, borrowed: bool) -> ReceivedBatch:
        """The batch ``msg`` describes, as views of its slot in this ring."""
        layout = self.layout
        if not 0 <= msg.slot < layout.slots or self._mmap is None:
            raise disagreement(
                f"batch {msg.batch_index} arrived in slot {msg.slot}, but the ring has "
                f"{layout.slots} slots"
            )
        # A slot-sized array of its own: every field view points at it, so it dies exactly
        # when the last view (or tensor) of the batch does (the lend path watches that).
        slot = np.frombuffer(
            self._mmap,
            dtype=np.uint8,
            count=layout.slot_bytes,
            offset=slot_offset(msg.slot, layout.slot_bytes, layout.header_bytes),
        )
        return ReceivedBatch.viewing(slot, msg, inline=False, borrowed=borrowed)

    def close(self) -> None:
        """Unmap, or leave the unmapping to the last zero-copy view still alive. Idempotent."""
        if self.doorbell is not None:
            self.doorbell.close()
        self.forget_borrowed()
        if self._mmap is None:
            return
        mapping, self._mmap = self._mmap, None
        self.bytes = np.empty(0, dtype=np.uint8)
        # A zero-copy batch the user still holds points into the mapping (close() raises
        # BufferError then); unmapping now would make touching it a segfault. The views
        # keep the mmap object alive, and it unmaps itself when the last one goes.
        with contextlib.suppress(BufferError):
            mapping.close()


class ShmStream:
    """One shm stream, run on the session's doorbell: start, batches, acks, end.

    The constructor waits (up to ``accept_timeout_s``) for the server to accept the start, so
    a session the server forgot raises NotFound here, before any batch is awaited. The
    stream asks for heartbeats: while it waits for a batch, a server silent for a few of its
    heartbeat intervals raises Unavailable (see ``doorbell.py``).

    Args:
        start: The stream's StreamStart (``seq`` and ``held_leases`` set).
        ring: The session's mapped ring, with its doorbell.
        accept_timeout_s: How long the server may take to accept the start.

    Raises:
        BatchdError: the server refused the stream (NotFound when the session is gone),
            or did not accept it in time (Unavailable).
    """

    def __init__(
        self, start: loader_pb2.StreamStart, *, ring: ShmRing, accept_timeout_s: float = 30.0
    ) -> None:
        assert ring.doorbell is not None, "select_transport connects the doorbell"
        self._ring = ring
        self._bell = ring.doorbell
        self._seq = start.seq
        self._ended = False
        start.heartbeat = True
        self._bell.send(START, start)
        try:
            kind, _ = self._next_frame(deadline=time.monotonic() + accept_timeout_s)
        except DoorbellSilent as e:
            raise DoorbellSilent(
                f"the batchd server did not accept the stream of session {start.session_id} "
                f"within {accept_timeout_s:g} s (timeout_s): {e}"
            ) from e
        except Unavailable as e:
            # The server hangs up a session's doorbell when it closes the session (its lease
            # expired while the loop was busy elsewhere, say): the session is gone.
            raise NotFound(
                f"session {start.session_id} is gone (its doorbell is closed: {e})"
            ) from e
        if kind != ACCEPTED:
            raise disagreement(f"the server answered a StreamStart with a frame of kind {kind!r}")

    def _next_frame(self, deadline: float | None = None) -> tuple[int, Any]:
        """The next frame of this stream (others' and heartbeats are skipped); an error end
        raises."""
        while True:
            kind, payload = self._bell.read(deadline)
            if kind == HEARTBEAT:
                continue
            if kind in (ACCEPTED, BATCH):
                msg: Any = parse(loader_pb2.StreamBatchesResponse, payload)
            elif kind == END:
                msg = parse(loader_pb2.DoorbellEnd, payload)
            else:
                raise disagreement(f"the doorbell sent a frame of kind {kind!r}")
            if msg.seq != self._seq:
                continue  # a frame of an earlier stream, still on its way when it ended
            if kind == END:
                self._ended = True
                if msg.error_class:
                    raise error_named(msg.error_class, msg.message)
            return kind, msg

    def ack(self, keys: Sequence[int], timings: Sequence[BatchTiming]) -> None:
        """Give the slots of these leases back (each is a credit for one more batch)."""
        self._bell.ack(list(keys), timings)

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
        raise disagreement("the server accepted an shm stream twice")

    def finish(self, timings: Sequence[BatchTiming]) -> None:
        """Send the pending timings, then wait for the server's end of the stream after the
        epoch's last batch.

        Raises:
            DataLoss: the server sent more batches than the epoch has.
            BatchdError: the stream ended with an error.
        """
        self._bell.flush(timings)
        while not self._ended:
            kind, msg = self._next_frame()
            if kind == BATCH:
                raise disagreement(
                    f"the server sent batch {msg.batch_index} after the epoch's last batch",
                    on="the epoch's plan",
                )

    def cancel(self) -> None:
        """Abandon the stream (the consumer stopped early). Idempotent."""
        if not self._ended:
            self._ended = True
            self._bell.send(CANCEL, loader_pb2.DoorbellCancel(seq=self._seq))


class ShmTransport:
    """The shm transport of one session: its mapped ring and doorbell, and the streams
    started on them (each ``StreamStart.seq`` one more than the last: the doorbell refuses
    an older one).

    Args:
        ring: The session's ring, its doorbell connected.
        reason: Why shm was chosen, for the log.
    """

    name: Final = "shm"
    kind: Final = loader_pb2.TRANSPORT_SHM

    def __init__(self, ring: ShmRing, reason: str) -> None:
        assert ring.doorbell is not None, "select_transport connects the doorbell"
        self.ring: Final = ring
        self.reason = reason
        self._streams = 0

    def open_stream(
        self, start: loader_pb2.StreamStart, *, held: HeldSlots, timeout_s: float
    ) -> BatchStream:
        """Start ``start``'s stream on the doorbell; it holds the slots ``held`` still
        owns, and may be lent another session's if ``held`` reads them.

        Raises:
            BatchdError: the server refused the stream (NotFound when the session is gone),
                or did not accept it within ``timeout_s``.
        """
        self._streams += 1
        start.seq = self._streams
        start.held_leases.extend(held.lent())
        start.read_shared = held.reads_shared
        self.ring.forget_borrowed()
        return ShmStream(start, ring=self.ring, accept_timeout_s=timeout_s)

    def close(self) -> None:
        """Hang up the doorbell and unmap the ring (see :meth:`ShmRing.close`). Idempotent."""
        self.ring.close()
