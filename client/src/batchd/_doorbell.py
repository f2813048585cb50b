"""The doorbell: the small-message channel of shm streams, beside the ring segment.

An shm batch is a few hundred bytes of news ("batch k is in slot s") and, back, an ack. As a
gRPC message each way, that news costs the client about a millisecond of CPU per batch on a
2-core machine: gRPC Python hands every message between several threads (about 25 context
switches per batch, measured in ``bench/README.md``), and a new call per epoch costs
several more. A server therefore also listens on a unix socket in the directory of its
segments, and a client that maps a session's ring connects there once per session. Its shm
streams then run entirely as frames on that socket: one ``send`` and one ``recv`` per batch,
on the thread that needs them. gRPC keeps opening and closing sessions, the catalog, and
inline streams.

A frame is a 4-byte little-endian payload length, one kind byte and a protobuf payload:

====  ==================  =======================================================
kind  direction           payload
====  ==================  =======================================================
H     client -> server    ``DoorbellHello`` (session id and ring token); first frame
W     server -> client    ``DoorbellHeartbeat``: the hello was accepted; the heartbeat interval
S     client -> server    ``StreamStart`` (``seq``, ``held_leases``): start a stream
A     server -> client    ``StreamBatchesResponse`` (``accepted``, ``seq``): it started
B     server -> client    ``StreamBatchesResponse``: a batch is in a slot (``lease``)
R     client -> server    ``Ack`` with ``leases``: these slots may be reused
C     client -> server    ``DoorbellCancel``: stop the stream of ``seq``
E     server -> client    ``DoorbellEnd``: the stream of ``seq`` is over (or failed)
K     server -> client    ``DoorbellHeartbeat``: nothing else to say for an interval
====  ==================  =======================================================

Every wait has a deadline. The hello is answered within :data:`HELLO_TIMEOUT_S`; a stream's
start is accepted within the Loader's ``timeout_s``; and while a stream runs (and asked for
heartbeats, ``StreamStart.heartbeat``), a server that has nothing to send for the interval
its WELCOME announced sends a heartbeat. A client that waits for a frame and hears nothing
for :data:`SILENT_HEARTBEATS` intervals treats the server as gone (stopped, wedged, its
machine frozen): :class:`DoorbellSilent`, an ``Unavailable``, which sends the Loader down its
reconnect path instead of blocking forever. The wait is the kernel's (``SO_RCVTIMEO``), so
it costs no extra system call per batch.

Both packages use this module: the framing is defined once.
"""

from __future__ import annotations

import contextlib
import select
import socket
import struct
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Final, TypeVar

from google.protobuf.message import DecodeError, Message

from batchd._proto.batchd.v1 import loader_pb2
from batchd._stats import MAX_PENDING_TIMINGS, BatchTiming
from batchd._status import disagreement
from batchd.errors import DataLoss, Unavailable

__all__ = [
    "ACCEPTED",
    "BATCH",
    "CANCEL",
    "END",
    "HEARTBEAT",
    "HELLO",
    "HELLO_TIMEOUT_S",
    "MAX_FRAME_BYTES",
    "RELEASE",
    "SILENT_HEARTBEATS",
    "START",
    "WELCOME",
    "ClientDoorbell",
    "DoorbellRefused",
    "DoorbellSilent",
    "FrameReader",
    "FrameWriter",
    "encode_frame",
    "parse",
]

HELLO: Final = ord("H")
WELCOME: Final = ord("W")
START: Final = ord("S")
ACCEPTED: Final = ord("A")
BATCH: Final = ord("B")
RELEASE: Final = ord("R")
CANCEL: Final = ord("C")
END: Final = ord("E")
HEARTBEAT: Final = ord("K")
MAX_FRAME_BYTES: Final = 64 << 20
"""Far above any real frame (a batch's failed ids at most); a longer one is a broken peer."""
_HEADER: Final = struct.Struct("<IB")
_RECV_BYTES: Final = 1 << 16
HELLO_TIMEOUT_S: Final = 10.0
"""How long either end waits for the other's side of the hello, in seconds."""
SILENT_HEARTBEATS: Final = 4
"""A server that sent no frame for this many heartbeat intervals while the client waited is
gone. Four: the server looks every half interval, so a live one leaves gaps of 1.5 at most."""
_TIMEVAL: Final = struct.Struct("@ll")
_M = TypeVar("_M", bound=Message)


