"""The standard gRPC health service (``grpc.health.v1.Health``) over :mod:`batchd_server.health`.

Service names a probe may ask about:

- ``""`` and ``batchd.v1.Loader``: **readiness**, SERVING only while the server may take
  sessions (shm free, catalog answering, every worker alive, not draining). Kubernetes'
  ``grpc`` readiness probe asks for ``""`` unless told otherwise.
- ``liveness``: SERVING while the process is not wedged; an unready server (its database is
  restarting) stays live, so a liveness probe does not restart it for nothing.

A NOT_SERVING answer carries its reason in the trailing metadata key :data:`REASON_KEY`
(UTF-8; ``batchd-server healthcheck`` prints it). The protocol has no field for it, and
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
from typing import TYPE_CHECKING, Final

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from batchd._proto.batchd.v1 import loader_pb2
from batchd_server import metrics
from batchd_server.api.admission import PeerLimit, Ticket, peer_address, refuse
from batchd_server.errors import ResourceExhausted

if TYPE_CHECKING:
    from batchd_server.health import HealthMonitor, HealthReport

__all__ = [
    "LIVENESS_SERVICE",
    "LOADER_SERVICE",
    "READINESS_SERVICES",
    "REASON_KEY",
    "WATCHED_SERVICES",
    "HealthService",
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
        metrics.READY.set(1 if report.ready else 0)

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
            if response.status == _NOT_SERVING and monitor is not None:
                reason = public_reason(monitor.report)
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


def check_server(target: str, *, service: str = "", timeout_s: float = 5.0) -> str | None:
    """Ask the server at ``target`` for ``service``'s health; None when SERVING, else one line
    saying what is wrong and what to do (``batchd-server healthcheck --target``)."""
    request = health_pb2.HealthCheckRequest(service=service)
    with grpc.insecure_channel(target) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        try:
            response, call = stub.Check.with_call(request, timeout=timeout_s)
        except grpc.RpcError as e:
            code = e.code() if isinstance(e, grpc.Call) else grpc.StatusCode.UNKNOWN
            details = (e.details() if isinstance(e, grpc.Call) else None) or str(e)
            if code == grpc.StatusCode.UNAVAILABLE:
                return (
                    f"nothing answers at {target} ({details}): start `batchd-server serve` "
                    "there, or pass the address it listens on with --target"
                )
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
