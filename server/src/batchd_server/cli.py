"""The ``batchd-server`` command: serve, check health, migrate the catalog, ingest, list.

The catalog URL comes from ``--database-url`` or ``BATCHD_DATABASE_URL`` (through
:meth:`ServerConfig.from_env`), else the embedded SQLite file under ``$BATCHD_HOME``.
Expected failures (a bad manifest, an unreachable catalog) print one line,
``batchd-server: error: ...``, and exit 2, like a usage error; Ctrl-C exits 130.
"""

from __future__ import annotations

import argparse
import logging
import signal
import sys
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from batchd_server import __version__, cli_catalog
from batchd_server.config import LOG_FORMATS, ServerConfig, parse_bytes
from batchd_server.errors import BatchdError
from batchd_server.logs import configure_logging

if TYPE_CHECKING:  # only catalog/ imports SQLAlchemy
    from batchd_server.catalog.db import Engine

__all__ = ["build_parser", "main"]

PROG = cli_catalog.PROG
EXIT_ERROR = 2
EXIT_UNHEALTHY = 1
"""What `healthcheck` exits with when something is wrong (Docker's HEALTHCHECK reserves 2)."""
EXIT_INTERRUPTED = 130
log = logging.getLogger(PROG)


def _engine(url: str) -> Engine:
    # Imported here so `--help` and `--version` do not pay for SQLAlchemy.
    from batchd_server.catalog.db import describe_url, make_engine

    log.debug("catalog: %s", describe_url(url))
    return make_engine(url)


def _cmd_migrate(args: argparse.Namespace, engine: Engine) -> int:
    from batchd_server.catalog import migrate
    from batchd_server.catalog.db import describe_url

    if args.downgrade:
        migrate.downgrade(engine, args.downgrade)
    else:
        migrate.upgrade(engine)
    revision = migrate.current_revision(engine)
    where = describe_url(str(engine.url))
    if revision is None:
        print(f"{where}: at base (no batchd schema)")
    else:
        head = " (head)" if revision == migrate.head_revision() else ""
        print(f"{where}: at revision {revision}{head}")
    return 0


def _cmd_serve(args: argparse.Namespace, engine: Engine) -> int:
    from batchd_server.api.server import build_server
    from batchd_server.catalog.db import describe_url
    from batchd_server.catalog.migrate import require_schema
    from batchd_server.shm.space import format_bytes

    config: ServerConfig = args.config
    require_schema(engine)
    engine.dispose()  # the server makes its own
    stop = threading.Event()
    previous = {
        sig: signal.signal(sig, lambda signum, frame: stop.set())
        for sig in (signal.SIGTERM, signal.SIGINT)
    }
    try:
        server = build_server(config)
        try:
            space = server.registry.space()
            effective = server.registry.effective_budget_bytes()
            if effective < config.shm_budget_bytes:
                log.warning(
                    "%s is %s with %s free: the effective shm budget is %s, not the %s of "
                    "--shm-budget; give the server more shared memory (docker compose "
                    "shm_size, Kubernetes emptyDir.sizeLimit) to use it all",
                    config.shm_dir,
                    format_bytes(space.size_bytes),
                    format_bytes(space.free_bytes),
                    format_bytes(effective),
                    format_bytes(config.shm_budget_bytes),
                )
            metrics = server.metrics_address
            log.info(
                "ready: serving on %s (batchd-server %s) with %d decode workers, shm budget %s "
                "in %s (segments batchd-%s-*), lease timeout %g s, catalog %s, %s, grace %g s",
                server.address,
                __version__,
                config.workers,
                format_bytes(effective),
                config.shm_dir,
                server.registry.instance,
                config.lease_timeout_s,
                describe_url(config.database_url),
                "no metrics" if metrics is None else f"metrics on http://{metrics}/metrics",
                config.grace_s,
            )
            # A timed wait: a SIGTERM the kernel hands to another thread (gRPC's, say) only
            # runs its Python handler once the main thread is back in the interpreter.
            while not stop.wait(1.0):
                pass
            log.info(
                "stopping: NOT_SERVING now, ending every stream, done within %g s", config.grace_s
            )
        finally:
            server.stop(grace_s=config.grace_s)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    return 0


