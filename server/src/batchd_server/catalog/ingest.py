"""Fill the catalog from a JSONL/CSV manifest, an image-folder tree or WebDataset tar shards
(and, through ``parquet_ingest``, Parquet files), in one transaction.

Both ingests stream their rows into a staging table (COPY on Postgres, ``executemany`` on
SQLite) in chunks, then move them into ``samples`` with one ``INSERT ... SELECT ... ON
CONFLICT (dataset_id, key) DO NOTHING``. Rows of ``samples`` are immutable: a key that is
already in the dataset is counted as "already present" and left as it is, which makes every
ingest safe to re-run. Any bad row raises :class:`~batchd_server.errors.DataError` naming the
file, line, field and value, and the transaction, dataset row included, is rolled back.
"""

from __future__ import annotations

import csv
import dataclasses
import io
import logging
import os
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
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
    SPLIT_MAX_CHARS,
    VERSION_MAX_CHARS,
    Row,
    RowChecker,
    Verifier,
    check_name,
    read_csv,
    read_jsonl,
    trusted,
)
from batchd_server.catalog.migrate import require_schema
from batchd_server.catalog.object_roots import (
    ObjectListing,
    ObjectVerifier,
    check_object_root,
    iter_object_rows,
    object_images,
    object_shards,
)
from batchd_server.catalog.queries import DatasetRef
from batchd_server.catalog.schema import datasets
from batchd_server.catalog.tar_shards import Shard, TarSamples, expand_shards, local_shards
from batchd_server.errors import DataError
from batchd_server.storage.options import DEFAULT_RETRY_S
from batchd_server.storage.schemes import is_local_root

__all__ = [
    "IMAGE_SUFFIXES",
    "PARQUET_STAGE_COLUMNS",
    "IngestReport",
    "ingest_imagefolder",
    "ingest_manifest",
    "ingest_tar",
]

log = logging.getLogger(__name__)

IMAGE_SUFFIXES = frozenset({".jpg", ".jpeg", ".png", ".webp"})
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


def _resolve_root(root: str | Path, *, must_exist: bool) -> tuple[str, Path | None]:
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


def _find_shards(
    root: str | Path, patterns: list[str], *, object_store_retry_s: float
) -> tuple[str, list[Shard]]:
    """The root as stored, and the files ``patterns`` (globs, brace ranges) match under it:
    listed in the object store for an ``s3://`` root, else found on the local disk."""
    stored_root, local = _resolve_root(root, must_exist=True)
    if local is None:
        listing = ObjectListing(stored_root, retry_s=object_store_retry_s)
        return stored_root, object_shards(listing, patterns)
    return stored_root, local_shards(local, expand_shards(patterns, local))


def _run(
    engine: Engine,
    *,
    name: str,
    version: str,
    root: str,
    description: str | None,
    rows: Iterable[Row],
    file: str,
    empty: str | None = None,
    classes: list[str] | None = None,
    missing: Verifier | ObjectVerifier | None = None,
    columns: str = _STAGE_COLUMNS,
    attrs_update: Callable[[DatasetRef, dict[str, Any]], bool] | None = None,
) -> IngestReport:
    """Load ``rows`` into (name, version) in one transaction and report what happened.

    ``columns``: what each row holds (``_STAGE_COLUMNS`` or ``PARQUET_STAGE_COLUMNS``).
    ``attrs_update``: checks and updates the dataset's attrs in place before the rows go in
    (raising DataError to refuse); True when it changed them.
    """
    check_name("dataset", name, DATASET_NAME_MAX_CHARS)
    check_name("version", version, VERSION_MAX_CHARS)
    started = time.perf_counter()
    require_schema(engine)
    with connect(engine) as conn, conn.begin():
        ref, created, attrs = _dataset_row(conn, name, version, root, description)
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
        rows_read = stage.load(rows, columns)
        if rows_read == 0:
            raise DataError(empty or f"{file}: no rows found; nothing to ingest")
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


