"""How the server serves: the addresses it listens on (gRPC and metrics), who may call it
(TLS, the token), how many calls it runs at once, its health checks and heartbeats, and how
it shuts down; and how ``healthcheck --target`` reaches a TLS server (:class:`ServiceSettings`).
And the sessions it serves: how many a server and a client may hold, how long one lives
without a stream, and which dataset roots they may read (:class:`SessionSettings`).

These are the settings of ``api/``, ``health.py`` and ``sessions/``, declared beside them
rather than in them: ``api/`` imports grpc and ``sessions/`` the whole data path, and the
configuration is read by every command, ``--help`` included, which must load neither.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

from batchd_server.settings import (
    Check,
    Setting,
    at_least,
    count,
    host_port,
    path,
    seconds,
    setting,
    setting_of,
    size,
    split_host_port,
    switch,
    within,
)

__all__ = [
    "DEFAULT_GRACE_S",
    "DEFAULT_LISTEN",
    "ServiceSettings",
    "SessionSettings",
    "reserved_rpcs",
]

DEFAULT_LISTEN: Final = "127.0.0.1:50051"
DEFAULT_GRACE_S: Final = 20.0
"""Below Kubernetes' default terminationGracePeriodSeconds (30), so the pod exits by itself."""
_CHECK: Final = ("healthcheck",)