def _cmd_healthcheck(args: argparse.Namespace, engine: Engine | None) -> int:
    from batchd_server.health import shm_problem
    from batchd_server.shm.space import format_bytes, shm_space

    config: ServerConfig = args.config
    shm_dir = Path(args.shm_dir) if args.shm_dir else config.shm_dir
    try:
        space = shm_space(shm_dir)
    except OSError as e:
        print(
            f"cannot inspect {shm_dir}: {e.strerror or e}; batchd needs a tmpfs there "
            "(pass --shm-dir if the server uses another directory)"
        )
        return EXIT_UNHEALTHY
    problem = shm_problem(space, config.min_free_shm_bytes)
    if problem is None and args.target:
        from batchd_server.api.health import check_server

        problem = check_server(args.target, service=args.service, timeout_s=args.timeout_s)
    if problem is not None:
        print(" ".join(problem.split()))
        return EXIT_UNHEALTHY
    line = (
        f"healthy: {shm_dir} has {format_bytes(space.free_bytes)} free, batchd needs "
        f"{format_bytes(config.min_free_shm_bytes)}"
    )
    if args.target:
        line += f"; the server at {args.target} is SERVING"
    print(line)
    return 0


def _byte_size(text: str) -> int:
    try:
        return parse_bytes(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from e


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value} must be >= 1")
    return value


def _dataset_args(p: argparse.ArgumentParser, *, dataset_default: str | None = None) -> None:
    if dataset_default is None:
        p.add_argument("--dataset", required=True, help="dataset name")
    else:
        p.add_argument("--dataset", default=dataset_default, help="dataset name (%(default)s)")
    p.add_argument(
        "--version",
        dest="dataset_version",
        default="1",
        metavar="V",
        help="dataset version (default %(default)s); rows of a version never change, so "
        "changed data goes into a new version",
    )


def _security_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--tls-cert",
        type=Path,
        default=None,
        metavar="PEM",
        help="serve TCP with TLS: this certificate chain (with --tls-key; $BATCHD_TLS_CERT)",
    )
    p.add_argument(
        "--tls-key", type=Path, default=None, metavar="PEM", help="its key ($BATCHD_TLS_KEY)"
    )
    p.add_argument(
        "--tls-client-ca",
        type=Path,
        default=None,
        metavar="PEM",
        help="mutual TLS: require client certificates signed by this CA ($BATCHD_TLS_CLIENT_CA)",
    )
    p.add_argument(
        "--auth-token-file",
        type=Path,
        default=None,
        metavar="FILE",
        help="every call must carry the bearer token in FILE ($BATCHD_AUTH_TOKEN_FILE)",
    )
    p.add_argument(
        "--data-root",
        dest="data_roots",
        type=Path,
        action="append",
        default=None,
        metavar="DIR",
        help="serve only datasets whose root lies under DIR (repeatable; $BATCHD_DATA_ROOTS, "
        "':'-separated); default: any root the catalog names",
    )
    p.add_argument(
        "--insecure",
        action="store_true",
        default=None,
        help="allow a non-loopback TCP listener with neither TLS nor a token ($BATCHD_INSECURE=1)",
    )


def _limit_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--max-sessions",
        type=_positive_int,
        default=None,
        metavar="N",
        help="open sessions at most ($BATCHD_MAX_SESSIONS; default 256)",
    )
    p.add_argument(
        "--max-concurrent-rpcs",
        type=_positive_int,
        default=None,
        metavar="N",
        help="gRPC calls served at once, an open inline stream being one; an eighth (1 to 8) "
        "is kept for CloseSession and health checks ($BATCHD_MAX_CONCURRENT_RPCS; default 128)",
    )
    p.add_argument(
        "--client-max-calls",
        type=_positive_int,
        default=None,
        metavar="N",
        help="gRPC calls one client may have running at once ($BATCHD_CLIENT_MAX_CALLS; "
        "default 32)",
    )
    p.add_argument(
        "--client-max-sessions",
        type=_positive_int,
        default=None,
        metavar="N",
        help="open sessions one client may hold ($BATCHD_CLIENT_MAX_SESSIONS; default 64)",
    )
    p.add_argument(
        "--client-shm-quota",
        dest="client_shm_quota_bytes",
        type=_byte_size,
        default=None,
        metavar="BYTES",
        help="ring memory one client's sessions may hold together ($BATCHD_CLIENT_SHM_QUOTA; "
        "default half of --shm-budget)",
    )


