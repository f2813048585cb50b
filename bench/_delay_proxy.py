"""A TCP proxy that adds a fixed latency to every request sent to an object store, and counts.

``bench/object_store.py`` puts it between every loader and the S3 server (SeaweedFS) to play a
store that is ``D`` ms away. Why a proxy and not ``tc qdisc ... netem``: the development VM's
kernel has no ``sch_netem`` (``tc qdisc add dev lo root netem`` answers "Specified qdisc kind
is unknown"), and netem on ``lo`` would also delay the S3 gateway's own traffic to SeaweedFS's
filer and volume server, all on loopback, so one GET would pay the delay several times.

What is added, exactly: every chunk of bytes a client sends (a request: its line, headers and
body) is held ``D`` ms before it goes on to the store; the first chunk of a new connection is
held ``2 D`` (the TCP handshake's round trip a real network would add). Responses flow back
as they come, with flow control in both directions, so a request costs ``D`` more from send
to first byte, and the store's bandwidth is not limited (a real WAN would add that too). ``D``
can change while connections are open; bytes already held keep their order.

Counters: bytes each way and connections accepted. A control port takes one line per command
and answers one line: ``delay MS`` -> ``ok``, ``stats`` -> a JSON object.

Run: ``python bench/_delay_proxy.py --listen PORT --upstream HOST:PORT --control PORT``; it
prints ``ready`` on stdout once both ports listen.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import socket
import sys
from typing import Any


class Counters:
    """What went through the proxy since it started, and the delay it adds now."""

    def __init__(self) -> None:
        self.delay_s = 0.0
        self.bytes_up = 0
        """Client to store: requests."""
        self.bytes_down = 0
        """Store to client: responses, HTTP headers included."""
        self.connections = 0

    def as_dict(self) -> dict[str, Any]:
        return {
            "delay_ms": self.delay_s * 1e3,
            "bytes_up": self.bytes_up,
            "bytes_down": self.bytes_down,
            "connections": self.connections,
        }


class _Side(asyncio.Protocol):
    """One end of a proxied connection; ``peer`` is the other end's protocol."""

    def __init__(self, counters: Counters) -> None:
        self.counters = counters
        self.transport: asyncio.Transport | None = None
        self.peer: _Side | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.transport = transport

    # Flow control: when our outgoing buffer fills, stop reading from the other end.
    def pause_writing(self) -> None:
        if self.peer is not None and self.peer.transport is not None:
            self.peer.transport.pause_reading()

    def resume_writing(self) -> None:
        if self.peer is not None and self.peer.transport is not None:
            self.peer.transport.resume_reading()

    def connection_lost(self, exc: Exception | None) -> None:
        if self.peer is not None and self.peer.transport is not None:
            self.peer.close_after_flush()

    def close_after_flush(self) -> None:
        if self.transport is not None:
            self.transport.close()


class _Upstream(_Side):
    """The proxy's connection to the store: responses go straight back to the client."""

    def data_received(self, data: bytes) -> None:
        self.counters.bytes_down += len(data)
        assert self.peer is not None and self.peer.transport is not None
        self.peer.transport.write(data)


