"""The client's end of the doorbell: a session's frames beside its ring segment.

The protocol (frame kinds, the hello, heartbeats) is :mod:`batchd._wire.frames`; this module
is the connection a Loader's shm stream holds.
"""

from __future__ import annotations

import socket
import struct
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Final

from google.protobuf.message import Message

from batchd._proto.batchd.v1 import loader_pb2
from batchd._stats import MAX_PENDING_TIMINGS, BatchTiming
from batchd._wire.frames import (
    HELLO,
    HELLO_TIMEOUT_S,
    RELEASE,
    SILENT_HEARTBEATS,
    WELCOME,
    FrameReader,
    FrameWriter,
    encode_frame,
    parse,
)
from batchd.errors import DataLoss, Unavailable

__all__ = ["ClientDoorbell", "DoorbellRefused", "DoorbellSilent"]

_TIMEVAL: Final = struct.Struct("@ll")


class DoorbellRefused(Exception):
    """The doorbell cannot be used from here; the message says why."""


class DoorbellSilent(Unavailable):
    """No frame came from the server within a deadline: it is stopped, wedged or gone."""


class ClientDoorbell:
    """A session's connection to the server's doorbell (see the module docstring).

    Frames are read by the thread iterating the Loader only. Acks may also be sent from
    whichever thread drops the last tensor of a lent batch (a finalizer), so sending takes a
    lock; a finalizer that finds it taken queues its leases for the next send instead of
    waiting (it may be running inside that very send, on the same thread).
    """

    def __init__(
        self, sock: socket.socket, reader: FrameReader, path: Path, heartbeat_s: float = 0.0
    ) -> None:
        self.path = path
        self.heartbeat_s = heartbeat_s
        """The server's heartbeat interval (its WELCOME said); 0: it sends none."""
        self._reader = reader
        self._writer = FrameWriter(sock)
        self._wait_s: float | None = None
        """The receive timeout set on the socket now (None: none)."""
        self._silence_s = SILENT_HEARTBEATS * heartbeat_s if heartbeat_s > 0 else None
        self._queued: list[int] = []
        self._queue_lock = threading.Lock()
        self._timings: list[BatchTiming] = []
        """Batch timings not yet sent; they ride on the next frame that carries leases."""

    @property
    def closed(self) -> bool:
        return self._writer.closed

    @classmethod
    def connect(cls, path: Path, session_id: str, token: bytes) -> ClientDoorbell:
        """Connect to ``path`` and introduce ourselves as the client of ``session_id``.

        Raises:
            DoorbellRefused: nothing listens there, or the server refused the hello.
        """
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.settimeout(HELLO_TIMEOUT_S)
            try:
                sock.connect(str(path))
            except OSError as e:
                raise DoorbellRefused(
                    f"cannot connect to the doorbell {path}: {e.strerror or e}"
                ) from e
            hello = loader_pb2.DoorbellHello(session_id=session_id, token=token)
            reader = FrameReader(sock)
            try:
                sock.sendall(encode_frame(HELLO, hello.SerializeToString()))
                frame = reader.read()
            except (OSError, DataLoss) as e:
                raise DoorbellRefused(f"the doorbell {path} failed during the hello: {e}") from e
            if frame is None or frame[0] != WELCOME:
                raise DoorbellRefused(
                    f"the server at {path} refused the hello of session {session_id}"
                )
            welcome = parse(loader_pb2.DoorbellHeartbeat, frame[1])  # empty: an older server
            sock.settimeout(None)
        except BaseException:
            sock.close()
            raise
        return cls(sock, reader, path, max(welcome.interval_s, 0.0))

    def read(self, deadline: float | None = None) -> tuple[int, bytes]:
        """The next frame from the server (heartbeats included).

        Args:
            deadline: ``time.monotonic()`` by which a frame must have come, else
                DoorbellSilent; besides, a server that promised heartbeats must send a frame
                within :data:`SILENT_HEARTBEATS` intervals.

        Raises:
            DoorbellSilent: no frame within the deadline or the heartbeat window.
            Unavailable: the server closed the connection (it stopped, died or closed the
                session).
            DataLoss: a malformed frame.
        """
        wait_s = self._silence_s
        if deadline is not None:
            left = max(deadline - time.monotonic(), 0.001)
            wait_s = left if wait_s is None else min(wait_s, left)
        self._set_wait(wait_s)
        try:
            frame = self._reader.read()
        except (BlockingIOError, TimeoutError) as e:  # SO_RCVTIMEO ran out
            if deadline is not None and time.monotonic() >= deadline:
                raise DoorbellSilent(
                    f"the batchd server sent nothing on its doorbell {self.path} in time "
                    "(see timeout_s); it may be overloaded or wedged"
                ) from e
            raise DoorbellSilent(
                f"the batchd server sent nothing on its doorbell {self.path} for "
                f"{self._silence_s:g} s, though it promised a heartbeat every "
                f"{self.heartbeat_s:g} s: it is stopped, wedged or its machine is frozen"
            ) from e
        except OSError as e:
            raise Unavailable(
                f"the batchd server's doorbell {self.path} failed: {e.strerror or e}; the "
                "server may have stopped. Create a new Loader and "
                "load_state_dict(old.state_dict()) to resume"
            ) from e
        if frame is None:
            raise Unavailable(
                f"the batchd server closed the doorbell {self.path}: it stopped, or closed "
                "this session. Create a new Loader and load_state_dict(old.state_dict()) "
                "to resume"
            )
        return frame

    def _set_wait(self, wait_s: float | None) -> None:
        """Make a blocking receive give up after ``wait_s`` (None: never); a system call
        only when it changes."""
        if wait_s == self._wait_s:
            return
        seconds = 0.0 if wait_s is None else max(wait_s, 0.001)  # 0: wait forever
        whole = int(seconds)
        try:
            self._writer.sock.setsockopt(
                socket.SOL_SOCKET,
                socket.SO_RCVTIMEO,
                _TIMEVAL.pack(whole, int((seconds - whole) * 1e6)),
            )
        except OSError:  # closed: the read that follows says so
            return
        self._wait_s = wait_s

    def send(self, kind: int, message: Message) -> None:
        """Send one frame (from the iterating thread); silent once closed (reads tell why)."""
        self._writer.send(kind, message)

    def ack(self, leases: list[int], timings: Sequence[BatchTiming] = ()) -> None:
        """Give these slots back, with anything queued by finalizers; silent once closed.

        ``timings`` (each batch's wait and step, for the server's metrics) ride along with
        the next frame that carries leases: lent batches go back from their finalizers, and
        a frame for the timings alone would double the frames per batch.
        """
        with self._writer.lock:
            self._add_timings(timings)
            self._send_ack_locked(leases)

    def flush(self, timings: Sequence[BatchTiming] = ()) -> None:
        """Send the pending batch timings now, with no leases if none are queued (the end
        of a stream: nothing else may go out for a while)."""
        with self._writer.lock:
            self._add_timings(timings)
            self._send_ack_locked([], force=bool(self._timings))

    def _add_timings(self, timings: Sequence[BatchTiming]) -> None:
        room = MAX_PENDING_TIMINGS - len(self._timings)
        self._timings.extend(timings[:room])

    def release(self, leases: list[int]) -> None:
        """Give these slots back from any thread, at once when the socket is free."""
        if not self._writer.lock.acquire(blocking=False):
            with self._queue_lock:
                self._queued.extend(leases)
            return
        try:
            self._send_ack_locked(leases)
        finally:
            self._writer.lock.release()

    def _send_ack_locked(self, leases: list[int], *, force: bool = False) -> None:
        """Send ``leases`` and the queued ones, with the wait so far; under the send lock."""
        with self._queue_lock:
            if self._queued:
                leases = [*self._queued, *leases]
                self._queued.clear()
        if leases or force:
            timings, self._timings = self._timings, []
            ack = loader_pb2.Ack(
                leases=leases,
                wait_s=sum(t.wait_s for t in timings),
                batch_wait_s=[t.wait_s for t in timings],
                batch_step_s=[t.step_s for t in timings],
            )
            self._writer.send_locked(RELEASE, ack)

    def close(self) -> None:
        """Idempotent. The server frees the session's slots when it closes the session."""
        self._writer.hang_up()
        self._writer.sock.close()
