"""Which calls the server takes on when it is busy, and who a client is.

The server is gRPC's synchronous one: every call runs on a thread of a pool of
``max_concurrent_rpcs`` threads, and gRPC itself refuses a call beyond that many with
RESOURCE_EXHAUSTED. An inline stream holds its thread for its whole life, so without more
care 128 streams that never read (or a catalog that hangs every OpenSession) would take every
thread and a client could not even close its session. Here:

- **CloseSession and the health service are never counted.** Every other call must first
  take one of ``max_concurrent_rpcs - reserved`` places (:class:`Admission`); with none left
  it ends at once with RESOURCE_EXHAUSTED naming the limit. So ``reserved`` threads (and
  places under gRPC's own limit) are always there for the calls that free resources or
  report health.
- **One client may have ``client_max_calls`` counted calls at once**, so one client's idle
  streams leave room for everyone else.
- **The health service's calls are capped per peer address instead** (:class:`PeerLimit`,
  :data:`OPEN_CALLS_PER_PEER` at once): a probe needs no token and declares no identity, so
  its calls are counted by where they come from. A ``Watch`` holds no thread while it waits
  (grpcio's health servicer answers it from the status changes), so the cap is what bounds
  the watchers, not the places.

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
from batchd_server.errors import ResourceExhausted
from batchd_server.metrics.admission import REFUSED

__all__ = [
    "CLIENT_ID_KEY",
    "MAX_OPEN_CALLS",
    "OPEN_CALLS_PER_PEER",
    "UNCOUNTED_METHODS",
    "Admission",
    "AdmissionInterceptor",
    "PeerLimit",
    "Ticket",
    "client_identity",
    "peer_address",
    "refuse",
]

logger = logging.getLogger(__name__)

MAX_CLIENT_ID_CHARS: Final = 128
UNCOUNTED_METHODS: Final = frozenset(
    {
        "/batchd.v1.Loader/CloseSession",
        "/grpc.health.v1.Health/Check",
        "/grpc.health.v1.Health/Watch",
    }
)
"""Calls that never wait for a place: what frees resources, and what reports health (the
health service caps its calls per peer itself, :class:`PeerLimit`)."""
OPEN_CALLS_PER_PEER: Final = 4
"""Health calls (``Check`` and ``Watch``) one peer address may have in progress at once: a
kubelet's readiness and liveness probes, and a watching load balancer, with room to spare."""
MAX_OPEN_CALLS: Final = 256
"""Health calls in progress at once from all peers (each open ``Watch`` costs a little
memory, no thread)."""


def _declared(metadata: Any) -> str:
    for key, value in metadata or ():
        if key == CLIENT_ID_KEY:
            text = value.decode("latin-1") if isinstance(value, bytes) else str(value)
            text = "".join(c for c in text[:MAX_CLIENT_ID_CHARS] if 32 <= ord(c) < 127)
            return text or "anonymous"
    return "anonymous"


def peer_address(context: grpc.ServicerContext) -> str:
    """Where a call comes from, without the port: ``"ipv4:10.0.0.5"``, ``"ipv6:[fd00::5]"``,
    ``"unix"`` (every unix-socket client)."""
    peer = context.peer() or "unknown"
    if peer.startswith("unix"):
        return "unix"
    if peer.startswith(("ipv4:", "ipv6:")):
        return peer.rpartition(":")[0]
    return peer[:MAX_CLIENT_ID_CHARS]


def client_identity(context: grpc.ServicerContext) -> str:
    """``"<transport host> <declared id>"``, e.g. ``"unix host-a/4242"`` or
    ``"ipv4:10.0.0.5 anonymous"`` (see the module's docstring)."""
    return f"{peer_address(context)} {_declared(context.invocation_metadata())}"


class Ticket:
    """A place taken by one call; :meth:`release` gives it back (once, whoever calls)."""

    def __init__(self, give_back: Callable[[str], None], client: str) -> None:
        self._give_back = give_back
        self.client = client
        self._lock = threading.Lock()
        self._held = True

    def release(self) -> None:
        with self._lock:
            held, self._held = self._held, False
        if held:
            self._give_back(self.client)


class PeerLimit:
    """Counts the health service's calls in progress per peer address and in all; refuses
    one past either limit.

    Args:
        per_peer: Calls one peer address may have at once.
        total: Calls at once from all peers.
    """

    def __init__(self, *, per_peer: int = OPEN_CALLS_PER_PEER, total: int = MAX_OPEN_CALLS) -> None:
        if per_peer < 1 or total < per_peer:
            raise ValueError(f"need 1 <= per_peer <= total, got {per_peer} and {total}")
        self.per_peer = per_peer
        self.total = total
        self._lock = threading.Lock()
        self._by_peer: Counter[str] = Counter()

    def by_peer(self) -> dict[str, int]:
        """Calls in progress, per peer address."""
        with self._lock:
            return dict(self._by_peer)

    def take(self, peer: str, method: str) -> Ticket:
        """Take a place for a call from ``peer``.

        Raises:
            ResourceExhausted: ``peer``, or all peers together, are at the limit.
        """
        with self._lock:
            mine = self._by_peer[peer]
            if mine >= self.per_peer:
                REFUSED.labels("open_calls_per_peer").inc()
                raise ResourceExhausted(
                    f"{peer} has {mine} health calls in progress, the most one address may "
                    f"have; {method} was refused. Close the Watch streams it does not need, "
                    "or probe with Check"
                )
            if self._by_peer.total() >= self.total:
                REFUSED.labels("open_calls").inc()
                raise ResourceExhausted(
                    f"the server has {self.total} health calls in progress, its limit; "
                    f"{method} was refused. Retry later"
                )
            self._by_peer[peer] = mine + 1
        return Ticket(self._give_back, peer)

    def _give_back(self, peer: str) -> None:
        with self._lock:
            left = self._by_peer[peer] - 1
            if left > 0:
                self._by_peer[peer] = left
            else:
                del self._by_peer[peer]


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
                REFUSED.labels("max_concurrent_rpcs").inc()
                raise ResourceExhausted(
                    f"the server is serving {self._total} calls, its limit (--max-concurrent-"
                    "rpcs, BATCHD_MAX_CONCURRENT_RPCS, less the places kept for CloseSession "
                    f"and health checks); {method} was refused. Retry later, close loaders "
                    "that are not read, use the shm transport (its streams hold no call), or "
                    "raise the limit"
                )
            mine = self._by_client[client]
            if mine >= self.client_max_calls:
                REFUSED.labels("client_max_calls").inc()
                raise ResourceExhausted(
                    f"client {client!r} has {mine} calls in progress (an open inline stream "
                    "is one for its whole life), its limit (--client-max-calls, "
                    f"BATCHD_CLIENT_MAX_CALLS={self.client_max_calls}); {method} was refused. "
                    "Close loaders this process does not read, or raise the limit"
                )
            self._total += 1
            self._by_client[client] = mine + 1
        return Ticket(self._give_back, client)

    def _give_back(self, client: str) -> None:
        with self._lock:
            self._total -= 1
            left = self._by_client[client] - 1
            if left > 0:
                self._by_client[client] = left
            else:
                del self._by_client[client]


def refuse(context: grpc.ServicerContext, error: ResourceExhausted) -> NoReturn:
    """End the call with RESOURCE_EXHAUSTED and ``error``'s message (raises)."""
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
            refuse(context, e)
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