class _Client(_Side):
    """A client's connection: what it sends waits ``delay`` before it goes upstream."""

    def __init__(self, counters: Counters, upstream: tuple[str, int]) -> None:
        super().__init__(counters)
        self.upstream = upstream
        self.held: collections.deque[tuple[float, bytes]] = collections.deque()
        self.timer: asyncio.TimerHandle | None = None
        self.first = True
        self.closing = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        super().connection_made(transport)
        self.counters.connections += 1
        asyncio.get_running_loop().create_task(self._connect())

    async def _connect(self) -> None:
        loop = asyncio.get_running_loop()
        try:
            _, upstream = await loop.create_connection(
                lambda: _Upstream(self.counters), *self.upstream
            )
        except OSError:
            if self.transport is not None:
                self.transport.close()
            return
        assert isinstance(upstream, _Upstream)
        upstream.peer, self.peer = self, upstream
        if self.transport is None or self.transport.is_closing():
            upstream.close_after_flush()
            return
        self._release()

    def data_received(self, data: bytes) -> None:
        self.counters.bytes_up += len(data)
        loop = asyncio.get_running_loop()
        delay = self.counters.delay_s * (2 if self.first else 1)
        self.first = False
        self.held.append((loop.time() + delay, data))
        if self.timer is None:
            self._release()

    def _release(self) -> None:
        """Send every held chunk whose time has come, in order; wait for the next one."""
        self.timer = None
        if self.peer is None or self.peer.transport is None:
            return  # not connected upstream yet: _connect calls again
        loop = asyncio.get_running_loop()
        now = loop.time()
        while self.held and self.held[0][0] <= now:
            self.peer.transport.write(self.held.popleft()[1])
        if self.held:
            self.timer = loop.call_at(self.held[0][0], self._release)
        elif self.closing and self.peer.transport.can_write_eof():
            self.peer.transport.write_eof()

    def eof_received(self) -> bool:
        # Half-close: pass the client's EOF on once what it sent before has gone.
        self.closing = True
        upstream = self.peer.transport if self.peer is not None else None
        if not self.held and upstream is not None and upstream.can_write_eof():
            upstream.write_eof()
        return True

    def connection_lost(self, exc: Exception | None) -> None:
        if self.timer is not None:
            self.timer.cancel()
        super().connection_lost(exc)


async def _control(counters: Counters, port: int, ready: asyncio.Event) -> None:
    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while line := (await reader.readline()).decode().split():
            if line[0] == "delay" and len(line) == 2:
                counters.delay_s = float(line[1]) / 1e3
                answer = "ok"
            elif line[0] == "stats":
                answer = json.dumps(counters.as_dict())
            else:
                answer = f"error: unknown command {' '.join(line)!r} (delay MS | stats)"
            writer.write(answer.encode() + b"\n")
            await writer.drain()
        writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", port)
    async with server:
        ready.set()
        await server.serve_forever()


async def main(listen: int, upstream: tuple[str, int], control: int) -> None:
    counters = Counters()
    loop = asyncio.get_running_loop()
    server = await loop.create_server(
        lambda: _Client(counters, upstream), "127.0.0.1", listen, reuse_address=True
    )
    ready = asyncio.Event()
    task = asyncio.create_task(_control(counters, control, ready))
    await ready.wait()
    print("ready", flush=True)
    async with server:
        await asyncio.gather(server.serve_forever(), task)


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class ProxyControl:
    """The bench's side of the control port: set the delay, read the counters."""

    def __init__(self, port: int) -> None:
        self.sock = socket.create_connection(("127.0.0.1", port))
        self.file = self.sock.makefile("rw", encoding="utf-8")

    def _ask(self, line: str) -> str:
        self.file.write(line + "\n")
        self.file.flush()
        answer = self.file.readline().strip()
        if answer.startswith("error") or not answer:
            raise RuntimeError(f"delay proxy: {line!r} was answered {answer!r}")
        return answer

    def set_delay(self, ms: float) -> None:
        self._ask(f"delay {ms:g}")

    def stats(self) -> dict[str, Any]:
        result: dict[str, Any] = json.loads(self._ask("stats"))
        return result

    def close(self) -> None:
        self.file.close()
        self.sock.close()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--listen", type=int, required=True, help="port for the clients")
    parser.add_argument("--upstream", required=True, help="HOST:PORT of the store")
    parser.add_argument("--control", type=int, required=True, help="port for delay/stats")
    args = parser.parse_args()
    host, _, port = args.upstream.rpartition(":")
    try:
        asyncio.run(main(args.listen, (host, int(port)), args.control))
    except KeyboardInterrupt:
        sys.exit(0)
