"""The staged load every ingest goes through: a kind of ingest lists its files and turns
them into rows (a :class:`Source`); :func:`load` puts them into a dataset (a
:class:`Target`) in one transaction.

The rows stream into a staging table (COPY on Postgres, ``executemany`` on SQLite) in
chunks, then move into ``samples`` with one ``INSERT ... SELECT ... ON CONFLICT (dataset_id,
key) DO NOTHING``. Rows of ``samples`` are immutable: a key that is already in the dataset is
counted as "already present" and left as it is, which makes every ingest safe to re-run. Any
bad row raises :class:`~batchd_server.errors.DataError` naming the file, line, field and
value, and the transaction, dataset row included, is rolled back.
"""

from __future__ import annotations

import csv
import io
import logging
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from itertools import islice
from pathlib import Path
from typing import Any

import sqlalchemy as sa
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.engine import Engine

from batchd_server.catalog.db import connect, is_postgres
from batchd_server.catalog.manifest import (
    DATASET_NAME_MAX_CHARS,
    VERSION_MAX_CHARS,
    Row,
    RowVerifier,
    check_name,
)
from batchd_server.catalog.migrate import require_schema
from batchd_server.catalog.object_roots import ObjectListing, check_object_root, object_shards
from batchd_server.catalog.queries import DatasetRef
from batchd_server.catalog.schema import datasets
from batchd_server.catalog.tar_shards import Shard, expand_shards, local_shards
from batchd_server.errors import DataError
from batchd_server.storage.schemes import is_local_root

__all__ = [
    "CHUNK_ROWS",
    "PARQUET_STAGE_COLUMNS",
    "IngestReport",
    "Source",
    "Target",
    "find_files",
    "load",
    "resolve_root",
]

log = logging.getLogger(__name__)

CHUNK_ROWS = 50_000
"""Rows staged per COPY / executemany; bounds the memory an ingest holds at once."""
_STAGE_COLUMNS = (
    "line, key, path, byte_offset, byte_length, label, split, length, weight, attrs, "
    "is_verified, byte_size"
)
PARQUET_STAGE_COLUMNS = _STAGE_COLUMNS + ", row_group, row_index"
"""What a Parquet ingest's rows hold: a staged row and where the sample is in its file."""
_STAGE = "batchd_ingest_stage"


@dataclass(frozen=True)
class IngestReport:
    """What one ingest did."""

    dataset: DatasetRef
    rows_read: int
    inserted: int
    already_present: int
    """Rows whose key the dataset already had; left unchanged (samples are immutable)."""
    unverified: int
    """Rows written with ``is_verified`` false because their file was missing at ingest."""
    seconds: float
    missing_paths: tuple[str, ...] = ()
    """Up to five of the missing files, for the summary."""
    skipped: tuple[str, ...] = ()
    """What could not be cataloged and was left out (tar shards: malformed members)."""

    def summary(self) -> str:
        """One line for a terminal or a log."""
        rate = self.rows_read / self.seconds if self.seconds > 0 else 0.0
        text = (
            f"dataset {self.dataset.name!r} version {self.dataset.version!r}: "
            f"{self.rows_read} rows read, {self.inserted} inserted, "
            f"{self.already_present} already present, {self.unverified} unverified "
            f"({self.seconds:.2f} s, {rate:,.0f} rows/s)"
        )
        if self.unverified:
            more = ", ..." if self.unverified > len(self.missing_paths) else ""
            text += f"; missing under {self.dataset.root}: {', '.join(self.missing_paths)}{more}"
        if self.skipped:
            text += f"; {len(self.skipped)} skipped:\n  " + "\n  ".join(self.skipped)
        return text


# --------------------------------------------------------------------------- bulk load