def build_parser() -> argparse.ArgumentParser:
    # Global options work before or after the subcommand; SUPPRESS keeps a subcommand's
    # unset copy from overwriting a value given before it.
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument(
        "--database-url",
        default=argparse.SUPPRESS,
        metavar="URL",
        help="catalog URL (postgresql://... or sqlite:///path); default: $BATCHD_DATABASE_URL, "
        "else a SQLite file under $BATCHD_HOME",
    )
    common.add_argument(
        "--log-level",
        default=argparse.SUPPRESS,
        choices=("DEBUG", "INFO", "WARNING", "ERROR"),
        type=str.upper,
        help="logging to stderr (default WARNING; INFO for serve)",
    )
    common.add_argument(
        "--log-format",
        default=argparse.SUPPRESS,
        choices=LOG_FORMATS,
        help="text lines, or one JSON object per line for log collectors (default: "
        "$BATCHD_LOG_FORMAT, else text)",
    )
    parser = argparse.ArgumentParser(
        prog=PROG, description="batchd server: catalog and ingest commands.", parents=[common]
    )
    parser.add_argument("--version", action="version", version=f"{PROG} {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    p = sub.add_parser(
        "serve",
        parents=[common],
        help="serve batches over gRPC",
        description="Serve the Loader gRPC service. Every flag can also be set in the "
        "environment as BATCHD_<FLAG> (BATCHD_LISTEN, BATCHD_WORKERS, BATCHD_SHM_BUDGET, "
        "BATCHD_LEASE_TIMEOUT_S, BATCHD_METRICS_PORT); flags win.",
    )
    p.add_argument(
        "--listen",
        default=None,
        metavar="ADDRESS",
        help="unix:///path/batchd.sock or host:port (default $BATCHD_LISTEN, else 127.0.0.1:50051)",
    )
    p.add_argument(
        "--workers", type=_positive_int, default=None, help="decode processes (default: CPUs)"
    )
    p.add_argument(
        "--shm-budget",
        dest="shm_budget_bytes",
        type=_byte_size,
        default=None,
        metavar="BYTES",
        help="shared memory all sessions may reserve, e.g. 2GiB (default 1GiB)",
    )
    p.add_argument(
        "--lease-timeout-s",
        type=float,
        default=None,
        metavar="S",
        help="free a session's ring after this long without a stream (default 30)",
    )
    p.add_argument(
        "--metrics-port",
        type=int,
        default=None,
        metavar="P",
        help="serve Prometheus metrics on this port, on the --listen host (127.0.0.1 for a "
        "unix socket); --metrics-listen wins (default: none)",
    )
    p.add_argument(
        "--metrics-listen",
        default=None,
        metavar="HOST:PORT",
        help="serve Prometheus metrics at http://HOST:PORT/metrics, e.g. 0.0.0.0:9400 "
        "(default: $BATCHD_METRICS_LISTEN, else none)",
    )
    p.add_argument(
        "--min-free-shm",
        dest="min_free_shm_bytes",
        type=_byte_size,
        default=None,
        metavar="BYTES",
        help="health is NOT_SERVING while /dev/shm has less free (default 56MiB: one image "
        "session of 64 224x224 images)",
    )
    p.add_argument(
        "--grace-s",
        type=float,
        default=None,
        metavar="S",
        help="on SIGTERM, end streams, stop workers and remove segments within this long "
        "(default 20, below Kubernetes' 30)",
    )
    p.add_argument(
        "--task-timeout-s",
        type=float,
        default=None,
        metavar="S",
        help="kill a decode worker whose batch takes longer (a hung read or decode) and redo "
        "the batch; a sample that hangs twice is a bad sample of kind 'timeout' (default 60)",
    )
    p.add_argument(
        "--heartbeat-interval-s",
        type=float,
        default=None,
        metavar="S",
        help="heartbeat on an idle doorbell stream this often, so clients notice a silent "
        "server within a few intervals (default 5; 0: none)",
    )
    _limit_args(p)
    _security_args(p)
    p.set_defaults(func=_cmd_serve)

    p = sub.add_parser(
        "healthcheck",
        parents=[common],
        help="exit 0 if /dev/shm (and the server, with --target) are healthy, else 1",
        description="Check that the shared-memory directory has --min-free-shm free and, with "
        "--target, that the server's gRPC health service says SERVING. Prints one line; exits "
        "0 when healthy, 1 when not (the line says what to change). Without --target it "
        "needs no server: a Docker HEALTHCHECK, an init container or a pre-flight can use it.",
    )
    p.add_argument(
        "--target",
        metavar="ADDR",
        help="the server to ask: host:port or unix:///path/batchd.sock (default: none, "
        "check shared memory only)",
    )
    p.add_argument(
        "--shm-dir", metavar="DIR", help="the shared-memory directory (default /dev/shm)"
    )
    p.add_argument(
        "--min-free-shm",
        dest="min_free_shm_bytes",
        type=_byte_size,
        default=None,
        metavar="SIZE",
        help="bytes that must be free there, e.g. 1GiB (default: $BATCHD_MIN_FREE_SHM, else 56MiB)",
    )
    p.add_argument(
        "--service",
        default="",
        metavar="NAME",
        help="health service to ask: '' for readiness (default), 'liveness' for liveness",
    )
    p.add_argument(
        "--timeout-s",
        type=float,
        default=5.0,
        metavar="S",
        help="how long to wait for the server's answer (default %(default)s)",
    )
    p.set_defaults(func=_cmd_healthcheck, needs_catalog=False)

    p = sub.add_parser(
        "migrate", parents=[common], help="upgrade the catalog schema to the newest revision"
    )
    p.add_argument("--downgrade", metavar="REVISION", help="downgrade instead (base: remove all)")
    p.set_defaults(func=_cmd_migrate)

    ingest = sub.add_parser("ingest", help="add samples to the catalog")
    kinds = ingest.add_subparsers(dest="kind", required=True, metavar="KIND")
    p = kinds.add_parser(
        "imagefolder",
        parents=[common],
        help="images under ROOT/<split>/<class>/ (or ROOT/<class>/ with --split)",
    )
    _dataset_args(p)
    p.add_argument("--root", required=True, help="the image tree's top directory")
    p.add_argument("--split", help="the whole tree is this split: ROOT/<class>/<image>")
    p.add_argument("--description")
    p.set_defaults(func=cli_catalog.cmd_ingest_imagefolder)

    p = kinds.add_parser(
        "manifest", parents=[common], help="rows of a JSONL (.jsonl/.ndjson) or CSV manifest"
    )
    _dataset_args(p)
    p.add_argument("--root", required=True, help="directory the manifest's paths are under")
    p.add_argument("--split", help="split of rows that have none")
    p.add_argument(
        "--no-verify",
        dest="verify",
        action="store_false",
        help="trust the manifest: do not stat files (every row is verified, byte_size is "
        "byte_length)",
    )
    p.add_argument("--description")
    p.add_argument("manifest", metavar="FILE")
    p.set_defaults(func=cli_catalog.cmd_ingest_manifest)

    p = kinds.add_parser(
        "tar",
        parents=[common],
        help="WebDataset tar shards: samples as byte ranges inside them (nothing extracted)",
    )
    _dataset_args(p)
    p.add_argument("--root", required=True, help="directory the shards are under")
    p.add_argument("--split", help="split of every sample (default: train/val/test in the name)")
    p.add_argument(
        "--label-key", default="label", help="field of a .json member with the label (label)"
    )
    p.add_argument("--description")
    p.add_argument(
        "shards",
        metavar="SHARD",
        nargs="+",
        help="shard files, globs or brace ranges (shard-{000..099}.tar), relative to --root",
    )
    p.set_defaults(func=cli_catalog.cmd_ingest_tar)

    p = sub.add_parser("demo-data", parents=[common], help="write synthetic JPEGs and ingest them")
    _dataset_args(p, dataset_default="demo")
    p.add_argument("--out", required=True, metavar="DIR", help="where to write the images")
    p.add_argument("--images", required=True, type=_positive_int, metavar="N")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--classes", type=_positive_int, default=4)
    p.set_defaults(func=cli_catalog.cmd_demo_data)

    p = sub.add_parser("datasets", parents=[common], help="list datasets and their splits")
    p.set_defaults(func=cli_catalog.cmd_datasets)
    return parser


