"""The gRPC face of the server: put the Loader, health and reflection services over the
parts :mod:`batchd_server.assembly` builds, then bind and start, refusing addresses that
someone else holds.

gRPC's defaults would let a second server share a TCP port (SO_REUSEPORT is on) and would
silently unlink a unix socket a live server is listening on and take its place. Neither is
what an operator means, so here SO_REUSEPORT is off and a unix socket path is probed before
binding; a failed bind becomes an error that names the address and the reason.
"""

from __future__ import annotations

import errno
import logging
import os
import socket
import stat
import time
from concurrent import futures
from dataclasses import dataclass, field
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from batchd._proto.batchd.v1 import loader_pb2_grpc
from batchd._wire.lifetime import Closeable
from batchd_server.api.admission import Admission, AdmissionInterceptor
from batchd_server.api.health import LOADER_SERVICE, HealthService
from batchd_server.api.security import (
    TokenInterceptor,
    add_reflection,
    check_exposure,
    read_token,
    restrict_unix_socket,
    server_credentials,
)
from batchd_server.api.servicer import LoaderServicer
from batchd_server.assembly import Parts, assemble
from batchd_server.config import ServerConfig, reserved_rpcs
from batchd_server.errors import FailedPrecondition, InvalidArgument
from batchd_server.health import HealthMonitor
from batchd_server.limits import MAX_REQUEST_BYTES, MAX_UNIX_PATH_BYTES
from batchd_server.sessions import SessionManager
from batchd_server.shm import ShmRegistry
from batchd_server.workers.pool import WorkerPool

__all__ = ["ListenAddress", "RunningServer", "build_server"]

logger = logging.getLogger(__name__)

_KEEPALIVE_OPTIONS = [
    # Notice a trainer whose machine vanished (no FIN, no RST) within about a minute, so
    # its session's lease starts; a killed process closes its socket and is noticed at once.
    ("grpc.keepalive_time_ms", 30_000),
    ("grpc.keepalive_timeout_ms", 20_000),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.min_ping_interval_without_data_ms", 10_000),
    ("grpc.max_send_message_length", 64 << 20),
    # Clients only send small requests; a huge one is refused before it is buffered.
    ("grpc.max_receive_message_length", MAX_REQUEST_BYTES),
]

_LISTEN_HINT = "use unix:///path/to/grpc.sock or host:port (port 0 picks a free one)"


@dataclass(frozen=True)
class ListenAddress:
    """A parsed ``--listen`` value."""

    grpc_address: str
    """What gRPC binds: ``unix:///absolute/path`` or ``host:port``."""
    unix_path: Path | None = None
    host: str | None = None
    port: int | None = None

    @classmethod
    def parse(cls, listen: str) -> ListenAddress:
        """Parse ``unix:///abs.sock``, ``unix:relative.sock`` or ``host:port``.

        Raises:
            InvalidArgument: it is neither.
        """
        if listen.startswith("unix:"):
            rest = listen.removeprefix("unix:")
            if rest.startswith("//"):
                rest = rest.removeprefix("//")
                if not rest.startswith("/"):
                    raise InvalidArgument(
                        f"listen address {listen!r}: unix:// needs an absolute path "
                        "(unix:///run/batchd/grpc.sock); for a relative one write unix:grpc.sock"
                    )
            if not rest:
                raise InvalidArgument(
                    f"listen address {listen!r} has no socket path; {_LISTEN_HINT}"
                )
            path = Path(rest).absolute()
            return cls(grpc_address=f"unix://{path}", unix_path=path)
        host, sep, port_text = listen.rpartition(":")
        if not sep or not host or not port_text.isdigit() or int(port_text) > 65535:
            raise InvalidArgument(f"listen address {listen!r} is not valid; {_LISTEN_HINT}")
        if host.startswith("[") != host.endswith("]"):
            raise InvalidArgument(
                f"listen address {listen!r}: write IPv6 hosts in brackets, as in [::1]:50051"
            )
        return cls(grpc_address=listen, host=host, port=int(port_text))


