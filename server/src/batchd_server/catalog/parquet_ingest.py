"""Fill the catalog from Parquet files: one row, one sample (``parquet/samples.py``), through
the same staged, single-transaction load as every other ingest (``ingest.py``)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from sqlalchemy.engine import Engine

from batchd_server.catalog.ingest import (
    PARQUET_STAGE_COLUMNS,
    IngestReport,
    _find_shards,
    _run,
)
from batchd_server.catalog.manifest import SPLIT_MAX_CHARS, check_name
from batchd_server.catalog.types import DatasetRef
from batchd_server.errors import DataError
from batchd_server.parquet.samples import ParquetSamples
from batchd_server.storage.options import DEFAULT_RETRY_S

__all__ = ["ingest_parquet"]


def ingest_parquet(
    engine: Engine,
    *,
    dataset: str,
    version: str = "1",
    root: str | Path,
    files: list[str],
    payload: str,
    split: str | None = None,
    split_column: str | None = None,
    label: str | None = None,
    key: str | None = None,
    length: str | None = None,
    description: str | None = None,
    progress: Callable[[int, int, int], None] | None = None,
    object_store_retry_s: float = DEFAULT_RETRY_S,
) -> IngestReport:
    """Add the rows of Parquet files: one row, one sample (see ``parquet/samples.py``).

    Args:
        root: A local directory or an object-store prefix (``s3://BUCKET/PREFIX``: files
            are matched against one listing of it, and each footer and small column is read
            with ranged GETs).
        files: Paths, globs or brace ranges, relative to ``root``; every file must be
            under it.
        payload: The column whose value is the sample (``image.bytes`` for a struct's
            field): binary, a list of numbers or a fixed-size list of numbers. A dataset
            serves one payload column: every ingest into it names the same.
        split, split_column: The split of every row, or the column that holds it.
        label, key, length: Columns of labels (integers), keys (default
            ``<file>#<row>``) and sequence lengths (default: a list payload's length).

    Raises:
        DataError: a pattern that matches nothing, a file that is not Parquet or lacks a
            column, a bad value, another payload column than the dataset's, or (dataset,
            version) already rooted elsewhere.
    """
    if split is not None:
        check_name("split", split, SPLIT_MAX_CHARS)
    stored_root, found = _find_shards(root, files, object_store_retry_s=object_store_retry_s)
    opens = {shard.rel: shard.open for shard in found}
    rels = list(opens)
    samples = ParquetSamples(
        files=rels,
        open_file=lambda rel: opens[rel](),
        payload=payload,
        split=split,
        split_column=split_column,
        label=label,
        key=key,
        length=length,
        progress=progress,
    )
    return _run(
        engine,
        name=dataset,
        version=version,
        root=stored_root,
        description=description,
        rows=samples.rows(),
        file=stored_root,
        empty=f"no rows in {len(rels)} Parquet file(s) under {stored_root}",
        columns=PARQUET_STAGE_COLUMNS,
        attrs_update=lambda ref, attrs: _parquet_attrs(ref, attrs, payload),
    )


def _parquet_attrs(ref: DatasetRef, attrs: dict[str, Any], payload: str) -> bool:
    """Record the dataset's payload column; refuse a second one."""
    current = (attrs.get("parquet") or {}).get("payload")
    if current == payload:
        return False
    if current is not None:
        raise DataError(
            f"dataset {ref.name!r} version {ref.version!r} serves Parquet column {current!r}; "
            f"a dataset has one payload column, so ingest --payload {payload!r} into a new "
            "--version (or another dataset) and mix them"
        )
    attrs["parquet"] = {"payload": payload}
    return True
