"""The server's end of the doorbell, where shm streams run: starts and acks in, batches out.

The protocol and the reason for it are in the client's ``batchd/_doorbell.py``. Here: one
listening unix socket per server instance, beside its segments in the shm directory
(``batchd-<instance>-bell-<random>``, mode 0600, so only who may open the segments may
connect, and a sweep removes it with the segments of a dead instance). Each connection says
hello for one session, proving with the ring's token that it mapped the segment, and then
gets a thread that reads its frames: acks are applied at once, a StreamStart starts a
thread that streams the epoch's batch notices, a cancel ends that stream. A connection that
closes (the client exited or died) ends its stream; the session's lease does the rest.

Heartbeats: the WELCOME frame announces ``heartbeat_s`` (a ``DoorbellHeartbeat``), and while
a stream that asked for them (``StreamStart.heartbeat``) runs, one thread of the server sends
a heartbeat frame on each doorbell that sent nothing for that long. A batch that takes
minutes (a slow decode, a hung one waiting for its deadline) is then still news to the
client that the server is there; silence for several intervals means the server is stopped
or wedged, and the client reconnects instead of blocking forever.
"""

from __future__ import annotations

import contextlib
import hmac
import logging
import os
import socket
import threading
import time
from pathlib import Path

from google.protobuf.message import Message

from batchd._proto.batchd.v1 import loader_pb2 as pb
from batchd._wire.frames import (
    ACCEPTED,
    BATCH,
    CANCEL,
    END,
    HEARTBEAT,
    HELLO,
    HELLO_TIMEOUT_S,
    RELEASE,
    START,
    WELCOME,
    FrameReader,
    FrameWriter,
    encode_frame,
    parse,
)
from batchd._wire.status import status_name_for
from batchd.errors import BatchdError
from batchd_server import metrics
from batchd_server.delivery.messages import shm_notice
from batchd_server.errors import FailedPrecondition, InvalidArgument, NotFound
from batchd_server.limits import MAX_CLIENT_FRAME_BYTES, MAX_UNIX_PATH_BYTES
from batchd_server.logs import session_log_id
from batchd_server.sessions import Session, SessionManager, Stream

__all__ = ["DoorbellServer", "ServerBell"]

logger = logging.getLogger(__name__)


class ServerBell:
    """One client's doorbell connection, attached to its session, and its streams."""

    def __init__(self, sock: socket.socket, session: Session) -> None:
        self._writer = FrameWriter(sock)
        self._session = session
        self._lock = threading.Lock()
        self._streams: dict[int, Stream] = {}
        """seq -> running stream (normally one: a new start ends the previous)."""
        self._cancelled: set[int] = set()
        self._last_sent = time.monotonic()
        self._heartbeats = 0
        """Streams running (or starting) that asked for heartbeats."""

    @property
    def closed(self) -> bool:
        return self._writer.closed

    def send(self, kind: int, message: Message) -> bool:
        """Send one frame; False when the client is gone (the connection failed)."""
        sent = self._writer.send(kind, message)
        self._last_sent = time.monotonic()
        return sent

    def heartbeat(self, interval_s: float, now: float) -> None:
        """Send a heartbeat if a stream that wants them runs and nothing went out for
        ``interval_s``; never waits (a client too busy to read has frames to read anyway)."""
        with self._lock:
            wanted = self._heartbeats > 0
        if not wanted or now - self._last_sent < interval_s:
            return
        if self._writer.try_send(HEARTBEAT, pb.DoorbellHeartbeat(interval_s=interval_s)):
            self._last_sent = now

    def start(self, start: pb.StreamStart) -> None:
        """Run the stream ``start`` asks for in a thread of its own."""
        if start.heartbeat:
            with self._lock:
                self._heartbeats += 1
        thread = threading.Thread(
            target=self._stream, args=(start,), name="batchd-bell-stream", daemon=True
        )
        thread.start()

    def _stream(self, start: pb.StreamStart) -> None:
        session, seq = self._session, start.seq
        stream = None
        end = pb.DoorbellEnd(seq=seq)
        try:
            if start.session_id and start.session_id != session.id:
                raise InvalidArgument(
                    f"StreamStart for session {start.session_id} on the doorbell of {session.id}"
                )
            stream = session.start_stream(
                start.epoch,
                start.start_batch,
                start_sample=start.start_sample,
                order_world_size=start.order_world_size,
                held_leases=start.held_leases,
                stride=start.stride,
            )
            with self._lock:
                cancelled = seq in self._cancelled
                self._streams[seq] = stream
            if cancelled or not self.send(
                ACCEPTED, pb.StreamBatchesResponse(accepted=True, seq=seq)
            ):
                return
            for ready in session.batches(stream, lambda: not self.closed):
                if not self.send(BATCH, shm_notice(ready, seq)):
                    return  # the client hung up; its session's lease takes it from here
        except Exception as e:
            mapped = status_name_for(e)
            if mapped is None:
                logger.exception("session %s: stream %d failed", session_log_id(session.id), seq)
                end.error_class = "BatchdError"
                end.message = (
                    f"internal error in batchd-server ({type(e).__name__}: {e}); see its log"
                )
            else:
                end.error_class, end.message = mapped[1], str(e)
        finally:
            if stream is not None:
                session.end_stream(stream)
            with self._lock:
                self._streams.pop(seq, None)
                self._cancelled.discard(seq)
                if start.heartbeat:
                    self._heartbeats -= 1
            self.send(END, end)

    def cancel(self, seq: int) -> None:
        with self._lock:
            stream = self._streams.get(seq)
            if stream is None:
                self._cancelled.add(seq)  # not started yet: it ends as soon as it does
        if stream is not None:
            self._session.end_stream(stream)

    def close(self) -> None:
        """Hang up (the client's next read fails) and end its streams. Idempotent."""
        self._writer.hang_up()
        with self._lock:
            streams = list(self._streams.values())
        for stream in streams:
            self._session.end_stream(stream)


