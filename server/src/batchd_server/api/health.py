"""The standard gRPC health service (``grpc.health.v1.Health``) over :mod:`batchd_server.health`.

Service names a probe may ask about:

- ``""`` and ``batchd.v1.Loader``: **readiness**, SERVING only while the server may take
  sessions (shm free, catalog answering, every worker alive, not draining). Kubernetes'
  ``grpc`` readiness probe asks for ``""`` unless told otherwise.
- ``liveness``: SERVING while the process is not wedged; an unready server (its database is
  restarting) stays live, so a liveness probe does not restart it for nothing.

A NOT_SERVING answer carries its reason in the trailing metadata key :data:`REASON_KEY`
(UTF-8; ``batchd-server healthcheck`` prints it); a SERVING one carries there what is wrong
without making the server unready (the object store down: sessions served from the node
cache), when anything is. The protocol has no field for it, and
clients that do not look are unaffected. The caller needs no token, so the reason says which
check fails and what to look at, never the catalog's own error (its URL names the database's
user and host): that is in the server's log (:func:`public_reason`).

The service needs no token (``Check`` only, when the server has one: ``api/security.py``), so
it guards itself: ``Check`` and ``Watch`` are capped per peer address
(``admission.PeerLimit``), and ``Watch`` only watches the names above. grpcio's servicer
keeps an entry per watched name for as long as the server runs, and would take any name a
client sends (up to the 1 MiB a request may be).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Final

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from batchd._proto.batchd.v1 import loader_pb2
from batchd._wire.tls import speaks_tls, tcp_host_port
from batchd_server.api.admission import PeerLimit, Ticket, peer_address, refuse
from batchd_server.config import ServerConfig
from batchd_server.errors import ResourceExhausted
from batchd_server.metrics.admission import READY
from batchd_server.settings import setting_of

if TYPE_CHECKING:
    from batchd_server.health import HealthMonitor, HealthReport

__all__ = [
    "LIVENESS_SERVICE",
    "LOADER_SERVICE",
    "READINESS_SERVICES",
    "REASON_KEY",
    "WATCHED_SERVICES",
    "HealthService",
    "ProbeTls",
    "check_server",
    "public_reason",
]

LOADER_SERVICE: Final = loader_pb2.DESCRIPTOR.services_by_name["Loader"].full_name
READINESS_SERVICES: Final = ("", LOADER_SERVICE)
LIVENESS_SERVICE: Final = "liveness"
WATCHED_SERVICES: Final = (*READINESS_SERVICES, LIVENESS_SERVICE)
"""The names a ``Watch`` may ask about; any other is NOT_FOUND."""
REASON_KEY: Final = "batchd-health-reason-bin"
"""Trailing metadata of a NOT_SERVING answer: why, UTF-8 (``-bin`` keys carry bytes)."""
_CATALOG_REASON: Final = (
    "the catalog database does not answer (the server's log has the database's error); "
    "check that it is up and reachable from the server (BATCHD_DATABASE_URL)"
)

_NAME_OVERRIDE: Final = "grpc.ssl_target_name_override"

_SERVING = health_pb2.HealthCheckResponse.SERVING
_NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


def public_reason(report: HealthReport) -> str:
    """``report.reason`` fit for a caller without a token: the catalog's own error (which
    names its URL's user and host) becomes a pointer to the server's log, which has it."""
    problems = report.problems
    return "; ".join(_CATALOG_REASON if p.check == "catalog" else p.message for p in problems)


class HealthService(health.HealthServicer):
    """grpcio's health servicer, fed by a :class:`HealthMonitor` through :meth:`publish`.

    Args:
        peers: Caps the calls in progress per peer address (see the module's docstring).
    """

    def __init__(self, peers: PeerLimit | None = None) -> None:
        super().__init__()  # makes Watch non-blocking: an open one holds no thread
        self._peers = PeerLimit() if peers is None else peers
        self._monitor: HealthMonitor | None = None
        for service in READINESS_SERVICES:
            self.set(service, _NOT_SERVING)  # until the first report says otherwise
        self.set(LIVENESS_SERVICE, _SERVING)

    def attach(self, monitor: HealthMonitor) -> None:
        """Answer liveness and reasons from ``monitor`` (before it starts)."""
        self._monitor = monitor

    def publish(self, report: HealthReport) -> None:
        """Set every readiness service to what ``report`` says (the monitor's ``on_change``)."""
        status = _SERVING if report.ready else _NOT_SERVING
        for service in READINESS_SERVICES:
            self.set(service, status)
        READY.set(1 if report.ready else 0)

    def _admit(self, context: grpc.ServicerContext, method: str) -> Ticket:
        try:
            return self._peers.take(peer_address(context), method)
        except ResourceExhausted as e:
            refuse(context, e)

    def Check(
        self, request: health_pb2.HealthCheckRequest, context: grpc.ServicerContext
    ) -> health_pb2.HealthCheckResponse:
        ticket = self._admit(context, "Check")
        try:
            monitor = self._monitor
            if request.service == LIVENESS_SERVICE:
                live = monitor is None or monitor.live()
                return health_pb2.HealthCheckResponse(status=_SERVING if live else _NOT_SERVING)
            response: health_pb2.HealthCheckResponse = super().Check(request, context)
            if monitor is not None:
                report = monitor.report
                reason = (
                    public_reason(report)
                    if response.status == _NOT_SERVING
                    else "; ".join(report.notes)
                )
                if reason:
                    context.set_trailing_metadata(((REASON_KEY, reason.encode()),))
            return response
        finally:
            ticket.release()

    def Watch(
        self,
        request: health_pb2.HealthCheckRequest,
        context: grpc.ServicerContext,
        send_response_callback: Callable[[health_pb2.HealthCheckResponse | None], None]
        | None = None,
    ) -> object:
        """grpcio's Watch, for :data:`WATCHED_SERVICES` only, under a place of the peer's."""
        if request.service not in WATCHED_SERVICES:
            names = ", ".join(repr(s) for s in WATCHED_SERVICES)
            context.abort(
                grpc.StatusCode.NOT_FOUND,
                f"this server watches the health of {names} only; the name asked for "
                f"({len(request.service)} characters) is none of them",
            )
        ticket = self._admit(context, "Watch")
        # However the call ends; False: it already has, and nothing else will release it.
        if not context.add_callback(ticket.release):
            ticket.release()
        try:
            return super().Watch(request, context, send_response_callback)
        except BaseException:
            ticket.release()
            raise


@dataclass(frozen=True)
class ProbeTls:
    """How :func:`check_server` speaks TLS to a TCP target (PEM bytes; the paths and the
    flags that gave them for its messages)."""

    ca: bytes
    ca_path: str
    client_cert: bytes | None = field(default=None, repr=False)
    client_key: bytes | None = field(default=None, repr=False)
    server_name: str | None = None
    """The name the server's certificate must have; None: the target's host."""


def check_server(
    target: str, *, service: str = "", timeout_s: float = 5.0, tls: ProbeTls | None = None
) -> str | None:
    """Ask the server at ``target`` for ``service``'s health; None when SERVING, else one line
    saying what is wrong and what to do (``batchd-server healthcheck --target``).

    Args:
        tls: Speak TLS to a TCP target (a unix socket has none); None: plaintext.
    """
    request = health_pb2.HealthCheckRequest(service=service)
    tcp = tcp_host_port(target)
    with _probe_channel(target, tls if tcp is not None else None) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        try:
            response, call = stub.Check.with_call(request, timeout=timeout_s)
        except grpc.RpcError as e:
            code = e.code() if isinstance(e, grpc.Call) else grpc.StatusCode.UNKNOWN
            details = (e.details() if isinstance(e, grpc.Call) else None) or str(e)
            if code == grpc.StatusCode.UNAVAILABLE:
                return _unavailable(target, details, tls if tcp is not None else None, tcp)
            if code == grpc.StatusCode.DEADLINE_EXCEEDED:
                return (
                    f"the server at {target} did not answer its health check within "
                    f"{timeout_s:g} s: it may be wedged or overloaded; its log may say why"
                )
            if code == grpc.StatusCode.NOT_FOUND:
                return (
                    f"the server at {target} knows no health service {service!r}; ask for "
                    f"'' (readiness) or {LIVENESS_SERVICE!r}"
                )
            return f"the health check of {target} failed with {code.name}: {details}"
    if response.status == _SERVING:
        return None
    reason = next(
        (v for k, v in call.trailing_metadata() or () if k == REASON_KEY), b"no reason given"
    )
    text = reason.decode(errors="replace") if isinstance(reason, bytes) else str(reason)
    status = health_pb2.HealthCheckResponse.ServingStatus.Name(response.status)
    return f"the server at {target} is {status}: {text}"


def _probe_channel(target: str, tls: ProbeTls | None) -> grpc.Channel:
    if tls is None:
        return grpc.insecure_channel(target)
    credentials = grpc.ssl_channel_credentials(
        root_certificates=tls.ca, private_key=tls.client_key, certificate_chain=tls.client_cert
    )
    options = [] if tls.server_name is None else [(_NAME_OVERRIDE, tls.server_name)]
    return grpc.secure_channel(target, credentials, options=options)


def _unavailable(
    target: str, details: str, tls: ProbeTls | None, tcp: tuple[str, int] | None
) -> str:
    """The line for a health check that found no server to answer it: why, where it shows."""
    found = details.lower()
    if tcp is None or "connection refused" in found or "failed to connect to remote" in found:
        return (
            f"nothing answers at {target} ({details}): start `batchd-server serve` there, or "
            "pass the address it listens on with --target"
        )
    ca_flag = _flag("healthcheck_tls_ca")
    if tls is None:
        if speaks_tls(*tcp):
            return (
                f"the server at {target} serves TLS and the health check spoke plaintext: pass "
                f"{ca_flag} with the PEM of the CA that signed its certificate"
            )
        return f"the server at {target} is unavailable ({details})"
    cert_flag, key_flag = _flag("healthcheck_tls_client_cert"), _flag("healthcheck_tls_client_key")
    name = tls.server_name or tcp[0]
    if "wrong_version_number" in found:
        hint = f"it does not serve TLS: leave out {ca_flag}"
    elif "hostname verification" in found:
        hint = (
            f"its certificate does not name {name!r}: pass --tls-server-name with a name the "
            "certificate has"
        )
    elif "certificate_verify_failed" in found:
        hint = f"its certificate is not signed by the CA in {tls.ca_path} ({ca_flag})"
    elif tls.client_cert is None:
        hint = f"it may want a client certificate (mutual TLS): pass {cert_flag} and {key_flag}"
    else:
        hint = (
            f"it may not trust the client certificate of {cert_flag} (signed by another CA), "
            f"or its certificate is not signed by the CA in {tls.ca_path} ({ca_flag})"
        )
    return f"the TLS health check of {target} failed ({details}): {hint}"


def _flag(name: str) -> str:
    return setting_of(ServerConfig, name).flag or name
