"""Who may talk to the server: TLS (or mutual TLS) and a bearer token on TCP.

A unix socket is guarded by its file mode (0600: the server's user only; the sidecar's
trainer runs as that user). A TCP listener is reachable by anyone who can route to it, so
one on a non-loopback address must have TLS or a token (or ``--insecure``, said out loud).
The token travels as ``authorization: Bearer <token>`` metadata, is compared in constant
time and never logged. Only the health ``Check`` stays open without it, so probes (which
cannot carry a token) keep working; ``Watch`` and reflection need the token like everything
else (the health service caps its calls per peer address: ``api/health.py``).

gRPC reflection (what ``grpcurl`` reads to list services without the .proto files) is off
unless the operator turns it on (:func:`add_reflection`): it tells whoever asks what the
server serves, and its stream waits for requests while holding a call.
"""

from __future__ import annotations

import hmac
import ipaddress
import logging
import os
import socket
import stat
from collections.abc import Callable
from pathlib import Path
from typing import Any, Final, NoReturn

import grpc
from grpc_reflection.v1alpha import reflection

from batchd._wire.metadata import ERROR_CLASS_KEY
from batchd_server.config import ServerConfig
from batchd_server.errors import FailedPrecondition

__all__ = [
    "AUTH_METADATA_KEY",
    "OPEN_METHODS",
    "SERVE_REFLECTION",
    "TokenInterceptor",
    "add_reflection",
    "check_exposure",
    "is_loopback_host",
    "read_token",
    "server_credentials",
]

logger = logging.getLogger(__name__)

AUTH_METADATA_KEY: Final = "authorization"
_BEARER: Final = "bearer "
OPEN_METHODS: Final = frozenset({"/grpc.health.v1.Health/Check"})
"""Methods callable without a token: what a probe (kubelet's ``grpc``, ``grpc_health_probe``,
``batchd-server healthcheck``) calls."""
SERVE_REFLECTION = False
"""Serve gRPC reflection even where the configuration does not ask for it (tests flip it).
The operator's switch is ``ServerConfig.reflection`` (see :func:`add_reflection`)."""
_MAX_TOKEN_BYTES: Final = 4096


def _read(path: Path, what: str, flag: str) -> bytes:
    try:
        return path.read_bytes()
    except OSError as e:
        raise FailedPrecondition(
            f"cannot read the {what} {path} ({e.strerror or e}); fix {flag} or the file's "
            "permissions"
        ) from e


def read_token(path: Path) -> bytes:
    """The token in ``path``, surrounding whitespace removed.

    Raises:
        FailedPrecondition: unreadable, empty, too long or not printable ASCII.
    """
    token = _read(path, "auth token file", "--auth-token-file (BATCHD_AUTH_TOKEN_FILE)").strip()
    if not token or len(token) > _MAX_TOKEN_BYTES or not all(33 <= b < 127 for b in token):
        raise FailedPrecondition(
            f"the auth token file {path} must hold one token of 1 to {_MAX_TOKEN_BYTES} "
            "printable ASCII characters without spaces (e.g. from `openssl rand -hex 32`)"
        )
    mode = path.stat().st_mode
    if mode & (stat.S_IRWXG | stat.S_IRWXO):
        logger.warning(
            "the auth token file %s is readable by other users (mode %o); chmod 600 it",
            path,
            stat.S_IMODE(mode),
        )
    return token


def server_credentials(config: ServerConfig) -> grpc.ServerCredentials | None:
    """TLS credentials from ``config``'s PEM files; None without ``tls_cert``.

    Raises:
        FailedPrecondition: a file cannot be read.
    """
    if config.tls_cert is None or config.tls_key is None:
        return None
    chain = _read(config.tls_cert, "TLS certificate", "--tls-cert (BATCHD_TLS_CERT)")
    key = _read(config.tls_key, "TLS key", "--tls-key (BATCHD_TLS_KEY)")
    client_ca = None
    if config.tls_client_ca is not None:
        client_ca = _read(
            config.tls_client_ca, "client CA bundle", "--tls-client-ca (BATCHD_TLS_CLIENT_CA)"
        )
    return grpc.ssl_server_credentials(
        [(key, chain)], root_certificates=client_ca, require_client_auth=client_ca is not None
    )


def is_loopback_host(host: str) -> bool:
    """Whether ``host`` (as in ``--listen host:port``) only ever means this machine."""
    name = host.removeprefix("[").removesuffix("]")
    if name == "localhost":
        return True
    try:
        return ipaddress.ip_address(name).is_loopback
    except ValueError:
        pass
    try:
        infos = socket.getaddrinfo(name, None, type=socket.SOCK_STREAM)
    except socket.gaierror:
        return False
    addresses = {str(info[4][0]).split("%", 1)[0] for info in infos}
    return bool(addresses) and all(ipaddress.ip_address(a).is_loopback for a in addresses)


