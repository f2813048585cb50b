"""Load one split of a dataset into compact numpy arrays.

A session starts by reading every verified row of each split it serves, in id order, once.
The rows land in a handful of flat numpy arrays (56 bytes per sample plus the path bytes;
``types.SplitArrays``), never in one Python object per sample, so the result can be placed in
shared memory for the workers without pickling and without copy-on-write growth.

On Postgres the rows come out of one ``COPY (SELECT ...) TO STDOUT``, the numeric columns
packed by the query into one fixed-width hex field (see ``split_query``) and parsed with a
few vectorised numpy passes (``copy_parser.py``). Elsewhere (the embedded SQLite catalog)
the same rows come from one streamed SELECT.
"""

from __future__ import annotations

import functools
from typing import Any, Final

import numpy as np
import sqlalchemy as sa
from sqlalchemy.engine import Engine

from batchd_server.catalog.columns import ColumnBuilder
from batchd_server.catalog.copy_parser import PackedCopyParser
from batchd_server.catalog.db import connect, is_postgres
from batchd_server.catalog.migrate import require_schema
from batchd_server.catalog.queries import resolve_dataset
from batchd_server.catalog.schema import samples
from batchd_server.catalog.types import DatasetRef, Snapshot, SplitArrays
from batchd_server.errors import InvalidArgument, NotFound, SnapshotMismatch

__all__ = [
    "DEFAULT_CHUNK_BYTES",
    "current_snapshot",
    "load_split",
    "split_query",
]

DEFAULT_CHUNK_BYTES: Final = 32 << 20
"""Query output parsed at a time; bounds the transient memory of a load."""

# Rough Python memory per fetched row on the SQLite path, to turn chunk_bytes into rows.
_FETCHED_ROW_BYTES: Final = 1024


def split_query(
    dataset_id: int, split: str, *, max_sample_id: int | None = None, packed: bool = False
) -> sa.Select[Any]:
    """The one query a load runs: verified rows of a split, ordered by id.

    Its WHERE clause is equality on the leading columns of ``ix_samples_split_scan`` so the
    index yields the rows already in id order.

    Args:
        dataset_id: ``datasets.id``.
        split: The split's name.
        max_sample_id: Only rows with an id up to this (a snapshot's bound).
        packed: Postgres only. Select two columns, the numeric ones packed into fixed-width
            hex (``copy_parser.PACKED`` is its layout) and then the path, for the vectorised
            COPY parse. Otherwise select id, label, length, byte_offset, byte_length, weight,
            path, row_group, row_index.
    """
    c = samples.c
    label = sa.func.coalesce(c.label, -1)
    length = sa.func.coalesce(c.length, -1)
    byte_offset = sa.func.coalesce(c.byte_offset, -1)
    byte_length = sa.func.coalesce(c.byte_length, -1)
    row_group = sa.func.coalesce(c.row_group, -1)
    row_index = sa.func.coalesce(c.row_index, -1)
    columns: list[sa.ColumnElement[Any]]
    if packed:
        parts: list[sa.ColumnElement[Any]] = [
            sa.func.int8send(c.id),
            sa.func.int8send(label),
            sa.func.int8send(byte_offset),
            sa.func.int8send(byte_length),
            sa.func.float8send(c.weight),
            sa.func.int4send(length),
            sa.func.int4send(row_group),
            sa.func.int4send(row_index),
        ]
        record = functools.reduce(lambda left, right: left.op("||")(right), parts)
        columns = [sa.func.encode(record, sa.literal_column("'hex'")), c.path]
    else:
        columns = [
            c.id,
            label,
            length,
            byte_offset,
            byte_length,
            c.weight,
            c.path,
            row_group,
            row_index,
        ]
    query = sa.select(*columns).where(
        c.dataset_id == dataset_id, c.split == split, c.is_verified == sa.true()
    )
    if max_sample_id is not None:
        bound = sa.literal(max_sample_id, sa.BigInteger)
        if packed:
            # Same rows as "id <= bound" given is_verified, but Postgres estimates a row
            # comparison by its first column alone, so a snapshot load is planned like a fresh
            # one. With a plain "id <= bound" the planner, assuming ids and datasets are
            # independent, may walk the primary key through every other dataset's rows or
            # sort the split; this way the bound is an index condition on ix_samples_split_scan
            # and nothing else can use it.
            query = query.where(sa.tuple_(c.is_verified, c.id) <= sa.tuple_(sa.true(), bound))
        else:
            query = query.where(c.id <= bound)
    return query.order_by(c.id)


