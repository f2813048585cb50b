"""Run the catalog's Alembic migrations from code (``batchd-server migrate``)."""

from __future__ import annotations

from pathlib import Path

import sqlalchemy as sa
from alembic import command
from alembic.config import Config
from alembic.runtime.migration import MigrationContext
from alembic.script import ScriptDirectory
from sqlalchemy.engine import Engine

from batchd_server.catalog.db import connect, describe_url
from batchd_server.errors import FailedPrecondition

__all__ = ["current_revision", "downgrade", "head_revision", "require_schema", "upgrade"]

MIGRATIONS_DIR = Path(__file__).resolve().parent.parent / "migrations"


def _config(connection: sa.Connection | None = None) -> Config:
    cfg = Config()
    cfg.set_main_option("script_location", str(MIGRATIONS_DIR))
    if connection is not None:
        cfg.attributes["connection"] = connection
    return cfg


def head_revision() -> str:
    head = ScriptDirectory.from_config(_config()).get_current_head()
    assert head is not None, "the migrations directory has no revisions"
    return head


def current_revision(engine: Engine) -> str | None:
    """The revision the database is at, or None when it has no batchd schema."""
    with connect(engine) as conn:
        return MigrationContext.configure(conn).get_current_revision()


def upgrade(engine: Engine, revision: str = "head") -> None:
    """Upgrade the catalog schema to ``revision`` (default: the newest)."""
    with connect(engine) as conn:
        command.upgrade(_config(conn), revision)
        conn.commit()


def downgrade(engine: Engine, revision: str) -> None:
    """Downgrade the catalog schema to ``revision`` (``"base"`` removes it entirely)."""
    with connect(engine) as conn:
        command.downgrade(_config(conn), revision)
        conn.commit()


def require_schema(engine: Engine) -> None:
    """Make sure the catalog's schema is current before anything reads or writes it.

    The embedded SQLite catalog is a private file, so it is migrated on first use. A Postgres
    catalog is shared: its schema changes only when someone runs ``batchd-server migrate``
    (a one-shot job in the deployments), so here it is only checked.
    """
    current = current_revision(engine)
    head = head_revision()
    if current == head:
        return
    if engine.dialect.name == "sqlite":
        upgrade(engine)
        return
    where = describe_url(str(engine.url))
    if current is None:
        raise FailedPrecondition(
            f"the catalog at {where} has no batchd schema; run `batchd-server migrate` "
            "(with BATCHD_DATABASE_URL set) first"
        )
    raise FailedPrecondition(
        f"the catalog at {where} is at schema revision {current}, this batchd-server "
        f"needs {head}; run `batchd-server migrate`"
    )
