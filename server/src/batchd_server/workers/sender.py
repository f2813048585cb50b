"""One worker's outgoing messages: written at once when the socket takes them, else by a
thread of their own, never by blocking the pool's dispatcher.

A task names its batch's sample positions, 8 bytes each: 512 KiB at the largest batch, more
than a unix socket's default send buffer (208 KiB). A blocking send to a worker that does
not read (busy with its previous task, stopped with SIGSTOP, stuck in the kernel) waits
until it reads, and the dispatcher, which must keep reading results, feeding the other
workers and enforcing deadlines, must never wait on one worker.

So :meth:`WorkerSender.send` writes a message with one non-blocking ``sendmsg`` when nothing
of this worker's is waiting: a small task fits the socket buffer whole (the common case, no
thread involved). What the socket did not take (part of a large task, or every message
behind one still waiting) goes to a queue that a thread per worker writes, in order, with
blocking writes. At most ``tasks_per_worker`` tasks (and a few ``forget`` messages) wait: the
pool hands a worker no more.

Why not only the thread: a hand-over per task costs the server a thread wake-up and a GIL
switch, about a fifth of the pool's CPU per small task. Why not only non-blocking writes: the
dispatcher would have to poll every socket for room. Small task messages with the positions
in shared memory would avoid the copy too, but change what a task is, which the pool treats
as an opaque payload.

Messages are framed as ``multiprocessing.connection.Connection.send_bytes`` frames them (a
4-byte big-endian length; -1 and an 8-byte length past 2 GiB), so the worker reads them with
``Connection.recv``.

:meth:`WorkerSender.close` unblocks a write in progress by shutting the socket down (a worker
killed for a deadline may take a while to go if it is stuck in the kernel); the thread then
closes the connection: only one thread ever closes it, and only after the last write.
"""

from __future__ import annotations

import contextlib
import os
import queue
import socket
import struct
import threading
from multiprocessing.connection import Connection
from multiprocessing.reduction import ForkingPickler
from typing import Final

__all__ = ["WorkerSender", "pickled"]

_CLOSE: Final = object()
_FLAGS: Final = socket.MSG_DONTWAIT | socket.MSG_NOSIGNAL
Buffer = bytes | memoryview


def pickled(message: object) -> memoryview:
    """``message`` as ``Connection.send`` pickles it (the worker's ``recv`` unpickles it).

    Raises:
        Exception: whatever pickling ``message`` raises.
    """
    return ForkingPickler.dumps(message)


class WorkerSender:
    """Writes pickled messages to ``conn`` in order without ever blocking the caller; a
    daemon thread named ``name`` writes what the socket does not take at once.

    A write that fails (the worker died) makes the sender drop what follows; the pool learns
    of the death from the worker's sentinel.
    """

    def __init__(self, conn: Connection, name: str) -> None:
        self._conn = conn
        # The same socket as conn's, through a descriptor of its own: conn keeps reading.
        self._sock = socket.socket(fileno=os.dup(conn.fileno()))
        self._queue: queue.SimpleQueue[object] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._backlog = 0
        """Messages queued for the thread or being written by it."""
        self._closing = False
        self._broken = False
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def send(self, payload: memoryview | bytes) -> None:
        """Send ``payload`` (see :func:`pickled`) after every earlier one; never blocks.
        Dropped after :meth:`close` or a failed write."""
        n = len(payload)
        header = struct.pack("!i", n) if n <= 0x7FFFFFFF else struct.pack("!iQ", -1, n)
        with self._lock:
            if self._closing or self._broken:
                return
            rest: list[Buffer] = [header, payload]
            if self._backlog == 0:
                try:
                    sent = self._sock.sendmsg(rest, (), _FLAGS)
                except BlockingIOError:
                    sent = 0
                except OSError:  # the worker is gone
                    self._broken = True
                    return
                if sent == len(header) + n:
                    return
                rest = _after(header, payload, sent)
            self._backlog += 1
            self._queue.put(rest)

    def close(self) -> None:
        """Stop: a write in progress fails at once, queued ones are dropped, the thread closes
        the connection. Idempotent; never blocks."""
        with self._lock:
            if self._closing:
                return
            self._closing = True
            # Shut the socket down, not close a descriptor: a descriptor closed under a
            # blocked write could be reused by another thread's open file.
            with contextlib.suppress(OSError):
                self._sock.shutdown(socket.SHUT_RDWR)
            self._queue.put(_CLOSE)

    def join(self, timeout_s: float) -> bool:
        """Wait up to ``timeout_s`` for the thread to end (after :meth:`close`); whether it
        did."""
        self._thread.join(timeout_s)
        return not self._thread.is_alive()

    def _run(self) -> None:
        while True:
            parts = self._queue.get()
            if parts is _CLOSE:
                break
            failed = False
            if not self._broken:
                try:
                    for part in parts:  # type: ignore[attr-defined]
                        self._sock.sendall(part)
                except OSError:  # the worker is gone, or close() shut the socket down
                    failed = True
            with self._lock:
                self._backlog -= 1
                self._broken = self._broken or failed
        self._sock.close()
        self._conn.close()


def _after(header: bytes, payload: Buffer, sent: int) -> list[Buffer]:
    """What is left of the frame ``header + payload`` once ``sent`` bytes of it went."""
    if sent < len(header):
        return [header[sent:], payload]
    return [memoryview(payload)[sent - len(header) :]]