class _Stage:
    """A per-transaction staging table that rows are bulk-loaded into before ``samples``."""

    def __init__(self, conn: sa.Connection) -> None:
        self.conn = conn
        self.postgres = is_postgres(conn.engine)
        if self.postgres:
            conn.exec_driver_sql(
                f"CREATE TEMP TABLE {_STAGE} (line bigint NOT NULL, key text NOT NULL, "
                "path text NOT NULL, byte_offset bigint, byte_length bigint, label bigint, "
                "split text NOT NULL, length integer, weight double precision NOT NULL, "
                "attrs jsonb, is_verified boolean NOT NULL, byte_size bigint, row_group integer, "
                "row_index integer) ON COMMIT DROP"
            )
        else:
            conn.exec_driver_sql(f"DROP TABLE IF EXISTS temp.{_STAGE}")
            conn.exec_driver_sql(
                f"CREATE TEMP TABLE {_STAGE} (line INTEGER, key TEXT, path TEXT, "
                "byte_offset INTEGER, byte_length INTEGER, label INTEGER, split TEXT, "
                "length INTEGER, weight REAL, attrs TEXT, is_verified BOOLEAN, byte_size INTEGER, "
                "row_group INTEGER, row_index INTEGER)"
            )

    def load(self, rows: Iterable[Row], columns: str = _STAGE_COLUMNS) -> int:
        """Stage every row, CHUNK_ROWS at a time; returns how many. ``columns`` names the
        rows' values in order (the columns left out are NULL)."""
        marks = ", ".join("?" * (columns.count(",") + 1))
        cursor = self.conn.connection.dbapi_connection.cursor()  # type: ignore[union-attr]
        total = 0
        it = iter(rows)
        try:
            while chunk := list(islice(it, CHUNK_ROWS)):
                if self.postgres:
                    buf = io.StringIO()
                    csv.writer(buf, lineterminator="\n").writerows(chunk)
                    buf.seek(0)
                    # Text fields are never empty, so an empty CSV field is always NULL.
                    cursor.copy_expert(
                        f"COPY {_STAGE} ({columns}) FROM STDIN WITH (FORMAT csv)", buf
                    )
                else:
                    cursor.executemany(
                        f"INSERT INTO {_STAGE} ({columns}) VALUES ({marks})",
                        chunk,
                    )
                total += len(chunk)
                log.debug("staged %d rows", total)
        finally:
            cursor.close()
        return total

    def first_duplicate(self) -> tuple[str, int, int] | None:
        """The key repeated earliest in the staged rows, with its first two lines."""
        key = self.conn.exec_driver_sql(
            f"SELECT key FROM {_STAGE} GROUP BY key HAVING count(*) > 1 ORDER BY min(line) LIMIT 1"
        ).scalar()
        if key is None:
            return None
        lines = (
            self.conn.execute(
                sa.text(f"SELECT line FROM {_STAGE} WHERE key = :key ORDER BY line LIMIT 2"),
                {"key": key},
            )
            .scalars()
            .all()
        )
        return key, lines[0], lines[1]

    def insert_into_samples(self, dataset_id: int) -> int:
        """Move the staged rows into ``samples`` in line order; returns how many were new."""
        # "WHERE true" keeps SQLite from reading ON CONFLICT as part of a join.
        result = self.conn.execute(
            sa.text(
                "INSERT INTO samples (dataset_id, key, path, byte_offset, byte_length, label, "
                "split, length, weight, attrs, is_verified, byte_size, row_group, row_index) "
                f"SELECT :dataset_id, key, path, byte_offset, byte_length, label, split, "
                f"length, weight, attrs, is_verified, byte_size, row_group, row_index "
                f"FROM {_STAGE} WHERE true "
                "ORDER BY line ON CONFLICT (dataset_id, key) DO NOTHING"
            ),
            {"dataset_id": dataset_id},
        )
        return int(result.rowcount)

    def drop(self) -> None:
        """Postgres drops the table at commit; SQLite keeps it for the connection's life."""
        if not self.postgres:
            self.conn.exec_driver_sql(f"DROP TABLE temp.{_STAGE}")


def _dataset_row(
    conn: sa.Connection, name: str, version: str, root: str, description: str | None
) -> tuple[DatasetRef, bool, dict[str, Any]]:
    """Find or create (name, version); returns the ref, whether it is new, and its attrs."""
    where = sa.and_(datasets.c.name == name, datasets.c.version == version)
    query = sa.select(datasets.c.id, datasets.c.root, datasets.c.attrs).where(where)
    row = conn.execute(query).first()
    created = False
    if row is None:
        insert = (
            postgresql.insert(datasets) if is_postgres(conn.engine) else sqlite.insert(datasets)
        )
        result = conn.execute(
            insert.values(
                name=name, version=version, root=root, description=description or ""
            ).on_conflict_do_nothing(index_elements=["name", "version"])
        )
        created = result.rowcount == 1
        row = conn.execute(query).one()
    if row.root != root:
        raise DataError(
            f"dataset {name!r} version {version!r} already exists with root {row.root!r}, "
            f"not {root!r}; ingest from the same root directory (--root; --out for demo-data), "
            "or give a new --version for data that moved"
        )
    if description and not created:
        conn.execute(
            sa.update(datasets).where(datasets.c.id == row.id).values(description=description)
        )
    ref = DatasetRef(id=row.id, name=name, version=version, root=root)
    return ref, created, dict(row.attrs or {})


def resolve_root(root: str | Path, *, must_exist: bool) -> tuple[str, Path | None]:
    """The root as stored in ``datasets.root``, and as a local directory (None for a URI)."""
    text = str(root)
    if not is_local_root(text):
        return check_object_root(text), None
    path = Path(text).expanduser()
    if must_exist and not path.is_dir():
        what = "is not a directory" if path.exists() else "does not exist"
        raise DataError(
            f"root {text!r} {what}; --root must be the directory that sample paths are under"
        )
    resolved = path.resolve()
    return str(resolved), resolved


