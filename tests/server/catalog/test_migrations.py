"""The catalog schema comes from Alembic and matches what the code expects."""

from __future__ import annotations

import sqlalchemy as sa
from alembic.autogenerate import compare_metadata
from alembic.runtime.migration import MigrationContext

from batchd_server.catalog import migrate
from batchd_server.catalog.db import make_engine
from batchd_server.catalog.schema import metadata

TABLES = {"datasets", "samples", "sample_errors"}


def test_migrate_creates_schema_and_downgrade_to_base_removes_it(catalog_url: str) -> None:
    """upgrade head creates the three tables; downgrade base leaves only alembic's own table."""
    eng = make_engine(catalog_url)
    try:
        assert TABLES.isdisjoint(sa.inspect(eng).get_table_names())
        migrate.upgrade(eng)
        assert set(sa.inspect(eng).get_table_names()) >= TABLES
        assert migrate.current_revision(eng) == migrate.head_revision()
        migrate.downgrade(eng, "base")
        assert TABLES.isdisjoint(sa.inspect(eng).get_table_names())
        assert migrate.current_revision(eng) is None
    finally:
        eng.dispose()


def test_migrated_schema_matches_the_code_metadata(engine) -> None:
    """Autogenerate finds nothing to change: migrations and schema.py describe one schema."""
    with engine.connect() as conn:
        ctx = MigrationContext.configure(conn, opts={"compare_type": True})
        diffs = compare_metadata(ctx, metadata)
    assert diffs == []
