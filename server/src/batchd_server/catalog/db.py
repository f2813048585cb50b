"""Engines for the catalog, on Postgres or on the embedded SQLite default."""

from __future__ import annotations

from pathlib import Path

import sqlalchemy as sa
from sqlalchemy.engine import Engine, make_url

from batchd_server.errors import FailedPrecondition, Unavailable

__all__ = ["connect", "describe_url", "is_postgres", "make_engine", "ping"]


def describe_url(url: str) -> str:
    """The URL with any password hidden, fit for logs and error messages."""
    return make_url(url).render_as_string(hide_password=True)


def is_postgres(engine: Engine) -> bool:
    return engine.dialect.name == "postgresql"


def make_engine(url: str) -> Engine:
    """An engine for ``url`` with the settings batchd relies on.

    SQLite: the parent directory is created, foreign keys are enforced and the journal is WAL
    so a reader does not block an ingest. Postgres: connections are checked before use,
    because a catalog outlives many database restarts.
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
        return sa.create_engine(parsed, pool_pre_ping=True, pool_use_lifo=True)
    raise FailedPrecondition(
        f"catalog URL {describe_url(url)!r} is neither postgresql:// nor sqlite:///; "
        "set BATCHD_DATABASE_URL"
    )


def connect(engine: Engine) -> sa.Connection:
    """Open a connection, turning "cannot connect" into an error that says what to check."""
    try:
        return engine.connect()
    except sa.exc.OperationalError as e:
        raise Unavailable(
            f"cannot reach the catalog at {describe_url(str(engine.url))}: "
            f"{str(e.orig).strip()}. Check BATCHD_DATABASE_URL and that the database is up."
        ) from e


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
