"""Which calls the server takes on when it is busy, and who a client is.

The server is gRPC's synchronous one: every call runs on a thread of a pool of
``max_concurrent_rpcs`` threads, and gRPC itself refuses a call beyond that many with
RESOURCE_EXHAUSTED. An inline stream holds its thread for its whole life, so without more
care 128 streams that never read (or a catalog that hangs every OpenSession) would take every
thread and a client could not even close its session. Here:

- **CloseSession and health checks are never counted.** Every other call must first take one
  of ``max_concurrent_rpcs - reserved`` places (:class:`Admission`); with none left it ends
  at once with RESOURCE_EXHAUSTED naming the limit. So ``reserved`` threads (and places under
  gRPC's own limit) are always there for the calls that free resources or report health.
- **One client may have ``client_max_calls`` counted calls at once**, so one client's idle
  streams leave room for everyone else.

Who a client is (:func:`client_identity`): the transport peer's address without the port
(``ipv4:10.0.0.5``, ``ipv6:[fd00::5]``; every unix-socket client is ``unix``), plus the
identity the client declares in the :data:`CLIENT_ID_KEY` metadata (the ``batchd`` client sends
``<hostname>/<pid>``, one per process; a client that declares none is ``anonymous``). The
declared part is the client's word: the per-client limits keep well-meaning clients from
crowding each other out (one trainer's runaway loop of Loaders), they do not stop a hostile
one, which can declare a new identity per call. Against that there are the global limits
(``max_concurrent_rpcs``, ``max_sessions``, the shm budget) and who may connect at all (the
socket's mode, TLS, the token).
"""

from __future__ import annotations

import logging
import threading
from collections import Counter
from collections.abc import Callable, Iterator
from typing import Any, Final, NoReturn

import grpc

from batchd._wire.metadata import CLIENT_ID_KEY, ERROR_CLASS_KEY
from batchd_server import metrics
from batchd_server.errors import ResourceExhausted

__all__ = [
    "CLIENT_ID_KEY",
    "UNCOUNTED_METHODS",
    "Admission",
    "AdmissionInterceptor",
    "Ticket",
    "client_identity",
]

logger = logging.getLogger(__name__)

MAX_CLIENT_ID_CHARS: Final = 128
UNCOUNTED_METHODS: Final = frozenset(
    {"/batchd.v1.Loader/CloseSession", "/grpc.health.v1.Health/Check"}
)
"""Calls that never wait for a place: what frees resources, and what reports health."""


def _declared(metadata: Any) -> str:
    for key, value in metadata or ():
        if key == CLIENT_ID_KEY:
            text = value.decode("latin-1") if isinstance(value, bytes) else str(value)
            text = "".join(c for c in text[:MAX_CLIENT_ID_CHARS] if 32 <= ord(c) < 127)
            return text or "anonymous"
    return "anonymous"


def client_identity(context: grpc.ServicerContext) -> str:
    """``"<transport host> <declared id>"``, e.g. ``"unix host-a/4242"`` or
    ``"ipv4:10.0.0.5 anonymous"`` (see the module's docstring)."""
    peer = context.peer() or "unknown"
    if peer.startswith("unix"):
        host = "unix"
    elif peer.startswith(("ipv4:", "ipv6:")):
        host = peer.rpartition(":")[0]
    else:
        host = peer
    return f"{host} {_declared(context.invocation_metadata())}"


class Ticket:
    """A place taken by one call; :meth:`release` gives it back (once, whoever calls)."""

    def __init__(self, admission: Admission, client: str) -> None:
        self._admission = admission
        self.client = client
        self._lock = threading.Lock()
        self._held = True

    def release(self) -> None:
        with self._lock:
            held, self._held = self._held, False
        if held:
            self._admission._give_back(self.client)