def reserved_rpcs(max_concurrent_rpcs: int) -> int:
    """Of ``max_concurrent_rpcs`` calls, those kept for CloseSession and health checks: an
    eighth, at least 1 and at most 8."""
    return max(1, min(8, max_concurrent_rpcs // 8))


def _pem(help: str, **more: Any) -> Any:
    """A :func:`~batchd_server.settings.path` setting of a PEM file."""
    return path(help, metavar="PEM", **more)


@dataclass(frozen=True, kw_only=True)
class ServiceSettings:
    """How the server serves."""

    listen: str = setting(
        flag="--listen",
        default=DEFAULT_LISTEN,
        help="where to serve gRPC: unix:///path/batchd.sock or host:port (port 0 picks a free one)",
        metavar="ADDRESS",
    )

    metrics_port: int | None = count(
        flag="--metrics-port",
        default=None,
        check=within(0, 65535),
        help="serve Prometheus metrics on this port, on the --listen host (127.0.0.1 for a "
        "unix socket); --metrics-listen wins",
        metavar="P",
    )

    metrics_listen: str | None = setting(
        flag="--metrics-listen",
        default=None,
        check=host_port,
        help="serve Prometheus metrics at http://HOST:PORT/metrics (0.0.0.0:9400 for every "
        "interface)",
        metavar="HOST:PORT",
    )

    max_concurrent_rpcs: int = count(
        flag="--max-concurrent-rpcs",
        default=128,
        check=at_least(2, why=": one for CloseSession and health checks, one for the rest"),
        help="gRPC calls served at once, each on a thread of its own (an open inline stream "
        "holds one for its whole life); more is RESOURCE_EXHAUSTED at once. An eighth "
        "(1 to 8) is kept for CloseSession and health checks, which the other calls "
        "never take",
    )

    client_max_calls: int = count(
        flag="--client-max-calls",
        default=32,
        help="gRPC calls one client may have running at once (its streams count for their life)",
    )

    grace_s: float = seconds(
        flag="--grace-s",
        default=DEFAULT_GRACE_S,
        check=within(0, 3600, low_open=True),
        help="on SIGTERM, end streams, stop workers and remove segments within this many "
        "seconds; the default is below Kubernetes' terminationGracePeriodSeconds (30)",
    )

    health_interval_s: float = seconds(
        env="BATCHD_HEALTH_INTERVAL_S",
        default=2.0,
        check=within(0, 600, low_open=True),
        help="seconds between health checks (shm, workers) and between catalog probes",
    )

    catalog_timeout_s: float = seconds(
        env="BATCHD_CATALOG_TIMEOUT_S",
        default=5.0,
        check=within(0, 600, low_open=True),
        help="seconds a catalog probe may go unanswered before the server says NOT_SERVING",
    )

    heartbeat_interval_s: float = seconds(
        flag="--heartbeat-interval-s",
        default=5.0,
        check=within(0, 600, note=", 0 for none"),
        help="while a doorbell stream waits for batches, send a heartbeat after this many "
        "seconds without another frame, so clients tell a silent server from a slow "
        "batch; 0: none",
    )

    reflection: bool = switch(
        flag="--reflection",
        help="serve gRPC reflection (grpcurl can then list the services); it needs the token "
        "like every call but the health Check",
    )

    tls_cert: Path | None = _pem(
        flag="--tls-cert",
        help="serve TCP with TLS: the PEM certificate chain to present (with --tls-key)",
    )

    tls_key: Path | None = _pem(
        flag="--tls-key",
        help="the PEM private key of --tls-cert",
    )

    tls_client_ca: Path | None = _pem(
        flag="--tls-client-ca",
        help="mutual TLS: require client certificates signed by this PEM CA bundle",
    )

    auth_token_file: Path | None = path(
        flag="--auth-token-file",
        help="every call but the health Check must carry the bearer token held in FILE",
        metavar="FILE",
    )

    insecure: bool = switch(
        flag="--insecure",
        help="allow a non-loopback TCP listener with neither TLS nor a token",
    )

    healthcheck_tls_ca: Path | None = _pem(
        flag="--tls-ca",
        help="healthcheck --target over TLS: the PEM CA bundle that signed the server's "
        "certificate (the variable the client library reads too)",
        commands=_CHECK,
    )

    healthcheck_tls_client_cert: Path | None = _pem(
        flag="--tls-client-cert",
        help="healthcheck --target of a mutual-TLS server: the PEM client certificate to "
        "present (with --tls-client-key and --tls-ca)",
        commands=_CHECK,
    )

    healthcheck_tls_client_key: Path | None = _pem(
        flag="--tls-client-key",
        help="the PEM private key of --tls-client-cert",
        commands=_CHECK,
    )

    def check_service(self) -> None:
        """Raises ValueError when the TLS settings do not go together."""
        cert, key = _setting("tls_cert"), _setting("tls_key")
        if (self.tls_cert is None) != (self.tls_key is None):
            raise ValueError(
                f"TLS needs both a certificate and its key: set {cert.flag} and {key.flag} "
                f"({cert.env}, {key.env}) together"
            )
        if self.tls_client_ca is not None and self.tls_cert is None:
            ca = _setting("tls_client_ca")
            raise ValueError(
                f"{ca.flag} ({ca.env}) asks for mutual TLS, which needs the server's own "
                f"{cert.flag} and {key.flag}"
            )

    @property
    def reserved_rpcs(self) -> int:
        """Of ``max_concurrent_rpcs``, the calls kept for CloseSession and health checks."""
        return reserved_rpcs(self.max_concurrent_rpcs)

    def metrics_address(self) -> tuple[str, int] | None:
        """Where to serve ``/metrics``: ``metrics_listen``, else ``metrics_port`` on the host
        of ``listen`` (127.0.0.1 when that is a unix socket); None for no endpoint."""
        if self.metrics_listen is not None:
            return split_host_port(self.metrics_listen, "metrics_listen")
        if self.metrics_port is None:
            return None
        if self.listen.startswith("unix:"):
            return "127.0.0.1", self.metrics_port
        return split_host_port(self.listen, "listen")[0], self.metrics_port


def _setting(name: str) -> Setting:
    return setting_of(ServiceSettings, name)


def _relative_root(roots: tuple[Path, ...]) -> str | None:
    bad = next((root for root in roots if not root.is_absolute()), None)
    return None if bad is None else f"holds {str(bad)!r}, which is not an absolute path"


@dataclass(frozen=True, kw_only=True)
class SessionSettings:
    """The sessions' settings."""

    max_sessions: int = count(
        flag="--max-sessions",
        default=256,
        help="open sessions at most; more is RESOURCE_EXHAUSTED",
    )

    client_max_sessions: int = count(
        flag="--client-max-sessions",
        default=64,
        help="open sessions one client may hold",
    )

    client_plan_quota_bytes: int = size(
        flag="--client-plan-quota",
        default=8 << 30,
        check=at_least(1 << 20, size=True),
        help="memory the epoch plans of one client's sessions may take together, estimated "
        "before an open builds any (64 bytes per sample of an epoch, 320 per packed piece); "
        "an open past it is RESOURCE_EXHAUSTED",
    )

    lease_timeout_s: float = seconds(
        flag="--lease-timeout-s",
        default=30.0,
        check=within(0, 86400, low_open=True),
        help="seconds a session may go without an open stream before it is closed and its "
        "ring freed",
    )

    share_loan_timeout_s: float = seconds(
        flag="--share-loan-timeout-s",
        default=300.0,
        check=within(0, 86400, low_open=True),
        help="seconds a share group's member may keep reading a batch in another member's "
        "ring once that member is done with it (or closed); then the loan is reclaimed and "
        "the reader's stream ends with an error",
    )

    data_roots: tuple[Path, ...] = path(
        flag="--data-root",
        env="BATCHD_DATA_ROOTS",
        default=(),
        check=Check("absolute paths", _relative_root),
        help="serve only datasets whose root lies under one of these directories; a catalog "
        "row pointing elsewhere is refused",
        metavar="DIR",
        default_text="any root the catalog names",
        many=os.pathsep,
    )
