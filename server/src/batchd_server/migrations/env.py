"""Alembic environment for the batchd catalog.

The database URL never comes from an ini file: ``batchd_server.catalog.migrate`` hands this
script a live connection in ``config.attributes["connection"]``, or, when Alembic's own command
line is used, the URL is read from ``BATCHD_DATABASE_URL``.
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import context

from batchd_server.catalog.db import make_engine
from batchd_server.catalog.schema import metadata
from batchd_server.config import ServerConfig

# Any number will do as long as it is fixed: it serialises concurrent `migrate` runs
# (several replicas starting at once) on Postgres.
_MIGRATION_LOCK_ID = 0x62617463  # "batc"


def _run(connection: sa.Connection) -> None:
    context.configure(connection=connection, target_metadata=metadata, compare_type=True)
    with context.begin_transaction():
        if connection.dialect.name == "postgresql":
            connection.execute(
                sa.text("SELECT pg_advisory_xact_lock(:k)"), {"k": _MIGRATION_LOCK_ID}
            )
        context.run_migrations()


def run_migrations_online() -> None:
    connection = context.config.attributes.get("connection")
    if connection is not None:
        _run(connection)
        return
    engine = make_engine(ServerConfig.from_env().database_url)
    try:
        with engine.connect() as conn:
            _run(conn)
    finally:
        engine.dispose()


if context.is_offline_mode():
    raise SystemExit("offline (--sql) migrations are not supported; run `batchd-server migrate`")
run_migrations_online()
