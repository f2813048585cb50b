"""Whether a TCP target speaks TLS: the probe both sides use to explain a failed connection.

A plaintext gRPC client against a TLS port (or the reverse) sees only "connection closed";
the client (``batchd._channel.explain_unreachable``) and the server's health check
(``batchd_server.api.health.check_server``) probe the port with a TLS handshake to say so
plainly. Plain ``ssl`` and ``socket``: no grpc.
"""

from __future__ import annotations

import socket
import ssl
from typing import Final

__all__ = ["PROBE_TIMEOUT_S", "speaks_tls", "tcp_host_port"]

PROBE_TIMEOUT_S: Final = 2.0
"""How long a TLS probe waits for the connection and the handshake, in seconds."""
_SCHEMES: Final = ("dns:///", "dns:", "ipv4:", "ipv6:")


def tcp_host_port(target: str) -> tuple[str, int] | None:
    """``target``'s host and port; None for a unix socket (or an address gRPC resolves).

    ``dns:///host:port`` and ``[::1]:port`` give ``("host", port)`` and ``("::1", port)``.
    """
    for prefix in _SCHEMES:
        target = target.removeprefix(prefix)
    host, sep, port = target.rpartition(":")
    if target.startswith("unix") or not sep or not port.isdigit():
        return None
    return host.removeprefix("[").removesuffix("]"), int(port)


def speaks_tls(host: str, port: int, timeout_s: float = PROBE_TIMEOUT_S) -> bool:
    """Whether a TLS handshake with ``host:port`` completes (certificate not checked)."""
    context = ssl.create_default_context()
    context.check_hostname = False
    context.verify_mode = ssl.CERT_NONE
    context.set_alpn_protocols(["h2"])
    try:
        with (
            socket.create_connection((host, port), timeout=timeout_s) as raw,
            context.wrap_socket(raw, server_hostname=host),
        ):
            return True
    except ssl.SSLError as e:
        # A server that wants our certificate (mutual TLS) still speaks TLS.
        return "CERTIFICATE" in str(e).upper()
    except OSError:
        return False
