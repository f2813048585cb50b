"""Server configuration, read from the environment in exactly one place."""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

__all__ = [
    "DEFAULT_GRACE_S",
    "DEFAULT_LISTEN",
    "DEFAULT_MIN_FREE_SHM_BYTES",
    "LOG_FORMATS",
    "ServerConfig",
    "available_cpus",
    "batchd_home",
    "default_database_url",
    "parse_bool",
    "parse_bytes",
    "reserved_rpcs",
    "split_host_port",
]

DEFAULT_LISTEN = "127.0.0.1:50051"
DEFAULT_MIN_FREE_SHM_BYTES = 56 << 20
"""One image session at the usual settings: 6 slots (prefetch 4 + 2) of 64 x 3 x 224 x 224
bytes plus labels and ids, 55.2 MiB, rounded up. Health says NOT_SERVING below it."""
DEFAULT_GRACE_S = 20.0
"""Below Kubernetes' default terminationGracePeriodSeconds (30), so the pod exits by itself."""
LOG_FORMATS = ("text", "json")
_GiB = 1 << 30
_UNITS = {
    "": 1,
    "k": 1000,
    "kb": 1000,
    "m": 1000**2,
    "mb": 1000**2,
    "g": 1000**3,
    "gb": 1000**3,
    "t": 1000**4,
    "tb": 1000**4,
    "kib": 1 << 10,
    "ki": 1 << 10,
    "mib": 1 << 20,
    "mi": 1 << 20,
    "gib": 1 << 30,
    "gi": 1 << 30,
    "tib": 1 << 40,
    "ti": 1 << 40,
}
_BYTES_RE = re.compile(r"\s*([0-9]+(?:\.[0-9]+)?)\s*([a-zA-Z]*)\s*")


def batchd_home(environ: Mapping[str, str] | None = None) -> Path:
    """Where batchd keeps local state: ``$BATCHD_HOME``, else ``$XDG_DATA_HOME/batchd``,
    else ``~/.local/share/batchd``."""
    env = os.environ if environ is None else environ
    if env.get("BATCHD_HOME"):
        return Path(env["BATCHD_HOME"]).expanduser()
    xdg = env.get("XDG_DATA_HOME") or str(Path.home() / ".local" / "share")
    return Path(xdg).expanduser() / "batchd"


def default_database_url(environ: Mapping[str, str] | None = None) -> str:
    """The embedded default catalog: a SQLite file ``catalog.db`` under :func:`batchd_home`."""
    path = (batchd_home(environ) / "catalog.db").resolve()
    return f"sqlite:///{path}"


