"""Server configuration: every setting declared once, on its :class:`ServerConfig` field, and
read from the environment in exactly one place (:meth:`ServerConfig.from_env`).

Each field carries its flag, environment variable, help, parser and check
(:mod:`batchd_server.settings`); the command line, the environment loader, the checks and
the reference page ``docs/reference/server-settings.md`` are derived from it. Regenerate the
page after changing a setting::

    python -m batchd_server.config > docs/reference/server-settings.md
"""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from pathlib import Path

from batchd_server.decode_cache.settings import DecodeCacheSettings
from batchd_server.limits import MAX_SAMPLE_BYTES
from batchd_server.settings import (
    EVERY_COMMAND,
    Check,
    Setting,
    at_least,
    check_values,
    from_environ,
    host_port,
    markdown_table,
    one_of,
    parse_bool,
    parse_bytes,
    setting,
    setting_of,
    split_host_port,
    within,
)
from batchd_server.shm.space import usable_bytes
from batchd_server.storage.cache_settings import CacheSettings
from batchd_server.storage.options import DEFAULT_RETRY_S, RETRY_SETTING
from batchd_server.workers.sizing import WorkerRange, available_cpus, parse_worker_range

__all__ = [
    "DEFAULT_GRACE_S",
    "DEFAULT_LISTEN",
    "DEFAULT_MIN_FREE_SHM_BYTES",
    "LOG_FORMATS",
    "REGENERATE_DOC",
    "ServerConfig",
    "ShmLimits",
    "available_cpus",
    "batchd_home",
    "default_database_url",
    "parse_bool",
    "parse_bytes",
    "reserved_rpcs",
    "settings_table",
    "split_host_port",
]

DEFAULT_LISTEN = "127.0.0.1:50051"
DEFAULT_MIN_FREE_SHM_BYTES = 56 << 20
"""One image session at the usual settings: 6 slots (prefetch 4 + 2) of 64 x 3 x 224 x 224
bytes plus labels and ids, 55.2 MiB, rounded up. Health says NOT_SERVING below it."""
DEFAULT_GRACE_S = 20.0
"""Below Kubernetes' default terminationGracePeriodSeconds (30), so the pod exits by itself."""
LOG_FORMATS = ("text", "json")
REGENERATE_DOC = "python -m batchd_server.config > docs/reference/server-settings.md"
"""The command that writes the settings reference page from the declarations below."""
_GiB = 1 << 30
_MiB = 1 << 20


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