class DoorbellServer:
    """The listening socket and one thread per connection.

    Raises:
        FailedPrecondition: (constructor) the socket cannot be created in the shm directory.
    """

    def __init__(self, path: Path, sessions: SessionManager, *, heartbeat_s: float = 0.0) -> None:
        self.path = path
        self._sessions = sessions
        self.heartbeat_s = heartbeat_s
        """Seconds between heartbeats on an idle doorbell stream; 0: none."""
        if len(str(path).encode()) > MAX_UNIX_PATH_BYTES:
            raise FailedPrecondition(
                f"the shm directory {path.parent} is too long a path for the doorbell socket "
                f"{path.name} (unix socket paths have at most {MAX_UNIX_PATH_BYTES} bytes); "
                "use a shorter BATCHD_SHM_DIR"
            )
        self._listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
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
        self._bells: set[ServerBell] = set()
        self._closed = False
        self._stop = threading.Event()
        self._acceptor = threading.Thread(target=self._accept, name="batchd-bell", daemon=True)
        self._acceptor.start()
        self._heart: threading.Thread | None = None
        if heartbeat_s > 0:
            self._heart = threading.Thread(
                target=self._beat, name="batchd-bell-heartbeat", daemon=True
            )
            self._heart.start()

    def _beat(self) -> None:
        # Looking twice per interval keeps the gap between two frames under 1.5 intervals.
        while not self._stop.wait(self.heartbeat_s / 2):
            with self._lock:
                bells = list(self._bells)
            now = time.monotonic()
            for bell in bells:
                try:
                    bell.heartbeat(self.heartbeat_s, now)
                except Exception:  # one broken connection must not stop the others' heartbeats
                    logger.exception("doorbell: a heartbeat failed")

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
            reader = FrameReader(conn, max_frame_bytes=MAX_CLIENT_FRAME_BYTES)
            conn.settimeout(HELLO_TIMEOUT_S)
            frame = reader.read()
            if frame is None or frame[0] != HELLO:
                logger.warning("doorbell: a connection did not start with a hello; closed")
                return
            hello = parse(pb.DoorbellHello, frame[1])
            try:
                session = self._sessions.get(hello.session_id)
            except NotFound:
                logger.info(
                    "doorbell: hello for an unknown session %s; closed",
                    session_log_id(hello.session_id),
                )
                return
            if not hmac.compare_digest(hello.token, session.token):
                logger.warning(
                    "doorbell: hello for session %s with the wrong token; closed",
                    session_log_id(session.id),
                )
                return
            conn.settimeout(None)
            bell = ServerBell(conn, session)
            session.attach_bell(bell)
            welcome = pb.DoorbellHeartbeat(interval_s=self.heartbeat_s)
            conn.sendall(encode_frame(WELCOME, welcome.SerializeToString()))
            with self._lock:
                self._bells.add(bell)
            while True:
                frame = reader.read()
                if frame is None:
                    return
                kind, payload = frame
                if kind == RELEASE:
                    ack = parse(pb.Ack, payload)
                    session.release(list(ack.leases))
                    metrics.record_client_timings(
                        session.options.dataset,
                        ack.batch_wait_s,
                        ack.batch_step_s,
                        now=time.monotonic(),
                    )
                elif kind == START:
                    bell.start(parse(pb.StreamStart, payload))
                elif kind == CANCEL:
                    bell.cancel(parse(pb.DoorbellCancel, payload).seq)
                else:
                    logger.warning(
                        "doorbell: session %s sent a frame of kind %r; closed",
                        session_log_id(session.id),
                        kind,
                    )
                    return
        except OSError as e:  # the client went away (or the server is closing)
            logger.debug("doorbell connection ended: %s", e)
        except Exception as e:
            who = (
                "a connection before its hello"
                if session is None
                else f"the connection of session {session_log_id(session.id)}"
            )
            if isinstance(e, BatchdError):  # a frame that breaks the protocol: a client bug
                logger.warning("doorbell: closed %s: %s", who, e)
            else:
                logger.warning(
                    "doorbell: %s failed (%s: %s); closed",
                    who,
                    type(e).__name__,
                    e,
                    exc_info=True,
                )
        finally:
            if bell is not None and session is not None:
                session.detach_bell(bell)
                bell.close()
            with self._lock:
                if bell is not None:
                    self._bells.discard(bell)
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
        self._stop.set()
        with contextlib.suppress(OSError):
            self._listener.shutdown(socket.SHUT_RDWR)
        self._listener.close()
        with contextlib.suppress(OSError):
            self.path.unlink()
        for conn in connections:
            with contextlib.suppress(OSError):
                conn.shutdown(socket.SHUT_RDWR)
        deadline = time.monotonic() + 5.0  # one wait for all: never one after another
        self._acceptor.join(5.0)
        if self._heart is not None:
            self._heart.join(max(0.0, deadline - time.monotonic()))
        for thread in threads:
            thread.join(max(0.0, deadline - time.monotonic()))
