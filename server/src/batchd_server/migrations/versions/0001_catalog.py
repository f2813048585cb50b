"""The catalog: datasets, samples, sample_errors.

Revision ID: 0001
Revises:
Create Date: 2026-11-22
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

revision = "0001"
down_revision = None
branch_labels = None
depends_on = None

BigId = sa.BigInteger().with_variant(sa.Integer(), "sqlite")
Json = sa.JSON().with_variant(postgresql.JSONB(), "postgresql")


def upgrade() -> None:
    op.create_table(
        "datasets",
        sa.Column("id", sa.Integer, sa.Identity(), primary_key=True),
        sa.Column("name", sa.String(255), nullable=False),
        sa.Column("version", sa.String(64), nullable=False),
        sa.Column(
            "root", sa.Text, nullable=False, comment="directory or URI prefix of sample paths"
        ),
        sa.Column("description", sa.Text, nullable=False, server_default=""),
        sa.Column("attrs", Json, nullable=True, comment="e.g. {'classes': [...]} from imagefolder"),
        sa.Column(
            "created_at", sa.DateTime(timezone=True), nullable=False, server_default=sa.func.now()
        ),
        sa.PrimaryKeyConstraint("id", name="pk_datasets"),
        sa.UniqueConstraint("name", "version", name="uq_datasets_name_version"),
        sqlite_autoincrement=True,
    )
    op.create_table(
        "samples",
        sa.Column("id", BigId, sa.Identity(), primary_key=True),
        sa.Column("dataset_id", sa.Integer, nullable=False),
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
        sa.PrimaryKeyConstraint("id", name="pk_samples"),
        sa.ForeignKeyConstraint(
            ["dataset_id"], ["datasets.id"], name="fk_samples_dataset_id", ondelete="CASCADE"
        ),
        sa.UniqueConstraint("dataset_id", "key", name="uq_samples_dataset_id_key"),
        sa.CheckConstraint(
            "(byte_offset IS NULL) = (byte_length IS NULL)", name="ck_samples_byte_range_complete"
        ),
        sa.CheckConstraint("weight >= 0", name="ck_samples_weight_nonnegative"),
        sqlite_autoincrement=True,
    )
    op.create_index(
        "ix_samples_split_scan", "samples", ["dataset_id", "split", "is_verified", "id"]
    )
    op.create_table(
        "sample_errors",
        sa.Column("id", BigId, sa.Identity(), primary_key=True),
        sa.Column("sample_id", BigId, nullable=False),
        sa.Column("kind", sa.String(32), nullable=False, comment="missing, corrupt, escape, ..."),
        sa.Column("message", sa.Text, nullable=False),
        sa.Column("count", sa.Integer, nullable=False, server_default="1"),
        sa.Column(
            "first_seen", sa.DateTime(timezone=True), nullable=False, server_default=sa.func.now()
        ),
        sa.Column(
            "last_seen", sa.DateTime(timezone=True), nullable=False, server_default=sa.func.now()
        ),
        sa.PrimaryKeyConstraint("id", name="pk_sample_errors"),
        sa.ForeignKeyConstraint(
            ["sample_id"], ["samples.id"], name="fk_sample_errors_sample_id", ondelete="CASCADE"
        ),
        sa.UniqueConstraint("sample_id", "kind", name="uq_sample_errors_sample_id_kind"),
        sqlite_autoincrement=True,
    )


def downgrade() -> None:
    op.drop_table("sample_errors")
    op.drop_index("ix_samples_split_scan", table_name="samples")
    op.drop_table("samples")
    op.drop_table("datasets")
