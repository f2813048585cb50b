"""The standard gRPC health service (``grpc.health.v1.Health``) over :mod:`batchd_server.health`.

Service names a probe may ask about:

- ``""`` and ``batchd.v1.Loader``: **readiness**, SERVING only while the server may take
  sessions (shm free, catalog answering, every worker alive, not draining). Kubernetes'
  ``grpc`` readiness probe asks for ``""`` unless told otherwise.
- ``liveness``: SERVING while the process is not wedged; an unready server (its database is
  restarting) stays live, so a liveness probe does not restart it for nothing.

A NOT_SERVING answer carries its reason in the trailing metadata key :data:`REASON_KEY`
(UTF-8; ``batchd-server healthcheck`` prints it). The protocol has no field for it, and
clients that do not look are unaffected.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Final

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from batchd._proto.batchd.v1 import loader_pb2
from batchd_server import metrics

if TYPE_CHECKING:
    from batchd_server.health import HealthMonitor, HealthReport

__all__ = [
    "LIVENESS_SERVICE",
    "LOADER_SERVICE",
    "READINESS_SERVICES",
    "REASON_KEY",
    "HealthService",
    "check_server",
]

LOADER_SERVICE: Final = loader_pb2.DESCRIPTOR.services_by_name["Loader"].full_name
READINESS_SERVICES: Final = ("", LOADER_SERVICE)
LIVENESS_SERVICE: Final = "liveness"
REASON_KEY: Final = "batchd-health-reason-bin"
"""Trailing metadata of a NOT_SERVING answer: why, UTF-8 (``-bin`` keys carry bytes)."""

_SERVING = health_pb2.HealthCheckResponse.SERVING
_NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


class HealthService(health.HealthServicer):
    """grpcio's health servicer, fed by a :class:`HealthMonitor` through :meth:`publish`."""

    def __init__(self) -> None:
        super().__init__()
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

    def Check(
        self, request: health_pb2.HealthCheckRequest, context: grpc.ServicerContext
    ) -> health_pb2.HealthCheckResponse:
        monitor = self._monitor
        if request.service == LIVENESS_SERVICE:
            live = monitor is None or monitor.live()
            return health_pb2.HealthCheckResponse(status=_SERVING if live else _NOT_SERVING)
        response: health_pb2.HealthCheckResponse = super().Check(request, context)
        if response.status == _NOT_SERVING and monitor is not None:
            reason = monitor.report.reason
            context.set_trailing_metadata(((REASON_KEY, reason.encode()),))
        return response


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