def ingest_manifest(
    engine: Engine,
    *,
    dataset: str,
    version: str = "1",
    root: str | Path,
    manifest: str | Path,
    split: str | None = None,
    verify: bool = True,
    description: str | None = None,
    object_store_retry_s: float = DEFAULT_RETRY_S,
) -> IngestReport:
    """Add the rows of a JSONL (``.jsonl``/``.ndjson``) or CSV (``.csv``) manifest.

    Fields: ``path`` (required, relative to ``root``), ``split`` (required unless ``split``
    gives a default), and optionally ``key`` (default: the path, or ``path@byte_offset`` for
    a byte range), ``label``, ``length``, ``weight``, ``byte_offset`` + ``byte_length``,
    ``attrs`` (a JSON object). A key the dataset already has is left unchanged.

    Args:
        verify: stat each file under ``root``: rows with a missing file are written with
            ``is_verified`` false; a byte range past the end of its file is an error.
            ``False`` trusts the manifest: nothing is read, every row is verified, and
            ``byte_size`` is ``byte_length`` (or unknown).

    Raises:
        DataError: a bad row (the message names file, line, field and value; nothing is
            written), a missing root, or (dataset, version) already rooted elsewhere.
    """
    file = str(manifest)
    path = Path(manifest).expanduser()
    suffix = path.suffix.lower()
    if suffix not in (".jsonl", ".ndjson", ".csv"):
        raise DataError(f"manifest {file!r} must end in .jsonl, .ndjson or .csv")
    if not path.is_file():
        raise DataError(f"manifest {file!r} does not exist or is not a file")
    if split is not None:
        check_name("split", split, SPLIT_MAX_CHARS)
    stored_root, local_root = _resolve_root(root, must_exist=verify)
    checker = RowChecker(file, split)
    verifier: Verifier | ObjectVerifier | None = None
    if verify:
        if local_root is not None:
            verifier = Verifier(local_root, file)
        else:
            listing = ObjectListing(stored_root, retry_s=object_store_retry_s)
            verifier = ObjectVerifier(listing, file)
    with path.open(encoding="utf-8-sig", newline="" if suffix == ".csv" else None) as f:
        parsed = read_csv(f, checker) if suffix == ".csv" else read_jsonl(f, checker)
        rows = map(verifier.verify, parsed) if verifier else trusted(parsed)
        try:
            return _run(
                engine,
                name=dataset,
                version=version,
                root=stored_root,
                description=description,
                rows=rows,
                file=file,
                missing=verifier,
            )
        except UnicodeDecodeError as e:
            raise DataError(f"{file}: not UTF-8 text ({e.reason} at byte {e.start})") from e


# --------------------------------------------------------------------------- image folders


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


def _subdirs(path: Path, verifier: Verifier) -> list[str]:
    names = []
    for entry in os.scandir(path):
        if entry.name.startswith(".") or not entry.is_dir():
            continue
        if not verifier.inside(os.path.realpath(entry.path)):
            raise DataError(f"{entry.path} resolves outside --root {verifier.root} (a symlink)")
        names.append(entry.name)
    return sorted(names)


def _images(path: Path, verifier: Verifier) -> list[tuple[str, int]]:
    found = []
    for entry in os.scandir(path):
        name = entry.name
        if os.path.splitext(name)[1].lower() not in IMAGE_SUFFIXES or not entry.is_file():
            continue
        if entry.is_symlink() and not verifier.inside(os.path.realpath(entry.path)):
            raise DataError(f"{entry.path} resolves outside --root {verifier.root} (a symlink)")
        found.append((name, entry.stat().st_size))
    found.sort()
    return found


def _no_images(root: str, split: str | None) -> str:
    layout = "root/<class>/<image>" if split else "root/<split>/<class>/<image>"
    hint = "" if split else "; for root/<class>/<image>, pass --split"
    return f"no .jpg/.jpeg/.png/.webp images found in {root} as {layout}{hint}"