def find_files(
    root: str | Path, patterns: list[str], *, object_store_retry_s: float
) -> tuple[str, list[Shard]]:
    """The root as stored, and the files ``patterns`` (globs, brace ranges) match under it:
    listed in the object store for an ``s3://`` root, else found on the local disk."""
    stored_root, local = resolve_root(root, must_exist=True)
    if local is None:
        listing = ObjectListing(stored_root, retry_s=object_store_retry_s)
        return stored_root, object_shards(listing, patterns)
    return stored_root, local_shards(local, expand_shards(patterns, local))


@dataclass(frozen=True)
class Target:
    """The dataset an ingest fills: (name, version), created on first ingest."""

    name: str
    version: str = "1"
    description: str | None = None


@dataclass(frozen=True)
class Source:
    """What one kind of ingest hands :func:`load`: its rows and what the load needs to know
    of them. A new kind of ingest lists its files and turns them into rows; the staging,
    the checks and the single transaction are :func:`load`'s."""

    root: str
    """The dataset root as stored (a local directory, or ``s3://BUCKET/PREFIX``)."""
    rows: Iterable[Row]
    file: str | None = None
    """What errors name as the rows' origin (a manifest); default the root."""
    empty: str | None = None
    """The error when there are no rows; default ``<file>: no rows found``."""
    classes: list[str] | None = None
    """The class names found, when each row's label is a class name (image folders)."""
    missing: RowVerifier | None = None
    """What counted the rows whose file was missing, for the report."""
    columns: str = _STAGE_COLUMNS
    """What each row holds (``_STAGE_COLUMNS`` or ``PARQUET_STAGE_COLUMNS``)."""
    attrs_update: Callable[[DatasetRef, dict[str, Any]], bool] | None = None
    """Checks and updates the dataset's attrs in place before the rows go in (raising
    DataError to refuse); True when it changed them."""


def _class_list(ref: DatasetRef, attrs: Mapping[str, Any], found: list[str]) -> list[str]:
    """The dataset's class list (labels are indexes into it); an existing one keeps its
    meaning, so ``found`` may be a subset of it but must not add to it."""
    existing = attrs.get("classes")
    ordered = list(existing) if existing else sorted(found)
    new = sorted(set(found) - set(ordered))
    if new:
        raise DataError(
            f"dataset {ref.name!r} version {ref.version!r} has classes {ordered}; "
            f"{new} would add classes and change what labels mean. Ingest them into a "
            "new --version"
        )
    return ordered


def load(engine: Engine, target: Target, source: Source) -> IngestReport:
    """Load ``source``'s rows into ``target`` in one transaction and report what happened:
    the dataset row, the class list, the rows staged in chunks, then moved into ``samples``
    (keys already there are left as they are)."""
    name, version, root = target.name, target.version, source.root
    rows, file, missing = source.rows, source.file or root, source.missing
    check_name("dataset", name, DATASET_NAME_MAX_CHARS)
    check_name("version", version, VERSION_MAX_CHARS)
    started = time.perf_counter()
    require_schema(engine)
    with connect(engine) as conn, conn.begin():
        ref, created, attrs = _dataset_row(conn, name, version, root, target.description)
        classes, attrs_update = source.classes, source.attrs_update
        if classes is not None:
            ordered = _class_list(ref, attrs, classes)
            label_of = {c: i for i, c in enumerate(ordered)}
            rows = ((*r[:5], label_of[r[5]], *r[6:]) for r in rows)
            if attrs.get("classes") != ordered:
                attrs["classes"] = ordered
                conn.execute(sa.update(datasets).where(datasets.c.id == ref.id).values(attrs=attrs))
        if attrs_update is not None and attrs_update(ref, attrs):
            conn.execute(sa.update(datasets).where(datasets.c.id == ref.id).values(attrs=attrs))
        stage = _Stage(conn)
        rows_read = stage.load(rows, source.columns)
        if rows_read == 0:
            raise DataError(source.empty or f"{file}: no rows found; nothing to ingest")
        # A new dataset has no rows of its own, so fewer inserts than rows means a repeated
        # key; an existing one needs the (slower) explicit check first.
        duplicate = None if created else stage.first_duplicate()
        inserted = stage.insert_into_samples(ref.id) if duplicate is None else 0
        if created and inserted < rows_read:
            duplicate = stage.first_duplicate()
        if duplicate is not None:
            key, first, second = duplicate
            raise DataError(
                f"{file}, line {second}: key {key!r} repeats line {first}; keys must be "
                "unique within a dataset (the default key is the path, or path@byte_offset)"
            )
        stage.drop()
    return IngestReport(
        dataset=ref,
        rows_read=rows_read,
        inserted=inserted,
        already_present=rows_read - inserted,
        unverified=missing.missing_rows if missing else 0,
        seconds=time.perf_counter() - started,
        missing_paths=tuple(missing.missing_examples) if missing else (),
    )
