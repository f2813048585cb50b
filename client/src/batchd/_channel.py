"""The gRPC channel to a server: plaintext or TLS, with or without a bearer token.

``Loader`` and ``Catalog`` take ``auth_token=`` and ``tls_ca=`` (a PEM file), defaulting to
``$BATCHD_AUTH_TOKEN`` and ``$BATCHD_TLS_CA``; for mutual TLS the client's own certificate
and key come from ``$BATCHD_TLS_CLIENT_CERT`` and ``$BATCHD_TLS_CLIENT_KEY``. The token
rides on every call as ``authorization: Bearer ...`` metadata, added by an interceptor
(gRPC's own call credentials are silently dropped on a plaintext channel). Over a unix
socket the socket file's mode is what guards the server; TLS does not apply. A token sent
in plaintext to a host other than this machine is readable on the network: the client says
so once per target (:func:`open_channel`).

Every call also says who is calling: :data:`CLIENT_ID_KEY` metadata with ``<hostname>/<pid>``
(:func:`client_id`). The server counts its per-client limits and quotas by it (with the
transport's address), so one process's loaders cannot take what other processes need.
"""

from __future__ import annotations

import ipaddress
import logging
import os
import socket
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Final

import grpc

from batchd._wire.metadata import CLIENT_ID_KEY
from batchd._wire.tls import speaks_tls, tcp_host_port
from batchd.errors import BatchdError, InvalidArgument, Unavailable

__all__ = [
    "AUTH_TOKEN_ENV",
    "TLS_CA_ENV",
    "ChannelSecurity",
    "client_id",
    "explain_unreachable",
    "open_channel",
]

AUTH_TOKEN_ENV: Final = "BATCHD_AUTH_TOKEN"
TLS_CA_ENV: Final = "BATCHD_TLS_CA"
TLS_CLIENT_CERT_ENV: Final = "BATCHD_TLS_CLIENT_CERT"
TLS_CLIENT_KEY_ENV: Final = "BATCHD_TLS_CLIENT_KEY"
_Next = Callable[..., Any]


def _read_pem(path: str, what: str, source: str) -> bytes:
    try:
        with open(path, "rb") as f:
            return f.read()
    except OSError as e:
        raise InvalidArgument(
            f"cannot read the {what} {path!r} given by {source} ({e.strerror or e})"
        ) from e


@dataclass(frozen=True)
class ChannelSecurity:
    """How a client authenticates itself and the server. ``repr`` never shows the token."""

    auth_token: str | None = field(default=None, repr=False)
    tls_ca: bytes | None = field(default=None, repr=False)
    tls_ca_path: str | None = None
    client_cert: bytes | None = field(default=None, repr=False)
    client_key: bytes | None = field(default=None, repr=False)

    @classmethod
    def resolve(
        cls,
        auth_token: str | None = None,
        tls_ca: str | os.PathLike[str] | None = None,
        environ: Mapping[str, str] | None = None,
    ) -> ChannelSecurity:
        """The arguments, else the environment's ``BATCHD_*`` variables.

        Raises:
            InvalidArgument: a file cannot be read, or the token is not printable ASCII.
        """
        env = os.environ if environ is None else environ
        token = auth_token if auth_token is not None else env.get(AUTH_TOKEN_ENV) or None
        if token is not None:
            token = token.strip()
            if not token or not all(33 <= ord(c) < 127 for c in token):
                raise InvalidArgument(
                    f"auth_token (or ${AUTH_TOKEN_ENV}) must be printable ASCII without spaces"
                )
        ca_source = "tls_ca=" if tls_ca is not None else f"${TLS_CA_ENV}"
        ca_path = os.fspath(tls_ca) if tls_ca is not None else env.get(TLS_CA_ENV) or None
        ca = None if ca_path is None else _read_pem(ca_path, "TLS CA bundle", ca_source)
        cert_path, key_path = env.get(TLS_CLIENT_CERT_ENV), env.get(TLS_CLIENT_KEY_ENV)
        if bool(cert_path) != bool(key_path):
            raise InvalidArgument(
                f"mutual TLS needs both ${TLS_CLIENT_CERT_ENV} and ${TLS_CLIENT_KEY_ENV}"
            )
        cert = key = None
        if cert_path and key_path:
            if ca is None:
                raise InvalidArgument(
                    f"${TLS_CLIENT_CERT_ENV} is for TLS: also pass tls_ca= or set ${TLS_CA_ENV}"
                )
            cert = _read_pem(cert_path, "client certificate", f"${TLS_CLIENT_CERT_ENV}")
            key = _read_pem(key_path, "client key", f"${TLS_CLIENT_KEY_ENV}")
        return cls(token, ca, ca_path, cert, key)

    @property
    def tls(self) -> bool:
        return self.tls_ca is not None


