"""The operating commands of ``batchd-server``: ``serve`` runs the server until SIGTERM or
Ctrl-C; ``healthcheck`` says whether shared memory (and, with ``--target``, a running server)
is healthy. ``cli.py`` parses the command line and calls these.

Their server settings come from :class:`~batchd_server.config.ServerConfig`'s declarations;
only what concerns one run of ``healthcheck`` (which server to ask) is declared here.
"""

from __future__ import annotations

import argparse
import logging
import signal
import threading
from pathlib import Path
from typing import TYPE_CHECKING, Any

from batchd_server import __version__
from batchd_server.config import ServerConfig
from batchd_server.settings import add_arguments, setting_of

if TYPE_CHECKING:  # only catalog/ imports SQLAlchemy; grpc loads only with --target
    from batchd_server.api.health import ProbeTls
    from batchd_server.catalog.db import Engine

__all__ = ["EXIT_UNHEALTHY", "add_commands", "cmd_healthcheck", "cmd_serve"]

EXIT_UNHEALTHY = 1
"""What `healthcheck` exits with when something is wrong (Docker's HEALTHCHECK reserves 2)."""
log = logging.getLogger("batchd-server")


def add_commands(sub: Any, common: argparse.ArgumentParser) -> None:
    """Add ``serve`` and ``healthcheck`` to the subcommands ``sub`` (argparse's
    ``add_subparsers`` object), each with the options of ``common``."""
    p = sub.add_parser(
        "serve",
        parents=[common],
        help="serve batches over gRPC",
        description="Serve the Loader gRPC service. Each flag's help names the environment "
        "variable that sets it too; a flag wins over its variable. "
        "docs/reference/server-settings.md lists every setting.",
    )
    add_arguments(p, ServerConfig, "serve")
    p.set_defaults(func=cmd_serve)

    p = sub.add_parser(
        "healthcheck",
        parents=[common],
        help="exit 0 if /dev/shm (and the server, with --target) are healthy, else 1",
        description="Check that the shared-memory directory has --min-free-shm free and, with "
        "--target, that the server's gRPC health service says SERVING. Prints one line; exits "
        "0 when healthy, 1 when not (the line says what to change). Without --target it "
        "needs no server: a Docker HEALTHCHECK, an init container or a pre-flight can use it. "
        "A TLS server needs --tls-ca (and, for mutual TLS, --tls-client-cert and "
        "--tls-client-key); the health check needs no token.",
    )
    add_arguments(p, ServerConfig, "healthcheck")
    p.add_argument(
        "--target",
        metavar="ADDR",
        help="the server to ask: host:port or unix:///path/batchd.sock (default: none, "
        "check shared memory only)",
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
    p.add_argument(
        "--tls-server-name",
        metavar="NAME",
        help="with --tls-ca: the name the server's certificate must have, when --target "
        "names it otherwise (127.0.0.1 inside its container, say) (default: --target's host)",
    )
    p.set_defaults(func=cmd_healthcheck, needs_catalog=False)


def cmd_serve(args: argparse.Namespace, engine: Engine) -> int:
    """Serve until SIGTERM or SIGINT, then stop within ``config.grace_s``."""
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
                    "%s; give the server more shared memory (docker compose shm_size, "
                    "Kubernetes emptyDir.sizeLimit) to use it all",
                    config.shm_dir,
                    format_bytes(space.size_bytes),
                    format_bytes(space.free_bytes),
                    format_bytes(effective),
                    format_bytes(config.shm_budget_bytes),
                    setting_of(ServerConfig, "shm_budget_bytes").flag,
                )
            metrics = server.metrics_address
            log.info(
                "ready: serving on %s (batchd-server %s) with %s decode workers, shm budget %s "
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


def cmd_healthcheck(args: argparse.Namespace, engine: Engine | None) -> int:
    """Print one line; 0 when shared memory (and the ``--target`` server) are healthy."""
    from batchd_server.health import shm_problem
    from batchd_server.shm.space import format_bytes, shm_space

    config: ServerConfig = args.config
    shm_dir = config.shm_dir
    try:
        space = shm_space(shm_dir)
    except OSError as e:
        print(
            f"cannot inspect {shm_dir}: {e.strerror or e}; batchd needs a tmpfs there "
            f"(pass {setting_of(ServerConfig, 'shm_dir').flag} if the server uses another "
            "directory)"
        )
        return EXIT_UNHEALTHY
    problem = shm_problem(space, config.min_free_shm_bytes)
    if problem is None and args.target:
        from batchd_server.api.health import check_server

        tls = _probe_tls(config, args.tls_server_name)
        if isinstance(tls, str):
            problem = tls
        else:
            problem = check_server(
                args.target, service=args.service, timeout_s=args.timeout_s, tls=tls
            )
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


def _probe_tls(config: ServerConfig, server_name: str | None) -> ProbeTls | str | None:
    """How the health check speaks TLS (None: plaintext), or the line saying why it cannot."""
    from batchd_server.api.health import ProbeTls

    ca, cert, key = (
        "healthcheck_tls_ca",
        "healthcheck_tls_client_cert",
        "healthcheck_tls_client_key",
    )
    paths: dict[str, Path | None] = {name: getattr(config, name) for name in (ca, cert, key)}
    if (paths[cert] is None) != (paths[key] is None):
        given, missing = (cert, key) if paths[key] is None else (key, cert)
        return (
            f"mutual TLS needs a certificate and its key: {_where(given)} is set, so set "
            f"{_where(missing)} too"
        )
    if paths[ca] is None:
        if paths[cert] is None and server_name is None:
            return None
        what = "--tls-server-name" if paths[cert] is None else _where(cert)
        return f"{what} is for a TLS server: also set {_where(ca)}"
    pems: dict[str, bytes] = {}
    for name, path in paths.items():
        if path is not None:
            try:
                pems[name] = path.read_bytes()
            except OSError as e:
                return f"cannot read {path} (given by {_where(name)}): {e.strerror or e}"
    return ProbeTls(
        ca=pems[ca],
        ca_path=str(paths[ca]),
        client_cert=pems.get(cert),
        client_key=pems.get(key),
        server_name=server_name,
    )


def _where(name: str) -> str:
    """``--flag (BATCHD_VAR)`` of setting ``name``."""
    s = setting_of(ServerConfig, name)
    return f"{s.flag} ({s.env})"