@dataclass(eq=False)
class RunningServer(Closeable):
    """A started gRPC server and what it owns; stop it with :meth:`stop` or ``with``."""

    grpc_server: grpc.Server
    executor: futures.ThreadPoolExecutor
    address: str
    """The target a client passes (``unix:///path`` or ``host:port``, port resolved)."""
    port: int | None
    """The bound TCP port, or None on a unix socket."""
    parts: Parts
    admission: Admission
    """The calls in progress, in all and per client (see ``api/admission.py``)."""
    _stopped: bool = field(default=False, init=False)

    @property
    def pool(self) -> WorkerPool:
        """The decode workers (tests kill them; operators read ``restarts``)."""
        return self.parts.pool

    @property
    def sessions(self) -> SessionManager:
        return self.parts.sessions

    @property
    def registry(self) -> ShmRegistry:
        return self.parts.registry

    @property
    def monitor(self) -> HealthMonitor:
        """The readiness and liveness checks behind the gRPC health service."""
        return self.parts.monitor

    @property
    def metrics_address(self) -> str | None:
        """``host:port`` of ``/metrics`` (port resolved), or None when not served."""
        endpoint = self.parts.metrics_endpoint
        return None if endpoint is None else endpoint.address

    def drain(self) -> None:
        """Say NOT_SERVING on every readiness service and refuse new sessions, from now on."""
        self.parts.monitor.drain()

    def stop(self, grace_s: float | None = 5.0) -> None:
        """Shut down within ``grace_s`` seconds in all (None: no grace, cancel calls at once).

        At once: health NOT_SERVING and no new sessions (:meth:`drain`); every session's
        stream ends (its client raises ``batchd.errors.Unavailable``, which says how to
        resume), all at once, never one session after another. Then calls still running get
        what is left of the grace period before they are cancelled, the workers stop
        (ask, then terminate, then kill) and every shared-memory segment is removed.
        Idempotent. gRPC removes the unix socket file.
        """
        if self._stopped:
            return
        self._stopped = True
        started = time.monotonic()
        deadline = started + (grace_s or 0.0)

        def left(floor: float = 0.0) -> float:
            return max(floor, deadline - time.monotonic())

        try:
            self.drain()
            # Refuses new calls now; running ones finish or are cancelled at the deadline.
            # The sessions' streams end next, so their calls return long before that.
            terminated = self.grpc_server.stop(left() if grace_s is not None else None)
            self.parts.end_sessions(left())
            terminated.wait(left(floor=0.1))
        finally:
            # A handler stuck in a database call must not hang shutdown; its thread ends
            # when the call returns.
            self.executor.shutdown(wait=False, cancel_futures=True)
            # At least a second for the workers to exit on their own before they are
            # terminated: a worker killed mid-write is harmless, but a clean exit is nicer.
            self.parts.close(left(floor=1.0))
            logger.info("batchd-server stopped in %.1f s", time.monotonic() - started)

    def wait_for_termination(self, timeout_s: float | None = None) -> bool:
        """Block until the server stops; False if ``timeout_s`` passed first."""
        return bool(self.grpc_server.wait_for_termination(timeout_s))

    def close(self) -> None:
        """:meth:`stop` with the default grace (what ``with`` calls on exit)."""
        self.stop()

    def __repr__(self) -> str:
        return f"RunningServer(address={self.address!r}{', stopped' if self._stopped else ''})"


def _check_unix_path(listen: str, path: Path) -> None:
    """Refuse a socket path that is too long, has no directory, or that a live server holds."""
    size = len(str(path).encode())
    if size > MAX_UNIX_PATH_BYTES:
        raise InvalidArgument(
            f"cannot listen on {listen!r}: the socket path is {size} bytes, the limit is "
            f"{MAX_UNIX_PATH_BYTES}; choose a shorter path"
        )
    if not path.parent.is_dir():
        raise FailedPrecondition(
            f"cannot listen on {listen!r}: directory {path.parent} does not exist; create it "
            "(in Kubernetes, mount a volume shared with the trainer there)"
        )
    try:
        mode = path.lstat().st_mode
    except FileNotFoundError:
        return
    if not stat.S_ISSOCK(mode):
        raise FailedPrecondition(
            f"cannot listen on {listen!r}: {path} exists and is not a socket; "
            "remove it or choose another path"
        )
    # gRPC unlinks an existing socket file before binding, which would steal the path from
    # a live server. A socket nobody accepts on is left over from a dead one: reuse it.
    # (A server starting between this probe and the bind can still race us; the probe is
    # for the operator's mistake of starting two, not for that.)
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
        probe.settimeout(1.0)
        try:
            probe.connect(str(path))
        except (ConnectionRefusedError, FileNotFoundError):
            return
        except OSError as e:
            raise FailedPrecondition(
                f"cannot listen on {listen!r}: cannot check whether {path} is in use "
                f"({e.strerror or e}); choose another path"
            ) from e
    raise FailedPrecondition(
        f"cannot listen on {listen!r}: another server is already listening on {path}; "
        "stop it or choose another path"
    )


def _tcp_bind_problem(host: str, port: int) -> str:
    """Why ``host:port`` cannot be bound, found by trying with a plain socket."""
    try:
        infos = socket.getaddrinfo(
            host.removeprefix("[").removesuffix("]"),
            port,
            type=socket.SOCK_STREAM,
            flags=socket.AI_PASSIVE,
        )
    except socket.gaierror as e:
        return f"host {host!r} does not resolve ({e.strerror})"
    for family, kind, proto, _, sockaddr in infos:
        with socket.socket(family, kind, proto) as s:
            try:
                s.bind(sockaddr)
            except OSError as e:
                if e.errno == errno.EADDRINUSE:
                    return (
                        f"port {port} is already in use (batchd never shares a port: "
                        "SO_REUSEPORT is off)"
                    )
                if e.errno == errno.EADDRNOTAVAIL:
                    return f"{host} is not an address of this machine"
                if e.errno == errno.EACCES:
                    return f"port {port} is privileged; use one >= 1024"
                return e.strerror or str(e)
    return "gRPC could not bind it (set GRPC_VERBOSITY=debug to see why)"