def reserved_rpcs(max_concurrent_rpcs: int) -> int:
    """Of ``max_concurrent_rpcs`` calls, those kept for CloseSession and health checks: an
    eighth, at least 1 and at most 8."""
    return max(1, min(8, max_concurrent_rpcs // 8))


def _url_problem(url: str) -> str | None:
    scheme = url.split(":", 1)[0]
    if scheme.startswith("postgresql") or scheme.startswith("sqlite"):
        return None
    return (
        f"has the scheme {scheme!r}, which batchd does not support; use postgresql://... "
        "or sqlite:///path"
    )


def _relative_root(roots: tuple[Path, ...]) -> str | None:
    bad = next((root for root in roots if not root.is_absolute()), None)
    return None if bad is None else f"holds {str(bad)!r}, which is not an absolute path"


_SERVE_AND_CHECK = ("serve", "healthcheck")
_CHECK = ("healthcheck",)


@dataclass(frozen=True, kw_only=True)
class ShmLimits:
    """The shm limits a server runs with, once its shm directory's size is known."""

    budget_bytes: int
    """What all segments together may reserve (``ShmRegistry.budget_bytes``)."""
    client_quota_bytes: int
    """What one client's rings may hold together."""


@dataclass(frozen=True, kw_only=True)
class ServerConfig(DecodeCacheSettings, CacheSettings):
    """Everything the server needs to know, validated on construction.

    Each field's ``setting(...)`` says what it does, how to set it and what it allows; the
    reference page (:func:`settings_table`) shows them all.
    """

    database_url: str = field(
        default_factory=default_database_url,
        metadata=setting(
            "SQLAlchemy URL of the catalog: postgresql://... or sqlite:///path",
            flag="--database-url",
            env="BATCHD_DATABASE_URL",
            metavar="URL",
            check=Check("postgresql://... or sqlite:///...", _url_problem),
            default_text="a SQLite file catalog.db under $BATCHD_HOME",
            default_in=default_database_url,
            commands=(EVERY_COMMAND,),
            secret=True,
        ),
    )
    listen: str = field(
        default=DEFAULT_LISTEN,
        metadata=setting(
            "where to serve gRPC: unix:///path/batchd.sock or host:port (port 0 picks a free one)",
            flag="--listen",
            env="BATCHD_LISTEN",
            metavar="ADDRESS",
        ),
    )
    workers: WorkerRange = field(
        default_factory=lambda: WorkerRange(available_cpus(), available_cpus()),
        metadata=setting(
            "decode processes: N keeps N running; MIN..MAX starts MIN and adds one while "
            "trainers stall on queued decode work and cores are idle, removes one when the "
            "workers idle, never past MAX, the CPUs or what memory affords",
            flag="--workers",
            env="BATCHD_WORKERS",
            parse=parse_worker_range,
            check=Check(">= 1, MIN <= MAX", WorkerRange.problem),
            metavar="N|MIN..MAX",
            default_text="the CPUs this process may use",
        ),
    )
    shm_budget_bytes: int = field(
        default=_GiB,
        metadata=setting(
            "shared memory all sessions' rings and catalog arrays may reserve together, e.g. "
            "2GiB; never more than the shm directory holds less 8MiB (56MiB of Docker's "
            "default 64MB /dev/shm)",
            flag="--shm-budget",
            env="BATCHD_SHM_BUDGET",
            parse=parse_bytes,
            check=at_least(_MiB, size=True),
            metavar="BYTES",
        ),
    )
    lease_timeout_s: float = field(
        default=30.0,
        metadata=setting(
            "seconds a session may go without an open stream before it is closed and its "
            "ring freed",
            flag="--lease-timeout-s",
            env="BATCHD_LEASE_TIMEOUT_S",
            parse=float,
            check=within(0, 86400, low_open=True),
            metavar="S",
        ),
    )
    metrics_port: int | None = field(
        default=None,
        metadata=setting(
            "serve Prometheus metrics on this port, on the --listen host (127.0.0.1 for a "
            "unix socket); --metrics-listen wins",
            flag="--metrics-port",
            env="BATCHD_METRICS_PORT",
            parse=int,
            check=within(0, 65535),
            metavar="P",
        ),
    )
    metrics_listen: str | None = field(
        default=None,
        metadata=setting(
            "serve Prometheus metrics at http://HOST:PORT/metrics (0.0.0.0:9400 for every "
            "interface)",
            flag="--metrics-listen",
            env="BATCHD_METRICS_LISTEN",
            check=host_port,
            metavar="HOST:PORT",
        ),
    )
    max_sessions: int = field(
        default=256,
        metadata=setting(
            "open sessions at most; more is RESOURCE_EXHAUSTED",
            flag="--max-sessions",
            env="BATCHD_MAX_SESSIONS",
            parse=int,
            check=at_least(1),
            metavar="N",
        ),
    )
    max_concurrent_rpcs: int = field(
        default=128,
        metadata=setting(
            "gRPC calls served at once, each on a thread of its own (an open inline stream "
            "holds one for its whole life); more is RESOURCE_EXHAUSTED at once. An eighth "
            "(1 to 8) is kept for CloseSession and health checks, which the other calls "
            "never take",
            flag="--max-concurrent-rpcs",
            env="BATCHD_MAX_CONCURRENT_RPCS",
            parse=int,
            check=at_least(2, why=": one for CloseSession and health checks, one for the rest"),
            metavar="N",
        ),
    )
    client_max_calls: int = field(
        default=32,
        metadata=setting(
            "gRPC calls one client may have running at once (its streams count for their life)",
            flag="--client-max-calls",
            env="BATCHD_CLIENT_MAX_CALLS",
            parse=int,
            check=at_least(1),
            metavar="N",
        ),
    )
    client_max_sessions: int = field(
        default=64,
        metadata=setting(
            "open sessions one client may hold",
            flag="--client-max-sessions",
            env="BATCHD_CLIENT_MAX_SESSIONS",
            parse=int,
            check=at_least(1),
            metavar="N",
        ),
    )
    client_shm_quota_bytes: int | None = field(
        default=None,
        metadata=setting(
            "ring memory one client's sessions may hold together (the catalog arrays, shared "
            "by every session on a split, count against the shm budget only)",
            flag="--client-shm-quota",
            env="BATCHD_CLIENT_SHM_QUOTA",
            parse=parse_bytes,
            check=at_least(_MiB, size=True),
            metavar="BYTES",
            default_text="half of --shm-budget, at most what the shm directory holds",
        ),
    )
    shm_dir: Path = field(
        default=Path("/dev/shm"),
        metadata=setting(
            "where shared-memory segments live (Linux's shm_open directory)",
            flag="--shm-dir",
            env="BATCHD_SHM_DIR",
            parse=Path,
            metavar="DIR",
            commands=_SERVE_AND_CHECK,
        ),
    )
    min_free_shm_bytes: int = field(
        default=DEFAULT_MIN_FREE_SHM_BYTES,
        metadata=setting(
            "health is NOT_SERVING while the shared-memory directory has less than this "
            "free; the default holds one image session of 64 224x224 images",
            flag="--min-free-shm",
            env="BATCHD_MIN_FREE_SHM",
            parse=parse_bytes,
            check=at_least(0),
            metavar="BYTES",
            commands=_SERVE_AND_CHECK,
        ),
    )
    grace_s: float = field(
        default=DEFAULT_GRACE_S,
        metadata=setting(
            "on SIGTERM, end streams, stop workers and remove segments within this many "
            "seconds; the default is below Kubernetes' terminationGracePeriodSeconds (30)",
            flag="--grace-s",
            env="BATCHD_GRACE_S",
            parse=float,
            check=within(0, 3600, low_open=True),
            metavar="S",
        ),
    )
    health_interval_s: float = field(
        default=2.0,
        metadata=setting(
            "seconds between health checks (shm, workers) and between catalog probes",
            env="BATCHD_HEALTH_INTERVAL_S",
            parse=float,
            check=within(0, 600, low_open=True),
        ),
    )
    catalog_timeout_s: float = field(
        default=5.0,
        metadata=setting(
            "seconds a catalog probe may go unanswered before the server says NOT_SERVING",
            env="BATCHD_CATALOG_TIMEOUT_S",
            parse=float,
            check=within(0, 600, low_open=True),
        ),
    )
    log_format: str = field(
        default="text",
        metadata=setting(
            "log to stderr as text (one line per record) or json (one object per line, "
            "for log collectors)",
            flag="--log-format",
            env="BATCHD_LOG_FORMAT",
            check=one_of(LOG_FORMATS),
            metavar="{" + ",".join(LOG_FORMATS) + "}",
            commands=(EVERY_COMMAND,),
        ),
    )
    tls_cert: Path | None = field(
        default=None,
        metadata=setting(
            "serve TCP with TLS: the PEM certificate chain to present (with --tls-key)",
            flag="--tls-cert",
            env="BATCHD_TLS_CERT",
            parse=Path,
            metavar="PEM",
        ),
    )
    tls_key: Path | None = field(
        default=None,
        metadata=setting(
            "the PEM private key of --tls-cert",
            flag="--tls-key",
            env="BATCHD_TLS_KEY",
            parse=Path,
            metavar="PEM",
        ),
    )
    tls_client_ca: Path | None = field(
        default=None,
        metadata=setting(
            "mutual TLS: require client certificates signed by this PEM CA bundle",
            flag="--tls-client-ca",
            env="BATCHD_TLS_CLIENT_CA",
            parse=Path,
            metavar="PEM",
        ),
    )
    healthcheck_tls_ca: Path | None = field(
        default=None,
        metadata=setting(
            "healthcheck --target over TLS: the PEM CA bundle that signed the server's "
            "certificate (the variable the client library reads too)",
            flag="--tls-ca",
            env="BATCHD_TLS_CA",
            parse=Path,
            metavar="PEM",
            commands=_CHECK,
        ),
    )
    healthcheck_tls_client_cert: Path | None = field(
        default=None,
        metadata=setting(
            "healthcheck --target of a mutual-TLS server: the PEM client certificate to "
            "present (with --tls-client-key and --tls-ca)",
            flag="--tls-client-cert",
            env="BATCHD_TLS_CLIENT_CERT",
            parse=Path,
            metavar="PEM",
            commands=_CHECK,
        ),
    )
    healthcheck_tls_client_key: Path | None = field(
        default=None,
        metadata=setting(
            "the PEM private key of --tls-client-cert",
            flag="--tls-client-key",
            env="BATCHD_TLS_CLIENT_KEY",
            parse=Path,
            metavar="PEM",
            commands=_CHECK,
        ),
    )
    auth_token_file: Path | None = field(
        default=None,
        metadata=setting(
            "every call but the health Check must carry the bearer token held in FILE",
            flag="--auth-token-file",
            env="BATCHD_AUTH_TOKEN_FILE",
            parse=Path,
            metavar="FILE",
        ),
    )
    insecure: bool = field(
        default=False,
        metadata=setting(
            "allow a non-loopback TCP listener with neither TLS nor a token",
            flag="--insecure",
            env="BATCHD_INSECURE",
            parse=parse_bool,
        ),
    )
    data_roots: tuple[Path, ...] = field(
        default=(),
        metadata=setting(
            "serve only datasets whose root lies under one of these directories; a catalog "
            "row pointing elsewhere is refused",
            flag="--data-root",
            env="BATCHD_DATA_ROOTS",
            parse=Path,
            check=Check("absolute paths", _relative_root),
            metavar="DIR",
            default_text="any root the catalog names",
            many=os.pathsep,
        ),
    )
    task_timeout_s: float = field(
        default=60.0,
        metadata=setting(
            "kill a decode worker whose task runs longer than this many seconds (a hung read "
            "or decode) and redo the task; a sample that hangs twice is a bad sample of kind "
            "'timeout'",
            flag="--task-timeout-s",
            env="BATCHD_TASK_TIMEOUT_S",
            parse=float,
            check=within(0, 86400, low_open=True),
            metavar="S",
        ),
    )
    max_sample_bytes: int = field(
        default=MAX_SAMPLE_BYTES,
        metadata=setting(
            "a sample larger than this many bytes (a runaway or sparse file, a range past the "
            "file) is not read: it is a bad sample of kind 'too_large', handled by the "
            "session's on_error",
            flag="--max-sample-bytes",
            env="BATCHD_MAX_SAMPLE_BYTES",
            parse=parse_bytes,
            check=at_least(1),
            metavar="BYTES",
        ),
    )
    # Declared beside the object-store code, as the settings of a subsystem.
    object_store_retry_s: float = field(default=DEFAULT_RETRY_S, metadata=RETRY_SETTING)
    reflection: bool = field(
        default=False,
        metadata=setting(
            "serve gRPC reflection (grpcurl can then list the services); it needs the token "
            "like every call but the health Check",
            flag="--reflection",
            env="BATCHD_REFLECTION",
            parse=parse_bool,
        ),
    )
    heartbeat_interval_s: float = field(
        default=5.0,
        metadata=setting(
            "while a doorbell stream waits for batches, send a heartbeat after this many "
            "seconds without another frame, so clients tell a silent server from a slow "
            "batch; 0: none",
            flag="--heartbeat-interval-s",
            env="BATCHD_HEARTBEAT_INTERVAL_S",
            parse=float,
            check=within(0, 600, note=", 0 for none"),
            metavar="S",
        ),
    )

    def __post_init__(self) -> None:
        if isinstance(self.workers, int):  # ServerConfig(workers=4) from Python
            object.__setattr__(self, "workers", WorkerRange(self.workers, self.workers))
        check_values(self)
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

        self.check_decode_cache()

    @property
    def reserved_rpcs(self) -> int:
        """Of ``max_concurrent_rpcs``, the calls kept for CloseSession and health checks."""
        return reserved_rpcs(self.max_concurrent_rpcs)

    @property
    def client_shm_quota(self) -> int:
        """``client_shm_quota_bytes``, or half of ``shm_budget_bytes`` when unset (before the
        shm directory is known: :meth:`shm_limits` gives what the server uses)."""
        if self.client_shm_quota_bytes is not None:
            return self.client_shm_quota_bytes
        return self.shm_budget_bytes // 2

    def shm_limits(self, shm_size_bytes: int | None) -> ShmLimits:
        """The shm budget and the client quota a server uses on a shm directory of
        ``shm_size_bytes`` (None: unknown): ``shm_budget_bytes`` as a ceiling over what the
        directory holds less a margin (``shm.space.usable_bytes``), and the quota as set, or
        :attr:`client_shm_quota` as a ceiling over that budget. So in Docker's default 64 MB
        ``/dev/shm`` a session too big for it is refused for the filesystem's size, not for a
        quota of 512 MiB it could never use."""
        budget = self.shm_budget_bytes
        if shm_size_bytes is not None:
            budget = min(budget, usable_bytes(shm_size_bytes))
        quota = self.client_shm_quota_bytes
        if quota is None:
            quota = min(self.client_shm_quota, budget)
        return ShmLimits(budget_bytes=budget, client_quota_bytes=quota)

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
        """Build a config from each setting's ``BATCHD_*`` variable (``environ``, default
        ``os.environ``; an empty variable is unset); keyword overrides (not None) win.

        Raises:
            ValueError: a variable does not parse, or a value breaks its rule; the message
                names the variable or the flag.
        """
        env = os.environ if environ is None else environ
        values = from_environ(cls, env)
        known = {f.name for f in fields(cls)}
        unknown = set(overrides) - known
        assert not unknown, f"unknown ServerConfig fields {unknown}"
        values.update({k: v for k, v in overrides.items() if v is not None})
        return cls(**values)


def _setting(name: str) -> Setting:
    return setting_of(ServerConfig, name)


def settings_table() -> str:
    """The settings reference page (Markdown), generated from :class:`ServerConfig`'s
    declarations; committed as ``docs/reference/server-settings.md``."""
    return f"""# Server settings

<!-- Generated from ServerConfig in server/src/batchd_server/config.py; do not edit.
     Regenerate with: {REGENERATE_DOC} -->

Every setting of `batchd-server` can be given as a flag or as an environment variable;
a flag wins over its variable, and an empty variable counts as unset. Flags go to `serve`
unless the table names other commands. Sizes in bytes read `1073741824`, `512MiB`, `2GiB`
or `1.5GB`; booleans `1`/`0`, `true`/`false`, `yes`/`no` or `on`/`off`. A value outside
*Allowed* stops the server with a message that names the flag and the variable.

{markdown_table(ServerConfig)}"""


if __name__ == "__main__":
    sys.stdout.write(settings_table())
