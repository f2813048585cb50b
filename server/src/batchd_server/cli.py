"""The ``batchd-server`` command: parse the command line, build the configuration, run the
command (``cli_serve.py``: serve, healthcheck; ``cli_catalog.py``: migrate, ingest,
demo-data, datasets).

Server settings come from their flags, else their ``BATCHD_*`` variables (through
:meth:`ServerConfig.from_env`), else their defaults; ``docs/reference/server-settings.md``
lists them. Expected failures (a bad manifest, an unreachable catalog) print one line,
``batchd-server: error: ...``, and exit 2, like a usage error; Ctrl-C exits 130.
"""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Sequence
from typing import TYPE_CHECKING

from batchd_server import __version__, cli_catalog, cli_serve
from batchd_server.config import ServerConfig
from batchd_server.errors import BatchdError
from batchd_server.logs import configure_logging
from batchd_server.settings import EVERY_COMMAND, add_arguments, given

if TYPE_CHECKING:  # only catalog/ imports SQLAlchemy
    from batchd_server.catalog.db import Engine

__all__ = ["build_parser", "main"]

PROG = cli_catalog.PROG
EXIT_ERROR = 2
EXIT_INTERRUPTED = 130
log = logging.getLogger(PROG)


def _engine(url: str) -> Engine:
    # Imported here so `--help` and `--version` do not pay for SQLAlchemy.
    from batchd_server.catalog.db import describe_url, make_engine

    log.debug("catalog: %s", describe_url(url))
    return make_engine(url)


def build_parser() -> argparse.ArgumentParser:
    """Every command, with its flags; the settings' flags come from :class:`ServerConfig`."""
    # Global options work before or after the subcommand; SUPPRESS keeps a subcommand's
    # unset copy from overwriting a value given before it.
    common = argparse.ArgumentParser(add_help=False)
    add_arguments(common, ServerConfig, EVERY_COMMAND, default=argparse.SUPPRESS)
    common.add_argument(
        "--log-level",
        default=argparse.SUPPRESS,
        choices=("DEBUG", "INFO", "WARNING", "ERROR"),
        type=str.upper,
        help="logging to stderr (default WARNING; INFO for serve)",
    )
    parser = argparse.ArgumentParser(
        prog=PROG, description="batchd server: catalog and ingest commands.", parents=[common]
    )
    parser.add_argument("--version", action="version", version=f"{PROG} {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    cli_serve.add_commands(sub, common)
    cli_catalog.add_commands(sub, common)
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
        config = ServerConfig.from_env(**given(args, ServerConfig))
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