def available_cpus() -> int:
    """The CPUs this process may run on (its affinity mask, so a container's cpuset counts)."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # pragma: no cover - not Linux
        return max(1, os.cpu_count() or 1)


def parse_bytes(text: str) -> int:
    """``"1073741824"``, ``"512MiB"``, ``"1g"``, ``"1.5GB"`` → bytes (SI and binary units).

    Raises:
        ValueError: the text is not a size.
    """
    match = _BYTES_RE.fullmatch(text)
    unit = match[2].lower() if match else ""
    if match is None or unit not in _UNITS:
        raise ValueError(f"{text!r} is not a size in bytes; write e.g. 1073741824, 512MiB or 2GiB")
    return int(float(match[1]) * _UNITS[unit])


def split_host_port(text: str, what: str = "address") -> tuple[str, int]:
    """``"0.0.0.0:9400"`` -> ``("0.0.0.0", 9400)``; ``"[::1]:9400"`` -> ``("::1", 9400)``.

    Raises:
        ValueError: ``text`` is not HOST:PORT with a port in 0..65535.
    """
    host, sep, port = text.rpartition(":")
    if not sep or not host or not port.isdigit() or int(port) > 65535:
        raise ValueError(
            f"{what}={text!r} is not HOST:PORT; write e.g. 127.0.0.1:9400, 0.0.0.0:9400 or "
            "[::]:9400"
        )
    return host.removeprefix("[").removesuffix("]"), int(port)


def parse_bool(text: str) -> bool:
    """``1/true/yes/on`` or ``0/false/no/off`` (any case).

    Raises:
        ValueError: anything else.
    """
    value = text.strip().lower()
    if value in ("1", "true", "yes", "on"):
        return True
    if value in ("0", "false", "no", "off", ""):
        return False
    raise ValueError(f"{text!r} is not a boolean; write 1 or 0")


def reserved_rpcs(max_concurrent_rpcs: int) -> int:
    """Of ``max_concurrent_rpcs`` calls, those kept for CloseSession and health checks: an
    eighth, at least 1 and at most 8."""
    return max(1, min(8, max_concurrent_rpcs // 8))


def _parse_paths(text: str) -> tuple[Path, ...]:
    return tuple(Path(p) for p in text.split(os.pathsep) if p)


@dataclass(frozen=True, kw_only=True)
class ServerConfig:
    """Everything the server needs to know, validated on construction."""

    database_url: str = field(default_factory=default_database_url)
    """SQLAlchemy URL of the catalog (``postgresql+psycopg2://...`` or ``sqlite:///...``)."""
    listen: str = DEFAULT_LISTEN
    """``unix:///path/batchd.sock`` or ``host:port``."""
    workers: int = field(default_factory=available_cpus)
    """Decode processes; default: the CPUs this process may use."""
    shm_budget_bytes: int = _GiB
    """Shared memory all sessions' rings and catalog arrays may reserve together."""
    lease_timeout_s: float = 30.0
    """A session with no open stream for this long is closed and its ring freed."""
    metrics_port: int | None = None
    """Serve Prometheus metrics on this port, on the host of ``listen`` (127.0.0.1 for a unix
    socket); ``metrics_listen`` wins. None (and no ``metrics_listen``): no metrics endpoint."""
    metrics_listen: str | None = None
    """``HOST:PORT`` to serve Prometheus metrics on (``0.0.0.0:9400`` for every interface)."""
    max_sessions: int = 256
    """Open sessions at most; more is RESOURCE_EXHAUSTED."""
    max_concurrent_rpcs: int = 128
    """gRPC calls served at once, each on a thread of its own (an open inline stream holds
    one for its whole life); more is RESOURCE_EXHAUSTED at once. A few are kept for
    CloseSession and health checks (``reserved_rpcs``), which the other calls never take."""
    client_max_calls: int = 32
    """gRPC calls one client may have running at once (its streams count for their life)."""
    client_max_sessions: int = 64
    """Open sessions one client may hold."""
    client_shm_quota_bytes: int | None = None
    """Ring bytes one client's sessions may hold together; None: half of ``shm_budget_bytes``."""
    shm_dir: Path = Path("/dev/shm")
    """Where shared-memory segments live (Linux's shm_open directory)."""
    min_free_shm_bytes: int = DEFAULT_MIN_FREE_SHM_BYTES
    """Health is NOT_SERVING while ``shm_dir`` has less than this free."""
    grace_s: float = DEFAULT_GRACE_S
    """On SIGTERM, everything (streams, workers, segments) is done within this many seconds."""
    health_interval_s: float = 2.0
    """Seconds between health checks (shm, workers) and between catalog probes."""
    catalog_timeout_s: float = 5.0
    """A catalog probe that has not answered after this long makes the server NOT_SERVING."""
    log_format: str = "text"
    """``text`` (one human line per record) or ``json`` (one object per line)."""
    tls_cert: Path | None = None
    """PEM certificate chain the TCP listener presents (TLS); needs ``tls_key``."""
    tls_key: Path | None = None
    """PEM private key of ``tls_cert``."""
    tls_client_ca: Path | None = None
    """PEM CA bundle: clients must present a certificate it signed (mutual TLS)."""
    auth_token_file: Path | None = None
    """File holding the bearer token every call must carry (health and reflection exempt)."""
    insecure: bool = False
    """Allow a non-loopback TCP listener with neither TLS nor a token."""
    data_roots: tuple[Path, ...] = ()
    """Directories dataset roots must lie in; a catalog row pointing elsewhere is refused.
    Empty: any root (the catalog is trusted)."""
    task_timeout_s: float = 60.0
    """A decode task running longer than this gets its worker killed and is redone; a sample
    that hangs twice is a bad sample of kind ``timeout`` (``workers/deadline.py``)."""
    heartbeat_interval_s: float = 5.0
    """While a doorbell stream waits for batches, a heartbeat frame goes out after this long
    without another frame, so the client can tell a silent server from a slow batch. 0: none."""

    def __post_init__(self) -> None:
        scheme = self.database_url.split(":", 1)[0]
        if not (scheme.startswith("postgresql") or scheme.startswith("sqlite")):
            raise ValueError(
                f"database URL scheme {scheme!r} is not supported; use postgresql://... "
                "or sqlite:///path (set BATCHD_DATABASE_URL)"
            )
        if self.workers < 1:
            raise ValueError(f"workers={self.workers} must be >= 1 (--workers, BATCHD_WORKERS)")
        if self.shm_budget_bytes < 1 << 20:
            raise ValueError(
                f"shm_budget_bytes={self.shm_budget_bytes} must be at least 1 MiB "
                "(--shm-budget, BATCHD_SHM_BUDGET)"
            )
        if not 0 < self.lease_timeout_s <= 86400:
            raise ValueError(
                f"lease_timeout_s={self.lease_timeout_s} must be in (0, 86400] "
                "(--lease-timeout-s, BATCHD_LEASE_TIMEOUT_S)"
            )
        if self.metrics_port is not None and not 0 <= self.metrics_port <= 65535:
            raise ValueError(
                f"metrics_port={self.metrics_port} must be in 0..65535 "
                "(--metrics-port, BATCHD_METRICS_PORT)"
            )
        if self.max_sessions < 1:
            raise ValueError(f"max_sessions={self.max_sessions} must be >= 1")
        if self.max_concurrent_rpcs < 2:
            raise ValueError(
                f"max_concurrent_rpcs={self.max_concurrent_rpcs} must be >= 2: one for "
                "CloseSession and health checks, one for the rest (--max-concurrent-rpcs, "
                "BATCHD_MAX_CONCURRENT_RPCS)"
            )
        for name, flag in (
            ("client_max_calls", "--client-max-calls, BATCHD_CLIENT_MAX_CALLS"),
            ("client_max_sessions", "--client-max-sessions, BATCHD_CLIENT_MAX_SESSIONS"),
        ):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)} must be >= 1 ({flag})")
        if self.client_shm_quota_bytes is not None and self.client_shm_quota_bytes < 1 << 20:
            raise ValueError(
                f"client_shm_quota_bytes={self.client_shm_quota_bytes} must be at least 1 MiB "
                "(--client-shm-quota, BATCHD_CLIENT_SHM_QUOTA)"
            )
        if self.metrics_listen is not None:
            split_host_port(self.metrics_listen, "metrics_listen (--metrics-listen)")
        if self.min_free_shm_bytes < 0:
            raise ValueError(
                f"min_free_shm_bytes={self.min_free_shm_bytes} must be >= 0 "
                "(--min-free-shm, BATCHD_MIN_FREE_SHM)"
            )
        if not 0 < self.grace_s <= 3600:
            raise ValueError(f"grace_s={self.grace_s} must be in (0, 3600] (--grace-s)")
        if not 0 < self.task_timeout_s <= 86400:
            raise ValueError(
                f"task_timeout_s={self.task_timeout_s} must be in (0, 86400] "
                "(--task-timeout-s, BATCHD_TASK_TIMEOUT_S)"
            )
        if not 0 <= self.heartbeat_interval_s <= 600:
            raise ValueError(
                f"heartbeat_interval_s={self.heartbeat_interval_s} must be in [0, 600], 0 for "
                "none (--heartbeat-interval-s, BATCHD_HEARTBEAT_INTERVAL_S)"
            )
        for name in ("health_interval_s", "catalog_timeout_s"):
            value = getattr(self, name)
            if not 0 < value <= 600:
                raise ValueError(f"{name}={value} must be in (0, 600] (BATCHD_{name.upper()})")
        if self.log_format not in LOG_FORMATS:
            raise ValueError(
                f"log_format={self.log_format!r} must be one of {', '.join(LOG_FORMATS)} "
                "(--log-format, BATCHD_LOG_FORMAT)"
            )
        if (self.tls_cert is None) != (self.tls_key is None):
            raise ValueError(
                "TLS needs both a certificate and its key: set --tls-cert and --tls-key "
                "(BATCHD_TLS_CERT, BATCHD_TLS_KEY) together"
            )
        for root in self.data_roots:
            if not root.is_absolute():
                raise ValueError(
                    f"--data-root {str(root)!r} must be an absolute path (BATCHD_DATA_ROOTS)"
                )
        if self.tls_client_ca is not None and self.tls_cert is None:
            raise ValueError(
                "--tls-client-ca (BATCHD_TLS_CLIENT_CA) asks for mutual TLS, which needs the "
                "server's own --tls-cert and --tls-key"
            )

    @property
    def reserved_rpcs(self) -> int:
        """Of ``max_concurrent_rpcs``, the calls kept for CloseSession and health checks."""
        return reserved_rpcs(self.max_concurrent_rpcs)

    @property
    def client_shm_quota(self) -> int:
        """``client_shm_quota_bytes``, or half of ``shm_budget_bytes`` when unset."""
        if self.client_shm_quota_bytes is not None:
            return self.client_shm_quota_bytes
        return self.shm_budget_bytes // 2

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

    @classmethod
    def from_env(
        cls, environ: Mapping[str, str] | None = None, **overrides: object
    ) -> ServerConfig:
        """Build a config from ``BATCHD_*`` variables; keyword overrides (not None) win.

        ``BATCHD_DATABASE_URL``, ``BATCHD_LISTEN``, ``BATCHD_WORKERS``, ``BATCHD_SHM_BUDGET``
        (bytes, ``512MiB``, ``2GiB``), ``BATCHD_LEASE_TIMEOUT_S``, ``BATCHD_METRICS_PORT``,
        ``BATCHD_MAX_SESSIONS``, ``BATCHD_SHM_DIR``, ``BATCHD_METRICS_LISTEN``,
        ``BATCHD_MIN_FREE_SHM`` (bytes), ``BATCHD_GRACE_S``, ``BATCHD_HEALTH_INTERVAL_S``,
        ``BATCHD_CATALOG_TIMEOUT_S``, ``BATCHD_LOG_FORMAT``, ``BATCHD_TLS_CERT``,
        ``BATCHD_TLS_KEY``, ``BATCHD_TLS_CLIENT_CA``, ``BATCHD_AUTH_TOKEN_FILE``,
        ``BATCHD_INSECURE`` (1 or 0), ``BATCHD_DATA_ROOTS`` (directories separated by ``:``),
        ``BATCHD_TASK_TIMEOUT_S``, ``BATCHD_HEARTBEAT_INTERVAL_S``,
        ``BATCHD_MAX_CONCURRENT_RPCS``, ``BATCHD_CLIENT_MAX_CALLS``,
        ``BATCHD_CLIENT_MAX_SESSIONS``, ``BATCHD_CLIENT_SHM_QUOTA`` (bytes).

        Raises:
            ValueError: a variable does not parse; the message names it.
        """
        env = os.environ if environ is None else environ
        values: dict[str, Any] = {
            "database_url": env.get("BATCHD_DATABASE_URL") or default_database_url(env)
        }
        parsers: dict[str, tuple[str, Any]] = {
            "listen": ("BATCHD_LISTEN", str),
            "workers": ("BATCHD_WORKERS", int),
            "shm_budget_bytes": ("BATCHD_SHM_BUDGET", parse_bytes),
            "lease_timeout_s": ("BATCHD_LEASE_TIMEOUT_S", float),
            "metrics_port": ("BATCHD_METRICS_PORT", int),
            "max_sessions": ("BATCHD_MAX_SESSIONS", int),
            "shm_dir": ("BATCHD_SHM_DIR", Path),
            "metrics_listen": ("BATCHD_METRICS_LISTEN", str),
            "min_free_shm_bytes": ("BATCHD_MIN_FREE_SHM", parse_bytes),
            "grace_s": ("BATCHD_GRACE_S", float),
            "health_interval_s": ("BATCHD_HEALTH_INTERVAL_S", float),
            "catalog_timeout_s": ("BATCHD_CATALOG_TIMEOUT_S", float),
            "log_format": ("BATCHD_LOG_FORMAT", str),
            "tls_cert": ("BATCHD_TLS_CERT", Path),
            "tls_key": ("BATCHD_TLS_KEY", Path),
            "tls_client_ca": ("BATCHD_TLS_CLIENT_CA", Path),
            "auth_token_file": ("BATCHD_AUTH_TOKEN_FILE", Path),
            "insecure": ("BATCHD_INSECURE", parse_bool),
            "data_roots": ("BATCHD_DATA_ROOTS", _parse_paths),
            "task_timeout_s": ("BATCHD_TASK_TIMEOUT_S", float),
            "heartbeat_interval_s": ("BATCHD_HEARTBEAT_INTERVAL_S", float),
            "max_concurrent_rpcs": ("BATCHD_MAX_CONCURRENT_RPCS", int),
            "client_max_calls": ("BATCHD_CLIENT_MAX_CALLS", int),
            "client_max_sessions": ("BATCHD_CLIENT_MAX_SESSIONS", int),
            "client_shm_quota_bytes": ("BATCHD_CLIENT_SHM_QUOTA", parse_bytes),
        }
        for name, (var, parse) in parsers.items():
            text = env.get(var)
            if text:
                try:
                    values[name] = parse(text)
                except ValueError as e:
                    raise ValueError(f"{var}={text!r} is not valid: {e}") from e
        known = {f.name for f in fields(cls)}
        values.update({k: v for k, v in overrides.items() if v is not None and k in known})
        unknown = set(overrides) - known
        assert not unknown, f"unknown ServerConfig fields {unknown}"
        return cls(**values)
