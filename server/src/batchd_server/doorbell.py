"""The server's end of the doorbell: shm streams' batch notices out, slot acks in.

The protocol and the reason for it are in the client's ``batchd/_doorbell.py``. Here: one
listening unix socket per server instance, beside its segments in the shm directory
(``batchd-<instance>-bell-<random>``, mode 0600, so only who may open the segments may
connect, and a sweep removes it with the segments of a dead instance). Each connection says
hello for one session, proving with the ring's token that it mapped the segment, and then
gets a thread that applies its acks. Batch notices are written by the stream's RPC thread.
"""

from __future__ import annotations

import contextlib
import hmac
import logging
import os
import socket
import threading
from pathlib import Path
from typing import TYPE_CHECKING, Final

from batchd._doorbell import (
    BATCH,
    END,
    HELLO,
    RELEASE,
    WELCOME,
    FrameReader,
    encode_frame,
    parse,
)
from batchd._proto.batchd.v1 import loader_pb2 as pb
from batchd.errors import BatchdError
from batchd_server import metrics
from batchd_server.errors import FailedPrecondition, NotFound

if TYPE_CHECKING:
    from batchd_server.sessions import SessionManager

__all__ = ["DoorbellServer", "ServerBell"]

logger = logging.getLogger(__name__)

_HELLO_TIMEOUT_S: Final = 10.0
_MAX_UNIX_PATH_BYTES: Final = 107


class ServerBell:
    """One client's doorbell connection, attached to its session."""

    def __init__(self, sock: socket.socket) -> None:
        self._sock = sock
        self._lock = threading.Lock()
        self.closed = False

    def send(self, kind: int, message: pb.StreamBatchesResponse) -> bool:
        """Send one frame; False when the client is gone (the connection failed)."""
        frame = encode_frame(kind, message.SerializeToString())
        with self._lock:
            if self.closed:
                return False
            try:
                self._sock.sendall(frame)
            except OSError:
                self.closed = True
                return False
        return True

    def send_batch(self, message: pb.StreamBatchesResponse) -> bool:
        return self.send(BATCH, message)

    def send_end(self, seq: int) -> bool:
        return self.send(END, pb.StreamBatchesResponse(seq=seq))

    def close(self) -> None:
        """Hang up (the client's next read fails); the reader thread then ends. Idempotent."""
        self.closed = True
        with contextlib.suppress(OSError):
            self._sock.shutdown(socket.SHUT_RDWR)


class DoorbellServer:
    """The listening socket and one thread per connection.

    Raises:
        FailedPrecondition: (constructor) the socket cannot be created in the shm directory.
    """

    def __init__(self, path: Path, sessions: SessionManager) -> None:
        self.path = path
        self._sessions = sessions
        self._listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        if len(str(path).encode()) > _MAX_UNIX_PATH_BYTES:
            self._listener.close()
            raise FailedPrecondition(
                f"the shm directory {path.parent} is too long a path for the doorbell socket "
                f"{path.name} (unix socket paths have at most {_MAX_UNIX_PATH_BYTES} bytes); "
                "use a shorter BATCHD_SHM_DIR"
            )
        try:
            self._listener.bind(str(path))
            # Before listen(): until then nobody can connect, so no one slips in before the
            # mode is right.
            os.chmod(path, 0o600)
            self._listener.listen(64)
        except OSError as e:
            self._listener.close()
            with contextlib.suppress(OSError):
                path.unlink()
            raise FailedPrecondition(
                f"cannot listen on the doorbell socket {path}: {e.strerror or e}; the shm "
                "directory must allow unix sockets (tmpfs does)"
            ) from e
        self._lock = threading.Lock()
        self._connections: set[socket.socket] = set()
        self._threads: set[threading.Thread] = set()
        self._closed = False
        self._acceptor = threading.Thread(target=self._accept, name="batchd-bell", daemon=True)
        self._acceptor.start()

    @property
    def name(self) -> str:
        """The socket's file name, as ``RingLayout.doorbell`` gives it to clients."""
        return self.path.name

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self._listener.accept()
            except OSError:
                return  # closed
            with self._lock:
                if self._closed:
                    conn.close()
                    return
                self._connections.add(conn)
                thread = threading.Thread(
                    target=self._serve, args=(conn,), name="batchd-bell-conn", daemon=True
                )
                self._threads.add(thread)
            thread.start()

    def _serve(self, conn: socket.socket) -> None:
        bell: ServerBell | None = None
        session = None
        try:
            reader = FrameReader(conn)
            conn.settimeout(_HELLO_TIMEOUT_S)
            frame = reader.read()
            if frame is None or frame[0] != HELLO:
                logger.warning("doorbell: a connection did not start with a hello; closed")
                return
            hello = parse(pb.DoorbellHello, frame[1])
            try:
                session = self._sessions.get(hello.session_id)
            except NotFound:
                logger.info("doorbell: hello for unknown session %r; closed", hello.session_id)
                return
            if not hmac.compare_digest(hello.token, session.token):
                logger.warning(
                    "doorbell: hello for session %s with the wrong token; closed", session.id
                )
                return
            conn.settimeout(None)
            bell = ServerBell(conn)
            session.attach_bell(bell)
            conn.sendall(encode_frame(WELCOME))
            while True:
                frame = reader.read()
                if frame is None:
                    return
                kind, payload = frame
                if kind != RELEASE:
                    logger.warning(
                        "doorbell: session %s sent a frame of kind %r; closed", session.id, kind
                    )
                    return
                ack = parse(pb.Ack, payload)
                session.release(list(ack.leases))
                if ack.wait_s > 0:
                    metrics.CLIENT_WAIT_SECONDS.inc(ack.wait_s)
        except (OSError, BatchdError) as e:
            logger.debug("doorbell connection ended: %s", e)
        finally:
            if bell is not None and session is not None:
                session.detach_bell(bell)
                bell.close()
            with self._lock:
                self._connections.discard(conn)
                self._threads.discard(threading.current_thread())
            conn.close()

    def close(self) -> None:
        """Stop accepting, hang up every connection, remove the socket file. Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            connections = list(self._connections)
            threads = list(self._threads)
        with contextlib.suppress(OSError):
            self._listener.shutdown(socket.SHUT_RDWR)
        self._listener.close()
        with contextlib.suppress(OSError):
            self.path.unlink()
        for conn in connections:
            with contextlib.suppress(OSError):
                conn.shutdown(socket.SHUT_RDWR)
        self._acceptor.join(5.0)
        for thread in threads:
            thread.join(5.0)
