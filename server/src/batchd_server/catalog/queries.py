"""Small catalog queries: which datasets exist, their splits and sample counts."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime

import sqlalchemy as sa
from sqlalchemy.engine import Engine

from batchd_server.catalog.db import connect
from batchd_server.catalog.members import MEMBERS_ATTR
from batchd_server.catalog.migrate import require_schema
from batchd_server.catalog.schema import datasets, samples
from batchd_server.catalog.types import DatasetRef
from batchd_server.errors import NotFound

__all__ = [
    "DatasetRef",
    "DatasetSummary",
    "SplitSummary",
    "describe_dataset",
    "list_datasets",
    "resolve_dataset",
]


@dataclass(frozen=True)
class SplitSummary:
    name: str
    samples: int
    """All rows of the split."""
    verified: int
    """Rows a session would serve (``is_verified``)."""


@dataclass(frozen=True)
class DatasetSummary:
    id: int
    name: str
    version: str
    root: str
    description: str
    created_at: datetime
    classes: tuple[str, ...]
    splits: tuple[SplitSummary, ...]


def resolve_dataset(conn: sa.Connection, name: str, version: str | None = None) -> DatasetRef:
    """Find a dataset by name and version; ``version=None`` means the newest one.

    Raises:
        NotFound: no such dataset or version; the message lists what exists.
    """
    query = sa.select(
        datasets.c.id, datasets.c.name, datasets.c.version, datasets.c.root, datasets.c.attrs
    ).where(datasets.c.name == name)
    if version is not None:
        query = query.where(datasets.c.version == version)
    query = query.order_by(datasets.c.created_at.desc(), datasets.c.id.desc()).limit(1)
    row = conn.execute(query).first()
    if row is None:
        versions = conn.scalars(
            sa.select(datasets.c.version).where(datasets.c.name == name).order_by(datasets.c.id)
        ).all()
        if versions:
            raise NotFound(
                f"dataset {name!r} has no version {version!r}; versions: {', '.join(versions)}"
            )
        names = conn.scalars(sa.select(datasets.c.name).distinct().order_by(datasets.c.name)).all()
        known = ", ".join(names) if names else "none yet; ingest one with `batchd-server ingest`"
        raise NotFound(f"dataset {name!r} is not in the catalog; datasets: {known}")
    parquet = (row.attrs or {}).get("parquet") or {}
    text = (row.attrs or {}).get("text") or {}
    return DatasetRef(
        id=row.id,
        name=row.name,
        version=row.version,
        root=row.root,
        parquet_payload=str(parquet.get("payload", "")),
        text_identity=str(text.get("identity") or ""),
        members=bool((row.attrs or {}).get(MEMBERS_ATTR)),
    )


def _summaries(conn: sa.Connection, where: sa.ColumnElement[bool] | None) -> list[DatasetSummary]:
    ds_query = sa.select(datasets).order_by(datasets.c.name, datasets.c.id)
    if where is not None:
        ds_query = ds_query.where(where)
    rows = conn.execute(ds_query).all()
    if not rows:
        return []
    counts = conn.execute(
        sa.select(
            samples.c.dataset_id,
            samples.c.split,
            sa.func.count().label("n"),
            sa.func.sum(sa.case((samples.c.is_verified, 1), else_=0)).label("verified"),
        )
        .where(samples.c.dataset_id.in_([r.id for r in rows]))
        .group_by(samples.c.dataset_id, samples.c.split)
        .order_by(samples.c.dataset_id, samples.c.split)
    ).all()
    splits: dict[int, list[SplitSummary]] = {}
    for c in counts:
        splits.setdefault(c.dataset_id, []).append(
            SplitSummary(name=c.split, samples=int(c.n), verified=int(c.verified or 0))
        )
    return [
        DatasetSummary(
            id=r.id,
            name=r.name,
            version=r.version,
            root=r.root,
            description=r.description,
            created_at=r.created_at,
            classes=tuple((r.attrs or {}).get("classes", ())),
            splits=tuple(splits.get(r.id, ())),
        )
        for r in rows
    ]


def list_datasets(engine: Engine) -> list[DatasetSummary]:
    """Every dataset version with its splits and sample counts, ordered by name."""
    require_schema(engine)
    with connect(engine) as conn:
        return _summaries(conn, None)


def describe_dataset(engine: Engine, name: str, version: str | None = None) -> DatasetSummary:
    """One dataset version (the newest when ``version`` is None) with its splits."""
    require_schema(engine)
    with connect(engine) as conn:
        ref = resolve_dataset(conn, name, version)
        (summary,) = _summaries(conn, datasets.c.id == ref.id)
        return summary
