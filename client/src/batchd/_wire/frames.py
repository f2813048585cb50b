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

The framing is defined here once; the server's end is ``batchd_server.delivery.doorbell``,
the client's ``batchd._transport.doorbell``.
"""

from __future__ import annotations

import contextlib
import select
import socket
import struct
import threading
from typing import Final, TypeVar

from google.protobuf.message import DecodeError, Message

from batchd._wire.status import disagreement
from batchd.errors import DataLoss

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