def ingest_imagefolder(
    engine: Engine,
    *,
    dataset: str,
    version: str = "1",
    root: str | Path,
    split: str | None = None,
    description: str | None = None,
    object_store_retry_s: float = DEFAULT_RETRY_S,
) -> IngestReport:
    """Add the images of a class-per-directory tree.

    Without ``split`` the tree is ``root/<split>/<class>/<image>``; with it, the whole tree is
    that split: ``root/<class>/<image>``. Images are .jpg .jpeg .png .webp (any case); other
    files and hidden directories are ignored. Labels index the sorted class names (the union
    over the splits ingested), stored as ``datasets.attrs["classes"]``; a later ingest may use
    a subset of that list but never add to it. Keys are paths relative to ``root``.

    Raises:
        DataError: no images, a class the dataset does not have, a symlink out of ``root``,
            or (dataset, version) already rooted elsewhere.
    """
    stored_root, local = _resolve_root(root, must_exist=True)
    if split is not None:
        check_name("split", split, SPLIT_MAX_CHARS)
    if local is None:
        listing = ObjectListing(stored_root, retry_s=object_store_retry_s)
        images = object_images(listing, split, IMAGE_SUFFIXES)
        return _run(
            engine,
            name=dataset,
            version=version,
            root=stored_root,
            description=description,
            rows=iter_object_rows(images),
            file=stored_root,
            empty=_no_images(stored_root, split),
            classes=sorted({c for _, c, _, _ in images}),
        )
    verifier = Verifier(local, stored_root)
    splits = [split] if split is not None else _subdirs(local, verifier)
    folders: list[tuple[str, str, Path]] = []  # (split, class, directory)
    for s in splits:
        if len(s) > SPLIT_MAX_CHARS:
            raise DataError(f"split directory {s!r} is longer than {SPLIT_MAX_CHARS} characters")
        base = local if split is not None else local / s
        folders += [(s, c, base / c) for c in _subdirs(base, verifier)]

    def rows() -> Iterator[Row]:
        line = 0
        for s, c, folder in folders:
            prefix = os.path.relpath(folder, local) + "/"
            for name, size in _images(folder, verifier):
                line += 1
                rel = prefix + name
                # The label column holds the class name until _run maps it to its index.
                yield (line, rel, rel, None, None, c, s, None, 1.0, None, True, size)

    return _run(
        engine,
        name=dataset,
        version=version,
        root=stored_root,
        description=description,
        rows=rows(),
        file=stored_root,
        empty=_no_images(stored_root, split),
        classes=sorted({c for _, c, _ in folders}),
    )


# --------------------------------------------------------------------------- tar shards


def ingest_tar(
    engine: Engine,
    *,
    dataset: str,
    version: str = "1",
    root: str | Path,
    shards: list[str],
    split: str | None = None,
    label_key: str = "label",
    description: str | None = None,
    progress: Callable[[int, int, int], None] | None = None,
    object_store_retry_s: float = DEFAULT_RETRY_S,
) -> IngestReport:
    """Add the samples of WebDataset-style tar shards, as byte ranges inside them.

    Members are grouped by key (the name up to its first dot); each sample's payload member
    (the one that is not ``.cls``/``.json``/``.txt``) is its row's byte range, the label is
    the ``.cls`` integer, the ``.json`` field ``label_key`` or an integer ``.txt``, and the
    other members' ranges go to ``attrs["members"]``. Keys are ``<shard>#<key>``. Malformed
    samples are skipped and listed in the report's ``skipped``; see ``tar_shards``.

    Args:
        shards: Paths, globs or brace ranges (``shard-{000..099}.tar``); relative ones are
            relative to ``root``. Every shard must be under ``root``.
        split: The split of every sample; default the one word of ``train``/``val``/``test``
            in each shard's name.
        progress: Called after each shard with (shards done, shards, samples so far).

    Raises:
        DataError: a pattern that matches nothing, a compressed shard, a shard outside
            ``root`` or of unknown split, no sample at all, or (dataset, version) already
            rooted elsewhere.
    """
    if split is not None:
        check_name("split", split, SPLIT_MAX_CHARS)
    stored_root, found = _find_shards(root, shards, object_store_retry_s=object_store_retry_s)
    samples = TarSamples(
        found,
        split,
        label_key=label_key,
        progress=progress,
    )
    report = _run(
        engine,
        name=dataset,
        version=version,
        root=stored_root,
        description=description,
        rows=samples.rows(),
        file=stored_root,
        empty=f"no samples found in {len(samples.shards)} shard(s) under {stored_root}"
        + "".join(f"\n  {s}" for s in samples.skipped[:20]),
    )
    return dataclasses.replace(report, skipped=tuple(samples.skipped))