def check_exposure(host: str, *, tls: bool, token: bool, insecure: bool) -> None:
    """Refuse a non-loopback TCP listener that lets anyone in, unless ``insecure``.

    Raises:
        FailedPrecondition: it would, and ``insecure`` is not set.
    """
    if is_loopback_host(host):
        return
    if tls or token:
        if not tls:
            logger.warning(
                "listening on %s with a token but without TLS: the token crosses the network "
                "in clear text; add --tls-cert and --tls-key",
                host,
            )
        return
    if not insecure:
        raise FailedPrecondition(
            f"refusing to listen on {host!r} with neither TLS nor a token: anyone who can "
            "reach the port could read every dataset. Set --tls-cert/--tls-key and/or "
            "--auth-token-file (BATCHD_TLS_CERT, BATCHD_TLS_KEY, BATCHD_AUTH_TOKEN_FILE), "
            "listen on 127.0.0.1 or a unix socket, or pass --insecure (BATCHD_INSECURE=1) "
            "on a trusted network"
        )
    logger.warning(
        "INSECURE: listening on %s with neither TLS nor a token (--insecure); anyone who can "
        "reach this port can read every dataset the catalog names",
        host,
    )


def _refuse(message: str) -> Callable[[Any, grpc.ServicerContext], NoReturn]:
    def refuse(request: Any, context: grpc.ServicerContext) -> NoReturn:
        context.set_trailing_metadata(((ERROR_CLASS_KEY, "Unauthenticated"),))
        context.abort(grpc.StatusCode.UNAUTHENTICATED, message)
        raise AssertionError("context.abort returned")  # pragma: no cover

    return refuse


class TokenInterceptor(grpc.ServerInterceptor):
    """Refuses, with UNAUTHENTICATED, every call without the right bearer token, except to
    :data:`OPEN_METHODS`."""

    def __init__(self, token: bytes) -> None:
        self._token = token

    def _problem(self, metadata: tuple[tuple[str, str | bytes], ...] | None) -> str | None:
        values = [v for k, v in metadata or () if k == AUTH_METADATA_KEY]
        if not values:
            return (
                "this batchd server requires an auth token and the call carried none; pass "
                "auth_token= or set BATCHD_AUTH_TOKEN"
            )
        value = values[0]
        text = value.decode("latin-1") if isinstance(value, bytes) else value
        given = text[len(_BEARER) :] if text[: len(_BEARER)].lower() == _BEARER else ""
        if len(values) > 1 or not hmac.compare_digest(given.encode("latin-1"), self._token):
            return (
                "the auth token is wrong; pass the server's token (its --auth-token-file) as "
                "auth_token= or BATCHD_AUTH_TOKEN"
            )
        return None

    def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], grpc.RpcMethodHandler | None],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler | None:
        method: str = getattr(handler_call_details, "method", "") or ""
        if method in OPEN_METHODS:
            return continuation(handler_call_details)
        problem = self._problem(getattr(handler_call_details, "invocation_metadata", None))
        if problem is None:
            return continuation(handler_call_details)
        handler = continuation(handler_call_details)
        if handler is None:
            return None  # UNIMPLEMENTED either way
        logger.info("refused a %s call: %s", method, problem.split(";", 1)[0])
        refuse = _refuse(problem)
        if handler.request_streaming and handler.response_streaming:
            return grpc.stream_stream_rpc_method_handler(refuse)
        if handler.request_streaming:
            return grpc.stream_unary_rpc_method_handler(refuse)
        if handler.response_streaming:
            return grpc.unary_stream_rpc_method_handler(refuse)
        return grpc.unary_unary_rpc_method_handler(refuse)


def restrict_unix_socket(path: Path) -> None:
    """Make the gRPC unix socket ``path`` mode 0600, like the doorbell."""
    os.chmod(path, 0o600)


def add_reflection(server: grpc.Server, services: tuple[str, ...], config: ServerConfig) -> bool:
    """Serve gRPC reflection for ``services`` if the operator asked for it.

    Asked for: ``config.reflection`` (``--reflection``, ``BATCHD_REFLECTION``) where the
    configuration has that setting, or :data:`SERVE_REFLECTION`.

    Returns:
        Whether reflection is served.
    """
    wanted = SERVE_REFLECTION or bool(getattr(config, "reflection", False))
    if wanted:
        reflection.enable_server_reflection((*services, reflection.SERVICE_NAME), server)
        logger.info("serving gRPC reflection (--reflection): it lists this server's services")
    return wanted
