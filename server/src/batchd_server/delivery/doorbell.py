"""The server's end of the doorbell, where shm streams run: starts and acks in, batches out.

The protocol and the reason for it are in ``batchd._wire.frames``. Here: one
listening unix socket per server instance, beside its segments in the shm directory
(``batchd-<instance>-bell-<random>``, mode 0600, so only who may open the segments may
connect, and a sweep removes it with the segments of a dead instance). Each connection says
hello for one session, proving with the ring's token that it mapped the segment, and then
gets a thread that reads its frames: acks are applied at once, a StreamStart starts (or
hands the next stream to) the connection's one stream thread, which streams the epoch's batch
notices, a cancel ends that stream. A ring has one stream: a new StreamStart ends the one
running. A connection that closes (the client exited or died) ends its stream; the session's
lease does the rest. Threads are bounded: at most :data:`MAX_PENDING_HELLOS` connections wait
for their hello, and a session keeps one connection (its newest) with two threads.

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
import math
import os
import socket
import threading
import time
import weakref
from pathlib import Path
from typing import Final

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
from batchd_server.delivery.messages import shm_notice, start_stream
from batchd_server.errors import FailedPrecondition, InvalidArgument, NotFound
from batchd_server.limits import MAX_CLIENT_FRAME_BYTES, MAX_UNIX_PATH_BYTES
from batchd_server.logs import session_log_id
from batchd_server.metrics import stall
from batchd_server.sessions import Session, SessionManager, Stream

__all__ = ["MAX_PENDING_HELLOS", "DoorbellServer", "ServerBell"]

logger = logging.getLogger(__name__)

MAX_PENDING_HELLOS: Final = 64
"""Connections that may wait for their hello at once (each holds a thread for up to
HELLO_TIMEOUT_S); one more is closed at once. Connections past their hello need no cap of
their own: each belongs to a session, whose newest connection closes the one before."""
_REFUSAL_LOG_S: Final = 10.0
"""Refused connections are warned about at most once per this many seconds."""


class ServerBell:
    """One client's doorbell connection, attached to its session, and its stream.

    One stream at a time, run by one thread (started on demand): a START ends the stream
    running (the client gave up on it) and waits as the next; a START that arrives while
    another waits replaces it. Both superseded seqs get their END, which the client skips.
    A START must carry a higher seq than the one before it (clients count their streams).

    Args:
        start_lock: Held around starting a stream, shared by every bell of one session: a
            connection that a newer one replaced starts nothing once it is closed.
    """

    def __init__(
        self, sock: socket.socket, session: Session, start_lock: threading.Lock | None = None
    ) -> None:
        self._writer = FrameWriter(sock)
        self._session = session
        self._start_lock = threading.Lock() if start_lock is None else start_lock
        self._lock = threading.Lock()
        self._last_seq: int | None = None
        """The seq of the last START taken; the next must be higher."""
        self._pending: pb.StreamStart | None = None
        """The START to run once the running stream has ended."""
        self._running: pb.StreamStart | None = None
        self._stream: Stream | None = None
        """The running START's stream, once the session started it."""
        self._cancelled = False
        """The running START was cancelled or superseded (perhaps before its stream began)."""
        self._runner: threading.Thread | None = None
        self._last_sent = time.monotonic()

    @property
    def closed(self) -> bool:
        return self._writer.closed

    def send(self, kind: int, message: Message) -> bool:
        """Send one frame; False when the client is gone (the connection failed)."""
        sent = self._writer.send(kind, message)
        self._last_sent = time.monotonic()
        return sent

    def heartbeat(self, interval_s: float, now: float) -> None:
        """Send a heartbeat if a stream that wants them runs (or waits) and nothing went out
        for ``interval_s``; never waits (a client too busy to read has frames to read)."""
        with self._lock:
            wanted = any(s is not None and s.heartbeat for s in (self._running, self._pending))
        if not wanted or now - self._last_sent < interval_s:
            return
        if self._writer.try_send(HEARTBEAT, pb.DoorbellHeartbeat(interval_s=interval_s)):
            self._last_sent = now

    def start(self, start: pb.StreamStart) -> None:
        """Run the stream ``start`` asks for next, ending the one running. Every frame of an
        earlier stream goes out before this one's ACCEPTED."""
        with self._lock:
            last = self._last_seq
            stale = last is not None and start.seq <= last
            if not stale:
                self._last_seq = start.seq
                replaced, self._pending = self._pending, None
                running = self._stream
                self._cancelled = self._running is not None
        if stale:
            message = (
                f"StreamStart seq={start.seq} does not follow seq={last} on the doorbell of "
                f"session {session_log_id(self._session.id)}; a client numbers its streams "
                "1, 2, 3, ... on one connection"
            )
            logger.warning("doorbell: %s; refused", message)
            self.send(
                END, pb.DoorbellEnd(seq=start.seq, error_class="InvalidArgument", message=message)
            )
            return
        if replaced is not None:
            self.send(END, pb.DoorbellEnd(seq=replaced.seq))
        if running is not None:
            self._session.end_stream(running)
        # Only the connection's reader calls start and cancel: nothing came between.
        with self._lock:
            self._pending = start
            spawn = None
            if self._runner is None:
                spawn = self._runner = threading.Thread(
                    target=self._run, name="batchd-bell-stream", daemon=True
                )
        if spawn is not None:
            spawn.start()

    def _run(self) -> None:
        while True:
            with self._lock:
                start, self._pending = self._pending, None
                if start is None or self.closed:
                    self._runner = None
                    return
                self._running, self._stream, self._cancelled = start, None, False
            try:
                self._serve_stream(start)
            finally:
                with self._lock:
                    self._running = self._stream = None

    def _serve_stream(self, start: pb.StreamStart) -> None:
        session, seq = self._session, start.seq
        stream = None
        end = pb.DoorbellEnd(seq=seq)
        try:
            if start.session_id and start.session_id != session.id:
                raise InvalidArgument(
                    f"StreamStart for session {start.session_id} on the doorbell of {session.id}"
                )
            with self._start_lock:
                if self.closed:
                    return  # a newer connection has the session now
                stream = start_stream(session, start, shm=True)
            with self._lock:
                self._stream = stream
                cancelled = self._cancelled
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
            self.send(END, end)

    def cancel(self, seq: int) -> None:
        """End the stream of ``seq`` if it runs or waits; any other seq is over already
        (frames arrive in order: a stream's START always comes before its cancel)."""
        stream = None
        with self._lock:
            waiting = self._pending is not None and self._pending.seq == seq
            if waiting:
                self._pending = None
            elif self._running is not None and self._running.seq == seq:
                self._cancelled = True  # not started yet: it ends as soon as it does
                stream = self._stream
        if waiting:
            self.send(END, pb.DoorbellEnd(seq=seq))
        if stream is not None:
            self._session.end_stream(stream)

    def close(self) -> None:
        """Hang up (the client's next read fails) and end its stream. Idempotent."""
        self._writer.hang_up()
        with self._lock:
            self._pending = None
            self._cancelled = True
            stream = self._stream
        if stream is not None:
            self._session.end_stream(stream)