def encode_frame(kind: int, payload: bytes = b"") -> bytes:
    return _HEADER.pack(len(payload), kind) + payload


class FrameReader:
    """Frames from a stream socket; several per ``recv`` when the peer is ahead."""

    def __init__(self, sock: socket.socket, *, max_frame_bytes: int = MAX_FRAME_BYTES) -> None:
        self._sock = sock
        self._buffer = bytearray()
        self._max_frame_bytes = max_frame_bytes

    def read(self) -> tuple[int, bytes] | None:
        """The next frame's kind and payload, blocking; None once the peer closed.

        Raises:
            DataLoss: the peer sent a frame longer than the reader's limit, or closed the
                connection in the middle of one.
            OSError: the socket failed.
        """
        buffer = self._buffer
        while True:
            if len(buffer) >= _HEADER.size:
                length, kind = _HEADER.unpack_from(buffer)
                if length > self._max_frame_bytes:
                    raise DataLoss(
                        f"a doorbell frame of {length} bytes is announced, more than "
                        f"{self._max_frame_bytes}; the peer does not speak batchd's doorbell "
                        "protocol"
                    )
                end = _HEADER.size + length
                if len(buffer) >= end:
                    payload = bytes(buffer[_HEADER.size : end])
                    del buffer[:end]
                    return kind, payload
            data = self._sock.recv(_RECV_BYTES)
            if not data:
                if buffer:
                    raise DataLoss("the doorbell connection closed in the middle of a frame")
                return None
            buffer += data


def parse(message: type[_M], payload: bytes) -> _M:
    """``payload`` as a ``message``; DataLoss when it is not one."""
    try:
        return message.FromString(payload)
    except DecodeError as e:
        raise disagreement(f"a doorbell frame does not hold a {message.__name__}: {e}") from e


class DoorbellRefused(Exception):
    """The doorbell cannot be used from here; the message says why."""


class DoorbellSilent(Unavailable):
    """No frame came from the server within a deadline: it is stopped, wedged or gone."""


class FrameWriter:
    """Frames onto a socket from several threads; ``closed`` once a send failed or it hung up.

    A failed send means the peer is gone: it is not raised, because the reading side learns
    it too, with the whole story (EOF), and the sender has nothing better to do.
    """

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.lock = threading.Lock()
        self.closed = False

    def send(self, kind: int, message: Message) -> bool:
        """Send one frame; False when the connection is closed or the send failed."""
        with self.lock:
            return self.send_locked(kind, message)

    def try_send(self, kind: int, message: Message) -> bool:
        """Send one small frame only if that cannot block: the lock is free and the socket
        has room; False otherwise (or when the connection is closed)."""
        if not self.lock.acquire(blocking=False):
            return False
        try:
            if self.closed:
                return False
            try:
                _, writable, _ = select.select([], [self.sock], [], 0)
            except (OSError, ValueError):  # closed meanwhile
                return False
            return bool(writable) and self.send_locked(kind, message)
        finally:
            self.lock.release()

    def send_locked(self, kind: int, message: Message) -> bool:
        """:meth:`send` for a caller that holds ``lock``."""
        if self.closed:
            return False
        try:
            self.sock.sendall(encode_frame(kind, message.SerializeToString()))
        except OSError:
            self.closed = True
            return False
        return True

    def hang_up(self) -> None:
        """Shut the socket down both ways (the peer's read ends); idempotent."""
        self.closed = True
        with contextlib.suppress(OSError):
            self.sock.shutdown(socket.SHUT_RDWR)


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