def _error(message: str) -> int:
    print(f"{PROG}: error: {' '.join(message.split())}", file=sys.stderr)
    return EXIT_ERROR


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; returns the process exit code."""
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as e:  # --help and --version (0), usage errors (2)
        return e.code if isinstance(e.code, int) else 0 if e.code is None else EXIT_ERROR
    try:
        config = ServerConfig.from_env(
            **{
                name: getattr(args, name, None)
                for name in (
                    "database_url",
                    "listen",
                    "workers",
                    "shm_budget_bytes",
                    "lease_timeout_s",
                    "metrics_port",
                    "metrics_listen",
                    "min_free_shm_bytes",
                    "grace_s",
                    "log_format",
                    "task_timeout_s",
                    "heartbeat_interval_s",
                    "max_sessions",
                    "max_concurrent_rpcs",
                    "client_max_calls",
                    "client_max_sessions",
                    "client_shm_quota_bytes",
                )
            },
            **{
                name: getattr(args, name, None)
                for name in ("tls_cert", "tls_key", "tls_client_ca", "auth_token_file", "insecure")
            },
            data_roots=tuple(args.data_roots) if getattr(args, "data_roots", None) else None,
        )
    except ValueError as e:  # e.g. an unsupported URL scheme
        return _error(str(e))
    default_level = "INFO" if args.command == "serve" else "WARNING"
    configure_logging(getattr(args, "log_level", default_level), config.log_format)
    args.config = config
    engine = None
    try:
        if getattr(args, "needs_catalog", True):
            engine = _engine(config.database_url)
        return int(args.func(args, engine))
    except BatchdError as e:
        return _error(str(e))
    except OSError as e:  # the filesystem said no (permissions, disk full): not a bug
        _error(str(e))
        return 1
    except KeyboardInterrupt:
        print(f"{PROG}: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
    finally:
        if engine is not None:
            engine.dispose()


if __name__ == "__main__":
    sys.exit(main())