class DoorbellServer:
    """The listening socket and one thread per connection (and one per running stream).

    Args:
        max_pending: Connections that may wait for their hello at once; one more is closed.

    Raises:
        FailedPrecondition: (constructor) the socket cannot be created in the shm directory.
    """

    def __init__(
        self,
        path: Path,
        sessions: SessionManager,
        *,
        heartbeat_s: float = 0.0,
        max_pending: int = MAX_PENDING_HELLOS,
    ) -> None:
        self.path = path
        self._sessions = sessions
        self.heartbeat_s = heartbeat_s
        """Seconds between heartbeats on an idle doorbell stream; 0: none."""
        self.max_pending = max_pending
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
        self._start_locks: weakref.WeakValueDictionary[str, threading.Lock] = (
            weakref.WeakValueDictionary()
        )
        """Per session, shared by its bells (see ServerBell's ``start_lock``)."""
        self._pending = 0
        """Connections accepted that have not had their hello answered yet."""
        self._refused = 0
        """Connections refused since the last warning about it."""
        self._refusal_logged = -math.inf
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
                full = self._pending >= self.max_pending
                if not full:
                    self._pending += 1
                    self._connections.add(conn)
                    thread = threading.Thread(
                        target=self._serve, args=(conn,), name="batchd-bell-conn", daemon=True
                    )
                    self._threads.add(thread)
            if full:
                self._log_refusal()  # before the close: whoever sees it closed can read why
                conn.close()
            else:
                thread.start()

    def _log_refusal(self) -> None:
        """Warn about refused connections, at most once per :data:`_REFUSAL_LOG_S`."""
        now = time.monotonic()
        with self._lock:
            self._refused += 1
            if now - self._refusal_logged < _REFUSAL_LOG_S:
                return
            refused, self._refused, self._refusal_logged = self._refused, 0, now
        logger.warning(
            "doorbell: refused %d connection(s): %d connections are waiting to say hello, the "
            "most there may be (each has %g s); a client that connects and says nothing, or "
            "connects many times at once, holds the places; its loaders fall back to inline "
            "streams meanwhile",
            refused,
            self.max_pending,
            HELLO_TIMEOUT_S,
        )

    def _hello_answered(self) -> None:
        with self._lock:
            self._pending -= 1

    def _hello(self, conn: socket.socket, reader: FrameReader) -> Session | None:
        """The session ``conn``'s hello proves it a client of; None (logged) when none."""
        conn.settimeout(HELLO_TIMEOUT_S)
        frame = reader.read()
        if frame is None or frame[0] != HELLO:
            logger.warning("doorbell: a connection did not start with a hello; closed")
            return None
        hello = parse(pb.DoorbellHello, frame[1])
        try:
            session = self._sessions.get(hello.session_id)
        except NotFound:
            logger.info(
                "doorbell: hello for an unknown session %s; closed",
                session_log_id(hello.session_id),
            )
            return None
        if not hmac.compare_digest(hello.token, session.token):
            logger.warning(
                "doorbell: hello for session %s with the wrong token; closed",
                session_log_id(session.id),
            )
            return None
        conn.settimeout(None)
        return session

    def _serve(self, conn: socket.socket) -> None:
        bell: ServerBell | None = None
        session = None
        try:
            reader = FrameReader(conn, max_frame_bytes=MAX_CLIENT_FRAME_BYTES)
            try:
                session = self._hello(conn, reader)
            finally:
                self._hello_answered()  # a place for the next connection, before the welcome
            if session is None:
                return
            with self._lock:
                start_lock = self._start_locks.setdefault(session.id, threading.Lock())
            bell = ServerBell(conn, session, start_lock)
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
                    stall.record_client_timings(
                        session.options.dataset,
                        ack.batch_wait_s,
                        ack.batch_step_s,
                        now=time.monotonic(),
                        client=session.client,
                        allowance=session.timings,
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