def _add_port(
    server: grpc.Server, where: ListenAddress, credentials: grpc.ServerCredentials | None
) -> int:
    """Bind ``where``; a unix socket is created mode 0600 (the umask closes the moment
    between bind and chmod, and the chmod holds whatever the umask was)."""
    if where.unix_path is None:
        if credentials is not None:
            return server.add_secure_port(where.grpc_address, credentials)
        return server.add_insecure_port(where.grpc_address)
    previous = os.umask(0o177)
    try:
        bound = server.add_insecure_port(where.grpc_address)
    finally:
        os.umask(previous)
    if bound:
        restrict_unix_socket(where.unix_path)
    return bound


def build_server(
    config: ServerConfig, listen: str | None = None, *, max_workers: int | None = None
) -> RunningServer:
    """Start the Loader service on ``listen`` over the catalog at ``config.database_url``.

    The shared-memory registry (sweeping what a dead earlier run left) and the decode
    workers start before any gRPC object exists: grpcio is not fork-safe, and a server must
    not say it is listening before it can decode.

    Args:
        config: The server's configuration.
        listen: ``unix:///path/to/grpc.sock``, ``unix:relative.sock`` or ``host:port``
            (``host:0`` binds a free port; :attr:`RunningServer.address` has it);
            None means ``config.listen``.
        max_workers: Calls served at once, each on a thread of its own (an open inline
            stream holds one); None means ``config.max_concurrent_rpcs``. A few are kept for
            CloseSession and health checks (``config.reserved_rpcs``).

    Raises:
        InvalidArgument: ``listen`` or ``max_workers`` is malformed.
        FailedPrecondition: the address is taken (by a live server on that unix socket, or
            any process on that TCP port) or cannot be bound; the message says which.
    """
    max_workers = config.max_concurrent_rpcs if max_workers is None else max_workers
    if max_workers < 2:
        raise InvalidArgument(f"max_workers={max_workers} must be >= 2")
    listen = config.listen if listen is None else listen
    where = ListenAddress.parse(listen)
    if where.unix_path is not None:
        _check_unix_path(listen, where.unix_path)
    token = None if config.auth_token_file is None else read_token(config.auth_token_file)
    credentials = server_credentials(config)
    if where.unix_path is not None:
        if credentials is not None:
            logger.warning("TLS is for TCP; the unix socket %s relies on its mode", listen)
            credentials = None
    else:
        assert where.host is not None
        tls = credentials is not None
        check_exposure(where.host, tls=tls, token=token is not None, insecure=config.insecure)

    health = HealthService()
    parts = assemble(config, on_health_change=health.publish)
    health.attach(parts.monitor)  # before the server starts, so before any health check
    # One thread per call gRPC lets in, so a call never waits in the executor's queue;
    # gRPC refuses the rest. CloseSession and health checks always find a thread: the other
    # calls never hold the reserve (api/admission.py).
    executor = futures.ThreadPoolExecutor(max_workers, thread_name_prefix="batchd-rpc")
    admission = Admission(
        max_calls=max_workers - reserved_rpcs(max_workers),
        client_max_calls=config.client_max_calls,
    )
    interceptors: list[grpc.ServerInterceptor] = [AdmissionInterceptor(admission)]
    if token is not None:
        interceptors.insert(0, TokenInterceptor(token))  # a refused call takes no place
    server = grpc.server(
        executor,
        options=[("grpc.so_reuseport", 0), *_KEEPALIVE_OPTIONS],
        maximum_concurrent_rpcs=max_workers,
        interceptors=interceptors,
    )
    servicer = LoaderServicer(parts.engine, parts.sessions, draining=lambda: parts.monitor.draining)
    loader_pb2_grpc.add_LoaderServicer_to_server(servicer, server)
    health_pb2_grpc.add_HealthServicer_to_server(health, server)
    services = (LOADER_SERVICE, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name)
    add_reflection(server, services, config)
    try:
        try:
            bound = _add_port(server, where, credentials)
        except RuntimeError:
            bound = 0  # grpcio raises now; it used to return 0 (grpc/grpc#16920)
        if bound == 0:
            if where.unix_path is not None:
                problem = "gRPC could not bind the socket (set GRPC_VERBOSITY=debug to see why)"
            else:
                assert where.host is not None and where.port is not None
                problem = _tcp_bind_problem(where.host, where.port)
            raise FailedPrecondition(f"cannot listen on {listen!r}: {problem}")
        server.start()
    except BaseException:
        server.stop(None)
        executor.shutdown(wait=False, cancel_futures=True)
        parts.close()
        raise

    if where.unix_path is not None:
        address, port = where.grpc_address, None
    else:
        address, port = f"{where.host}:{bound}", bound
    logger.info("batchd-server listening on %s", address)
    return RunningServer(server, executor, address, port, parts, admission)