def load_split(
    engine: Engine,
    dataset: str,
    split: str,
    *,
    version: str | None = None,
    snapshot: Snapshot | None = None,
    chunk_bytes: int = DEFAULT_CHUNK_BYTES,
) -> SplitArrays:
    """Read the verified rows of one split, ordered by id, with one streamed query.

    Args:
        engine: The catalog.
        dataset: Dataset name.
        split: Split name; a split whose rows are all unverified loads as empty.
        version: Dataset version; None means the newest.
        snapshot: Read exactly the rows an earlier load saw (its ``SplitArrays.snapshot``).
        chunk_bytes: Query output parsed at a time (tests make it tiny).

    Raises:
        NotFound: No such dataset, version or split.
        SnapshotMismatch: Rows the snapshot pinned were deleted or un-verified since.
    """
    if chunk_bytes < 1:
        raise InvalidArgument(f"chunk_bytes={chunk_bytes} must be >= 1")
    require_schema(engine)
    max_sample_id = None if snapshot is None else snapshot.max_sample_id
    columns = ColumnBuilder()
    with connect(engine) as conn:
        ref = resolve_dataset(conn, dataset, version)
        if is_postgres(engine):
            _copy_packed_rows(conn, ref.id, split, max_sample_id, columns, chunk_bytes)
        else:
            query = split_query(ref.id, split, max_sample_id=max_sample_id)
            _fetch_rows(conn, query, columns, max(1, chunk_bytes // _FETCHED_ROW_BYTES))
        if columns.row_count == 0:
            _require_split(conn, ref, split)
    if snapshot is None:
        snapshot = Snapshot(max_sample_id=columns.last_id, row_count=columns.row_count)
    elif columns.row_count != snapshot.row_count:
        raise SnapshotMismatch(_mismatch_message(ref, split, snapshot, columns.row_count))
    return columns.build(ref, split, snapshot)


def current_snapshot(
    engine: Engine, dataset: str, split: str, *, version: str | None = None
) -> tuple[DatasetRef, Snapshot]:
    """The snapshot a load of the split would take now, from one index-only aggregate.

    Cheap next to a load: a server compares it with the snapshots of the splits it holds to
    reuse them while the catalog is unchanged.

    Raises:
        NotFound: No such dataset, version or split.
    """
    require_schema(engine)
    c = samples.c
    with connect(engine) as conn:
        ref = resolve_dataset(conn, dataset, version)
        last_id, count = conn.execute(
            sa.select(sa.func.coalesce(sa.func.max(c.id), 0), sa.func.count()).where(
                c.dataset_id == ref.id, c.split == split, c.is_verified == sa.true()
            )
        ).one()
        if count == 0:
            _require_split(conn, ref, split)
    return ref, Snapshot(max_sample_id=int(last_id), row_count=int(count))


def _require_split(conn: sa.Connection, ref: DatasetRef, split: str) -> None:
    """A split with no rows at all is most likely a typo: say which splits exist."""
    names = conn.scalars(
        sa.select(samples.c.split)
        .where(samples.c.dataset_id == ref.id)
        .group_by(samples.c.split)
        .order_by(samples.c.split)
    ).all()
    if split not in names:
        known = ", ".join(names) if names else "none (the dataset has no samples yet)"
        raise NotFound(
            f"dataset {ref.name!r} version {ref.version!r} has no split {split!r}; splits: {known}"
        )


def _mismatch_message(ref: DatasetRef, split: str, snapshot: Snapshot, found: int) -> str:
    what = (
        "rows of that split were deleted or un-verified since the snapshot was taken"
        if found < snapshot.row_count
        else "rows with such ids were added or re-verified after the snapshot was taken"
    )
    return (
        f"snapshot {snapshot.token()} of dataset {ref.name!r} version {ref.version!r} split "
        f"{split!r} pinned {snapshot.row_count} verified rows with id <= "
        f"{snapshot.max_sample_id}, the catalog now has {found}: {what}. Load without a "
        "snapshot to read the split as it is now (and give every rank the new snapshot), or "
        "ingest changed data as a new dataset version so that existing snapshots stay valid"
    )


def _fetch_rows(
    conn: sa.Connection, query: sa.Select[Any], columns: ColumnBuilder, chunk_rows: int
) -> None:
    """Stream ``split_query`` rows with fetchmany; used where COPY is not available."""
    for rows in conn.execute(query).partitions(chunk_rows):
        ids, labels, lengths, byte_offsets, byte_lengths, weights, paths, groups, indexes = zip(
            *rows, strict=True
        )
        encoded = [p.encode("utf-8") for p in paths]
        columns.add(
            ids=ids,
            labels=labels,
            lengths=lengths,
            weights=weights,
            byte_offsets=byte_offsets,
            byte_lengths=byte_lengths,
            path_bytes=np.frombuffer(b"".join(encoded), np.uint8),
            path_lengths=np.fromiter(map(len, encoded), np.int64, count=len(encoded)),
            row_groups=groups,
            row_indexes=indexes,
        )


def _copy_packed_rows(
    conn: sa.Connection,
    dataset_id: int,
    split: str,
    max_sample_id: int | None,
    columns: ColumnBuilder,
    chunk_bytes: int,
) -> None:
    """Stream the packed ``split_query`` through ``COPY ... TO STDOUT`` into ``columns``."""
    compiled = split_query(dataset_id, split, max_sample_id=max_sample_id, packed=True).compile(
        dialect=conn.dialect
    )
    dbapi_conn: Any = conn.connection.dbapi_connection
    parser = PackedCopyParser(columns, chunk_bytes=chunk_bytes)
    with dbapi_conn.cursor() as cur:
        if dbapi_conn.encoding != "UTF8":
            # Paths are stored as UTF-8 in the arrays; LOCAL ends with this transaction.
            cur.execute("SET LOCAL client_encoding TO 'UTF8'")
        # COPY takes no bind parameters, so the driver quotes them into the statement.
        select_sql = cur.mogrify(str(compiled), compiled.params)
        # One statement sees one snapshot of the table: the rows are mutually consistent.
        cur.copy_expert(b"COPY (" + select_sql + b") TO STDOUT", parser)
    parser.close()