class Admission:
    """Counts the calls in progress, in all and per client; refuses one past either limit.

    Args:
        max_calls: Counted calls at once (``max_concurrent_rpcs`` less the reserve).
        client_max_calls: Counted calls one client may have at once.
    """

    def __init__(self, *, max_calls: int, client_max_calls: int) -> None:
        if max_calls < 1 or client_max_calls < 1:
            raise ValueError(f"limits must be >= 1, got {max_calls} and {client_max_calls}")
        self.max_calls = max_calls
        self.client_max_calls = client_max_calls
        self._lock = threading.Lock()
        self._total = 0
        self._by_client: Counter[str] = Counter()

    @property
    def calls(self) -> int:
        """Counted calls in progress."""
        return self._total

    def by_client(self) -> dict[str, int]:
        """Counted calls in progress, per client identity."""
        with self._lock:
            return dict(self._by_client)

    def admit(self, client: str, method: str) -> Ticket:
        """Take a place for a call of ``client``.

        Raises:
            ResourceExhausted: the server or the client is at its limit; the message says
                which, and how to raise it.
        """
        with self._lock:
            if self._total >= self.max_calls:
                metrics.REFUSED.labels("max_concurrent_rpcs").inc()
                raise ResourceExhausted(
                    f"the server is serving {self._total} calls, its limit (--max-concurrent-"
                    "rpcs, BATCHD_MAX_CONCURRENT_RPCS, less the places kept for CloseSession "
                    f"and health checks); {method} was refused. Retry later, close loaders "
                    "that are not read, use the shm transport (its streams hold no call), or "
                    "raise the limit"
                )
            mine = self._by_client[client]
            if mine >= self.client_max_calls:
                metrics.REFUSED.labels("client_max_calls").inc()
                raise ResourceExhausted(
                    f"client {client!r} has {mine} calls in progress (an open inline stream "
                    "is one for its whole life), its limit (--client-max-calls, "
                    f"BATCHD_CLIENT_MAX_CALLS={self.client_max_calls}); {method} was refused. "
                    "Close loaders this process does not read, or raise the limit"
                )
            self._total += 1
            self._by_client[client] = mine + 1
        return Ticket(self, client)

    def _give_back(self, client: str) -> None:
        with self._lock:
            self._total -= 1
            left = self._by_client[client] - 1
            if left > 0:
                self._by_client[client] = left
            else:
                del self._by_client[client]


def _refuse(context: grpc.ServicerContext, error: ResourceExhausted) -> NoReturn:
    context.set_trailing_metadata(((ERROR_CLASS_KEY, "ResourceExhausted"),))
    context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(error))
    raise AssertionError("context.abort returned")  # pragma: no cover


def _counted(
    behavior: Callable[[Any, grpc.ServicerContext], Any],
    admission: Admission,
    method: str,
    *,
    streaming: bool,
) -> Callable[[Any, grpc.ServicerContext], Any]:
    """``behavior`` run under a place of :class:`Admission`, given back however it ends."""

    def take(context: grpc.ServicerContext) -> Ticket:
        try:
            ticket = admission.admit(client_identity(context), method)
        except ResourceExhausted as e:
            logger.info("refused %s: %s", method, str(e).split(";", 1)[0])
            _refuse(context, e)
        # However the call ends (even while a stream's generator is suspended in a yield that
        # gRPC never resumes, a client that stopped reading and then went away).
        context.add_callback(ticket.release)
        return ticket

    if streaming:

        def stream(request: Any, context: grpc.ServicerContext) -> Iterator[Any]:
            ticket = take(context)
            try:
                yield from behavior(request, context)
            finally:
                ticket.release()

        return stream

    def unary(request: Any, context: grpc.ServicerContext) -> Any:
        ticket = take(context)
        try:
            return behavior(request, context)
        finally:
            ticket.release()

    return unary


class AdmissionInterceptor(grpc.ServerInterceptor):
    """Runs every call but :data:`UNCOUNTED_METHODS` under a place of ``admission``."""

    def __init__(self, admission: Admission) -> None:
        self._admission = admission

    def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], grpc.RpcMethodHandler | None],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler | None:
        handler = continuation(handler_call_details)
        method: str = getattr(handler_call_details, "method", "") or ""
        if handler is None or method in UNCOUNTED_METHODS:
            return handler
        name = method.rsplit("/", 1)[-1] or method
        options = {
            "request_deserializer": handler.request_deserializer,
            "response_serializer": handler.response_serializer,
        }
        if handler.request_streaming and handler.response_streaming:
            inner = _counted(handler.stream_stream, self._admission, name, streaming=True)
            return grpc.stream_stream_rpc_method_handler(inner, **options)
        if handler.request_streaming:
            inner = _counted(handler.stream_unary, self._admission, name, streaming=False)
            return grpc.stream_unary_rpc_method_handler(inner, **options)
        if handler.response_streaming:
            inner = _counted(handler.unary_stream, self._admission, name, streaming=True)
            return grpc.unary_stream_rpc_method_handler(inner, **options)
        inner = _counted(handler.unary_unary, self._admission, name, streaming=False)
        return grpc.unary_unary_rpc_method_handler(inner, **options)
