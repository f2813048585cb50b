"""Engines for the catalog, on Postgres or on the embedded SQLite default."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Final

import sqlalchemy as sa
from sqlalchemy.engine import Engine, make_url

from batchd_server.errors import FailedPrecondition, Unavailable

__all__ = [
    "CONNECT_TIMEOUT_S",
    "SERVING_STATEMENT_TIMEOUT_S",
    "connect",
    "describe_host",
    "describe_url",
    "is_postgres",
    "make_engine",
    "ping",
]

CONNECT_TIMEOUT_S: Final = 5
"""Postgres: give up connecting after this long (libpq's default is to wait forever)."""
SERVING_STATEMENT_TIMEOUT_S: Final = 120.0
"""Postgres, the server's engine: a statement running longer is cancelled, so a stuck
catalog fails an OpenSession instead of holding its thread forever. (Loading a split streams
its rows in fetches, each a statement of its own.)"""
_KEEPALIVES: Final = {
    # A database host that vanished (no FIN, no RST) breaks its connections within about a
    # minute instead of the kernel's two hours.
    "keepalives": 1,
    "keepalives_idle": 30,
    "keepalives_interval": 10,
    "keepalives_count": 3,
}


def describe_url(url: str) -> str:
    """The URL with any password hidden, fit for logs and error messages."""
    return make_url(url).render_as_string(hide_password=True)


def describe_host(url: str) -> str:
    """Where the database of ``url`` is: ``host:port``, a socket directory, or a file."""
    parsed = make_url(url)
    if parsed.get_backend_name() == "sqlite":
        return parsed.database or ":memory:"
    host = parsed.host or str(parsed.query.get("host") or "") or "the default socket"
    return f"{host}:{parsed.port}" if parsed.port else host


def is_postgres(engine: Engine) -> bool:
    return engine.dialect.name == "postgresql"


def _postgres_connect_args(query: Any, statement_timeout_s: float | None) -> dict[str, Any]:
    """libpq settings batchd wants, unless the URL sets them itself."""
    wanted: dict[str, Any] = {"connect_timeout": CONNECT_TIMEOUT_S, **_KEEPALIVES}
    if statement_timeout_s is not None:
        wanted["options"] = f"-c statement_timeout={round(statement_timeout_s * 1000)}"
    return {k: v for k, v in wanted.items() if k not in query}


def make_engine(url: str, *, statement_timeout_s: float | None = None) -> Engine:
    """An engine for ``url`` with the settings batchd relies on.

    SQLite: the parent directory is created, foreign keys are enforced and the journal is WAL
    so a reader does not block an ingest. Postgres: connections are checked before use,
    because a catalog outlives many database restarts; connecting times out after
    :data:`CONNECT_TIMEOUT_S`, TCP keepalives notice a vanished host, and with
    ``statement_timeout_s`` (the server's engine) no statement runs longer. Settings the
    URL's query names itself (``?connect_timeout=20``) win.
    """
    parsed = make_url(url)
    if parsed.get_backend_name() == "sqlite":
        if parsed.database and parsed.database != ":memory:":
            Path(parsed.database).expanduser().parent.mkdir(parents=True, exist_ok=True)
        engine = sa.create_engine(url, connect_args={"timeout": 30})

        @sa.event.listens_for(engine, "connect")
        def _sqlite_pragmas(dbapi_conn, _record):  # type: ignore[no-untyped-def]
            cur = dbapi_conn.cursor()
            cur.execute("PRAGMA foreign_keys=ON")
            cur.execute("PRAGMA journal_mode=WAL")
            cur.close()

        return engine
    if parsed.get_backend_name() == "postgresql":
        if parsed.drivername == "postgresql":
            parsed = parsed.set(drivername="postgresql+psycopg2")
        return sa.create_engine(
            parsed,
            pool_pre_ping=True,
            pool_use_lifo=True,
            connect_args=_postgres_connect_args(parsed.query, statement_timeout_s),
        )
    raise FailedPrecondition(
        f"catalog URL {describe_url(url)!r} is neither postgresql:// nor sqlite:///; "
        "set BATCHD_DATABASE_URL"
    )


@contextlib.contextmanager
def connect(engine: Engine) -> Iterator[sa.Connection]:
    """A connection, as ``with connect(engine) as conn:``. A database that cannot be reached,
    drops the connection or cancels a statement (timeout) raises Unavailable naming the
    catalog (never its password) and what to check."""
    url = str(engine.url)
    where = f"{describe_host(url)} ({describe_url(url)})"
    try:
        conn = engine.connect()
    except sa.exc.OperationalError as e:
        raise Unavailable(
            f"cannot reach the catalog at {where}: {_reason(e)}. Check BATCHD_DATABASE_URL "
            "and that the database is up."
        ) from e
    with conn:
        try:
            yield conn
        except sa.exc.OperationalError as e:
            raise Unavailable(
                f"the catalog at {where} failed during a query: {_reason(e)}. Check that the "
                "database is up and not overloaded; retry."
            ) from e
        except sa.exc.DBAPIError as e:
            if not e.connection_invalidated:
                raise
            raise Unavailable(
                f"the connection to the catalog at {where} was lost: {_reason(e)}; retry."
            ) from e


def _reason(error: sa.exc.DBAPIError) -> str:
    return " ".join(str(error.orig).split()) or type(error.orig).__name__


def ping(engine: Engine) -> None:
    """One round trip to the catalog database (the health check's probe).

    Raises:
        Unavailable: the database cannot be reached or did not answer the query.
    """
    try:
        with connect(engine) as conn:
            conn.execute(sa.text("SELECT 1")).scalar_one()
    except sa.exc.DBAPIError as e:
        raise Unavailable(
            f"the catalog at {describe_url(str(engine.url))} failed a trivial query: "
            f"{str(e.orig).strip()}"
        ) from e
