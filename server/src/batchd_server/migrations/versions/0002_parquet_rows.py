"""Parquet rows: which row group of its file, and which row in it, a sample is.

A Parquet sample is one row of a file, not a byte range of its own: ``byte_offset`` and
``byte_length`` hold the payload column's chunk in the row's group (what a worker reads),
and these two columns say where the row is in it. Both are NULL for every other sample.

Revision ID: 0002
Revises: 0001
Create Date: 2026-11-25
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0002"
down_revision = "0001"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column(
        "samples",
        sa.Column("row_group", sa.Integer, nullable=True, comment="Parquet: the row's row group"),
    )
    op.add_column(
        "samples",
        sa.Column("row_index", sa.Integer, nullable=True, comment="Parquet: its row in that group"),
    )


def downgrade() -> None:
    op.drop_column("samples", "row_index")
    op.drop_column("samples", "row_group")
