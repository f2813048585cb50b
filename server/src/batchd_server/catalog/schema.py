"""The catalog's tables, as SQLAlchemy Core metadata.

This module describes the schema the code expects; the schema itself is only ever created or
changed by an Alembic migration (``batchd_server/migrations``). A test checks the two agree.

Rows of ``samples`` are immutable once written: re-ingesting the same key leaves the row as it
is, and a changed sample belongs in a new dataset version. That is what lets a snapshot
(highest id + row count) pin a split's rows for every rank of a job.
"""

from __future__ import annotations

from typing import Any

import sqlalchemy as sa
from sqlalchemy.dialects import postgresql

__all__ = ["datasets", "metadata", "sample_errors", "samples"]

# Names of constraints and indexes are fixed so migrations can refer to them.
metadata = sa.MetaData(
    naming_convention={
        "pk": "pk_%(table_name)s",
        "fk": "fk_%(table_name)s_%(column_0_name)s",
        "uq": "uq_%(table_name)s_%(column_0_N_name)s",
        "ix": "ix_%(table_name)s_%(column_0_N_name)s",
        "ck": "ck_%(table_name)s_%(constraint_name)s",
    }
)

# SQLite only auto-assigns ids to an INTEGER PRIMARY KEY; bigint elsewhere.
BigId = sa.BigInteger().with_variant(sa.Integer(), "sqlite")
Json = sa.JSON().with_variant(postgresql.JSONB(), "postgresql")


def _owned_by(parent: str, column: str, type_: Any) -> sa.Column[Any]:
    """``column``, the id of the ``parent`` row that owns this one: deleting the parent
    deletes it."""
    owner = sa.ForeignKey(f"{parent}.id", ondelete="CASCADE")
    return sa.Column(column, type_, owner, nullable=False)


datasets = sa.Table(
    "datasets",
    metadata,
    sa.Column("id", sa.Integer, sa.Identity(), primary_key=True),
    sa.Column("name", sa.String(255), nullable=False),
    sa.Column("version", sa.String(64), nullable=False),
    sa.Column("root", sa.Text, nullable=False, comment="directory or URI prefix of sample paths"),
    sa.Column("description", sa.Text, nullable=False, server_default=""),
    sa.Column("attrs", Json, nullable=True, comment="e.g. {'classes': [...]} from imagefolder"),
    sa.Column(
        "created_at", sa.DateTime(timezone=True), nullable=False, server_default=sa.func.now()
    ),
    sa.UniqueConstraint("name", "version"),
    sqlite_autoincrement=True,
)

samples = sa.Table(
    "samples",
    metadata,
    sa.Column("id", BigId, sa.Identity(), primary_key=True),
    _owned_by("datasets", "dataset_id", sa.Integer),
    sa.Column("key", sa.Text, nullable=False),
    sa.Column("path", sa.Text, nullable=False, comment="relative to datasets.root"),
    sa.Column("byte_offset", sa.BigInteger, nullable=True, comment="inside a shard file"),
    sa.Column("byte_length", sa.BigInteger, nullable=True),
    sa.Column("label", sa.BigInteger, nullable=True),
    sa.Column("split", sa.String(64), nullable=False),
    sa.Column("length", sa.Integer, nullable=True, comment="sequence length, for bucketing"),
    sa.Column("weight", sa.Float, nullable=False, server_default="1.0"),
    sa.Column("is_verified", sa.Boolean, nullable=False, server_default=sa.true()),
    sa.Column("byte_size", sa.BigInteger, nullable=True),
    sa.Column("attrs", Json, nullable=True),
    sa.Column("row_group", sa.Integer, nullable=True, comment="Parquet: the row's row group"),
    sa.Column("row_index", sa.Integer, nullable=True, comment="Parquet: its row in that group"),
    sa.UniqueConstraint("dataset_id", "key"),
    sa.CheckConstraint("(byte_offset IS NULL) = (byte_length IS NULL)", name="byte_range_complete"),
    sa.CheckConstraint("weight >= 0", name="weight_nonnegative"),
    # "All verified rows of one split of one dataset, ordered by id" is the query every
    # session starts with: equality on the first three columns, then id order.
    sa.Index("ix_samples_split_scan", "dataset_id", "split", "is_verified", "id"),
    sqlite_autoincrement=True,
)

sample_errors = sa.Table(
    "sample_errors",
    metadata,
    sa.Column("id", BigId, sa.Identity(), primary_key=True),
    _owned_by("samples", "sample_id", BigId),
    sa.Column("kind", sa.String(32), nullable=False, comment="missing, corrupt, escape, ..."),
    sa.Column("message", sa.Text, nullable=False),
    sa.Column("count", sa.Integer, nullable=False, server_default="1"),
    sa.Column(
        "first_seen", sa.DateTime(timezone=True), nullable=False, server_default=sa.func.now()
    ),
    sa.Column(
        "last_seen", sa.DateTime(timezone=True), nullable=False, server_default=sa.func.now()
    ),
    sa.UniqueConstraint("sample_id", "kind"),
    sqlite_autoincrement=True,
)