def client_id() -> str:
    """This process as the server counts it: ``<hostname>/<pid>``."""
    return f"{socket.gethostname()}/{os.getpid()}"


class _Metadata(
    grpc.UnaryUnaryClientInterceptor,
    grpc.UnaryStreamClientInterceptor,
    grpc.StreamUnaryClientInterceptor,
    grpc.StreamStreamClientInterceptor,
):
    """Adds ``entries`` (the client's id; ``authorization: Bearer <token>``) to every call."""

    def __init__(self, entries: Sequence[tuple[str, str]]) -> None:
        self._entries = tuple(entries)

    def _details(self, details: Any) -> Any:
        metadata = [*(details.metadata or ()), *self._entries]
        return details._replace(metadata=metadata)

    def intercept_unary_unary(self, continuation: _Next, details: Any, request: Any) -> Any:
        return continuation(self._details(details), request)

    def intercept_unary_stream(self, continuation: _Next, details: Any, request: Any) -> Any:
        return continuation(self._details(details), request)

    def intercept_stream_unary(self, continuation: _Next, details: Any, requests: Any) -> Any:
        return continuation(self._details(details), requests)

    def intercept_stream_stream(self, continuation: _Next, details: Any, requests: Any) -> Any:
        return continuation(self._details(details), requests)


logger = logging.getLogger("batchd")
_WARNED_PLAINTEXT: set[str] = set()


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def warn_plaintext_token(target: str, security: ChannelSecurity) -> bool:
    """Log a warning (once per target) when ``security`` sends its token in plaintext to
    another machine; True when it warned."""
    if security.auth_token is None or security.tls or target in _WARNED_PLAINTEXT:
        return False
    where = tcp_host_port(target)
    if where is None or _is_loopback(where[0]):
        return False
    _WARNED_PLAINTEXT.add(target)
    logger.warning(
        "batchd: the auth token goes to %r in plaintext: anyone on the network between can "
        "read it. Serve TLS (batchd-server serve --tls-cert/--tls-key) and pass tls_ca= "
        "(or $BATCHD_TLS_CA), or reach the server over a unix socket",
        target,
    )
    return True


def open_channel(
    target: str, security: ChannelSecurity, options: Sequence[tuple[str, Any]] = ()
) -> grpc.Channel:
    """A channel to ``target`` secured as ``security`` says."""
    if security.tls and not target.startswith("unix:"):
        credentials = grpc.ssl_channel_credentials(
            root_certificates=security.tls_ca,
            private_key=security.client_key,
            certificate_chain=security.client_cert,
        )
        channel = grpc.secure_channel(target, credentials, options=list(options))
    else:
        channel = grpc.insecure_channel(target, options=list(options))
        warn_plaintext_token(target, security)
    entries = [(CLIENT_ID_KEY, client_id())]
    if security.auth_token is not None:
        entries.append(("authorization", f"Bearer {security.auth_token}"))
    return grpc.intercept_channel(channel, _Metadata(entries))


def explain_unreachable(error: BatchdError, target: str, security: ChannelSecurity) -> BatchdError:
    """``error`` with the reason when a failed connection is a TLS mismatch, else ``error``.

    A plaintext client against a TLS port sees only "connection closed"; this probes the
    port with a TLS handshake to say so plainly.
    """
    if not isinstance(error, Unavailable):
        return error
    where = tcp_host_port(target)
    if where is None:
        return error
    text = str(error)
    if security.tls:
        if "handshake" in text.lower() or "ssl" in text.lower() or "certificate" in text.lower():
            return Unavailable(
                f"the TLS handshake with {target!r} failed: the server may not use TLS (then "
                f"drop tls_ca= / ${TLS_CA_ENV}), or its certificate is not signed by the CA "
                f"in {security.tls_ca_path!r}, or it wants a client certificate "
                f"(${TLS_CLIENT_CERT_ENV}, ${TLS_CLIENT_KEY_ENV}). gRPC said: {text}"
            )
        return error
    if speaks_tls(*where):
        return Unavailable(
            f"the batchd server at {target!r} uses TLS and this client connected in "
            f"plaintext; pass tls_ca= (the CA's PEM file) or set ${TLS_CA_ENV}"
        )
    return error
