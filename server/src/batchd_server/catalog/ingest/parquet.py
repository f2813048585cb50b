"""Fill the catalog from Parquet files: one row of a file, one sample, through the same staged,
single-transaction load as every other ingest (``load.py``).

Each sample's row records the file (``path``), its row group and its row in it
(``row_group``, ``row_index``), and as its byte range the payload column's chunk in that
row group (``payload.chunk_range``): what a worker reads to serve any row of the group. Of
each file only the footer and the small columns asked for (label, split, key, length) are
read, a row group at a time; the payload itself is read only for a list payload without a
``--length`` column (a sequence's length is its list's).

Files are opened by ``open_file`` (a seekable binary file object: a local file, or ranged
reads of an object), so one code path serves every kind of root. The worker's side of the
same files (footers, row groups, pages) is ``parquet/``, which knows nothing of the catalog.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import IO, Any, Final

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
from sqlalchemy.engine import Engine

from batchd_server.catalog.ingest.load import (
    PARQUET_STAGE_COLUMNS,
    IngestReport,
    Source,
    Target,
    find_files,
    load,
)
from batchd_server.catalog.ingest.token_counts import TextSpec, TokenCounter, chunked, text_attrs
from batchd_server.catalog.manifest import SPLIT_MAX_CHARS, Row, check_name
from batchd_server.catalog.types import DatasetRef
from batchd_server.errors import DataError
from batchd_server.parquet.budget import pages_bound
from batchd_server.parquet.payload import (
    Payload,
    chunk_range,
    describe_schema,
    find_field,
    resolve_payload,
)
from batchd_server.pipelines.base import BadSample
from batchd_server.storage.options import DEFAULT_RETRY_S

__all__ = ["ParquetSamples", "ingest_parquet"]


def ingest_parquet(
    engine: Engine,
    *,
    dataset: str,
    version: str = "1",
    root: str | Path,
    files: list[str],
    payload: str | None = None,
    text: str | None = None,
    tokenizer: str | None = None,
    template: str | None = None,
    workers: int | None = None,
    split: str | None = None,
    split_column: str | None = None,
    label: str | None = None,
    key: str | None = None,
    length: str | None = None,
    description: str | None = None,
    progress: Callable[[int, int, int], None] | None = None,
    object_store_retry_s: float = DEFAULT_RETRY_S,
) -> IngestReport:
    """Add the rows of Parquet files: one row, one sample (see :class:`ParquetSamples`).

    Args:
        root: A local directory or an object-store prefix (``s3://BUCKET/PREFIX``: files
            are matched against one listing of it, and each footer and small column is read
            with ranged GETs).
        files: Paths, globs or brace ranges, relative to ``root``; every file must be
            under it.
        payload: The column whose value is the sample (``image.bytes`` for a struct's
            field): binary, a list of numbers or a fixed-size list of numbers. A dataset
            serves one payload column: every ingest into it names the same.
        text: Instead of ``payload``: a string column of text documents, served by
            ``batchd.Text`` (empty or null ones are left out and listed in the report).
        tokenizer: With ``text``: record each document's token count (``batchd.Pack``
            plans from them), counted by ``workers`` processes (default: the CPUs).
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
    if (payload is None) == (text is None):
        raise DataError("name the sample's column: --payload COLUMN or --text COLUMN (one)")
    if (tokenizer is not None or template is not None) and text is None:
        raise DataError("--tokenizer and --template count text documents: they go with --text")
    if template is not None:
        raise DataError("--template renders chat messages, which Parquet ingest does not take")
    spec = TextSpec("text", text, tokenizer, raw=True) if text is not None else None
    counter = TokenCounter(spec, workers) if spec is not None and tokenizer else None
    column = text if text is not None else str(payload)
    stored_root, found = find_files(root, files, object_store_retry_s=object_store_retry_s)
    opens = {shard.rel: shard.open for shard in found}
    rels = list(opens)
    samples = ParquetSamples(
        files=rels,
        open_file=lambda rel: opens[rel](),
        payload=column,
        text=spec is not None,
        split=split,
        split_column=split_column,
        label=label,
        key=key,
        length=length,
        progress=progress,
    )
    identity = counter.identity if counter is not None else ""

    def attrs_update(ref: DatasetRef, attrs: dict[str, Any]) -> bool:
        changed = _parquet_attrs(ref, attrs, column)
        return (spec is not None and text_attrs(ref, attrs, spec, identity)) or changed

    report = load(
        engine,
        Target(dataset, version, description),
        Source(
            root=stored_root,
            rows=_counted(samples.rows(), counter) if counter else _plain(samples, spec),
            empty=f"no rows in {len(rels)} Parquet file(s) under {stored_root}",
            columns=PARQUET_STAGE_COLUMNS,
            attrs_update=attrs_update,
        ),
    )
    skipped = samples.skipped
    shown = skipped[:20] + ([f"... and {len(skipped) - 20} more"] if len(skipped) > 20 else [])
    return replace(report, skipped=tuple(shown)) if shown else report


def _plain(samples: ParquetSamples, spec: TextSpec | None) -> Iterator[Row]:
    """The rows without token counts (without their text's bytes)."""
    rows = samples.rows()
    return rows if spec is None else (row[:-1] for row in rows)


def _counted(rows: Iterator[Row], counter: TokenCounter) -> Iterator[Row]:
    """``rows`` (their last value the document's UTF-8) with their token counts."""
    with counter:
        chunks = (([r[:-1] for r in c], [r[-1] for r in c]) for c in chunked(rows))
        for metas, counts in counter.counted(chunks):
            for row, count in zip(metas, counts, strict=True):
                if isinstance(count, str):
                    raise DataError(f"{row[2]}, row {row[-1]} of group {row[-2]}: {count}")
                yield (*row[:7], count, *row[8:])


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


_INT32_MAX: Final = 2**31 - 1
_ROWS_PER_BYTE: Final = 8
"""Rows a payload chunk's byte may hold (a row's value takes a bit at least, but for long
runs of nulls) before its footer's count is checked against its page headers."""


@dataclass
class ParquetSamples:
    """The rows of a set of Parquet files.

    Args:
        files: Each file's path relative to the dataset root, in order.
        open_file: Opens a file by that path, for reading.
        payload: The payload column (``image.bytes``).
        split: The split of every row; or
        split_column: the string column that holds each row's split.
        label: An integer column of labels (nulls: no label).
        key: A column of keys (strings or integers); default ``<file>#<row in file>``.
        length: An integer column of sequence lengths; default, for a list payload, its
            length.
        progress: Called after each file with (files done, files, rows so far).

    Raises:
        DataError: (from ``rows()``) a file that is not Parquet, lacks a column, or holds a
            value that is not allowed (the message names the file, row and value).
    """

    files: Sequence[str]
    open_file: Callable[[str], IO[bytes]]
    payload: str
    split: str | None = None
    split_column: str | None = None
    label: str | None = None
    key: str | None = None
    length: str | None = None
    progress: Callable[[int, int, int], None] | None = None
    text: bool = False
    """The payload is a string column of text documents: each row ends with its UTF-8 (for
    counting its tokens); empty and null ones are left out, in ``skipped``."""
    payload_kinds: set[str] = field(default_factory=set)
    """The payload kinds met (``binary``, ``list``, ``fixed``)."""
    skipped: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        if (self.split is None) == (self.split_column is None):
            raise DataError("give the split of the rows: --split NAME or --split-column COLUMN")

    def rows(self) -> Iterator[Row]:
        line = 0
        for done, rel in enumerate(self.files, 1):
            with self.open_file(rel) as f:
                for row in self._file_rows(rel, f, line):
                    line += 1
                    yield row
            if self.progress is not None:
                self.progress(done, len(self.files), line)

    def _file_rows(self, rel: str, f: IO[bytes], line: int) -> Iterator[Row]:
        try:
            pf = pq.ParquetFile(f)
        except (pa.ArrowException, OSError) as e:
            raise DataError(f"{rel} is not a Parquet file ({e})") from e
        self._check_text(pf, rel)
        payload = resolve_payload(pf, self.payload, rel)
        self.payload_kinds.add(payload.kind)
        small = {
            "label": self.label,
            "split": self.split_column,
            "key": self.key,
            "length": self.length,
        }
        wanted = {role: self._column(pf, rel, role, name) for role, name in small.items() if name}
        read = sorted({".".join(path) for path, _ in wanted.values()})
        with_lengths = payload.kind == "list" and self.length is None
        if with_lengths or self.text:
            read.append(".".join(payload.names))
        metadata = pf.metadata
        _check_row_counts(rel, f, metadata, payload)
        row_in_file = 0
        for group in range(metadata.num_row_groups):
            offset, nbytes = chunk_range(metadata.row_group(group), payload.leaves)
            count = metadata.row_group(group).num_rows
            values: dict[str, list[Any]] = {}
            if read:
                try:
                    table = pf.read_row_group(group, columns=read, use_threads=False)
                except (pa.ArrowException, OSError) as e:
                    raise DataError(f"{rel}: row group {group} cannot be read ({e})") from e
                if table.num_rows != count:
                    raise _lying(rel, group, count, f"its columns hold {table.num_rows} rows")
                for role, (path, _) in wanted.items():
                    values[role] = _field(table, path).to_pylist()
                if with_lengths:
                    lengths = pc.list_value_length(_field(table, payload.names))
                    values["length"] = lengths.to_pylist()
                if self.text:
                    values["text"] = _field(table, payload.names).to_pylist()
            for i in range(count):
                where = f"{rel}, row {row_in_file}"
                row_in_file += 1
                if self.text:
                    document = values["text"][i]
                    if not document:
                        what = "null" if document is None else "an empty document"
                        self.skipped.append(f"{where}: {what} (left out: it has no tokens)")
                        continue
                line += 1
                row = self._row(line, rel, where, row_in_file - 1, values, i, offset, nbytes, group)
                yield (*row, document.encode("utf-8")) if self.text else row

    def _row(
        self,
        line: int,
        rel: str,
        where: str,
        row_in_file: int,
        values: dict[str, list[Any]],
        i: int,
        offset: int,
        nbytes: int,
        group: int,
    ) -> Row:
        label = values["label"][i] if "label" in values else None
        split = values["split"][i] if "split" in values else self.split
        if split is None or not 0 < len(split) <= SPLIT_MAX_CHARS or "\x00" in split:
            raise DataError(
                f"{where}: split={split!r} is not valid; {self.split_column!r} must hold "
                f"non-empty strings of at most {SPLIT_MAX_CHARS} characters"
            )
        key = values["key"][i] if "key" in values else f"{rel}#{row_in_file}"
        if key is None or key == "":
            raise DataError(f"{where}: key is null or empty; --key {self.key!r} must hold keys")
        if isinstance(key, str) and "\x00" in key:
            raise DataError(
                f"{where}: key {key!r} holds a NUL character, which no catalog can store; "
                f"clean --key {self.key!r} of NULs"
            )
        length = values["length"][i] if "length" in values else None
        if length is not None and not 0 <= length <= _INT32_MAX:
            raise DataError(f"{where}: length={length} is not valid; it must be 0 to {_INT32_MAX}")
        return (
            line,
            str(key),
            rel,
            offset,
            nbytes,
            label,
            split,
            length,
            1.0,
            None,
            True,
            None,
            group,
            i,
        )

    def _check_text(self, pf: pq.ParquetFile, rel: str) -> None:
        """A text column holds strings; a string column is taken only as text."""
        found = find_field(pf.schema_arrow, self.payload)
        if found is None:
            return  # resolve_payload says it is missing
        t = found[1]
        is_string = pa.types.is_string(t) or pa.types.is_large_string(t)
        if self.text and not is_string:
            raise DataError(
                f"{rel}: column {self.payload!r} (--text) is {t}; text documents are a string "
                "column (tokens already made are a list of integers: --payload)"
            )
        if not self.text and is_string:
            raise DataError(
                f"{rel}: column {self.payload!r} is {t}: text. Ingest it with --text "
                f"{self.payload} (and --tokenizer PATH for packing), and serve it with "
                "batchd.Text"
            )

    def _column(
        self, pf: pq.ParquetFile, rel: str, role: str, name: str
    ) -> tuple[tuple[str, ...], pa.DataType]:
        found = find_field(pf.schema_arrow, name)
        flag = {
            "label": "--label",
            "split": "--split-column",
            "key": "--key",
            "length": "--length",
        }[role]
        if found is None:
            raise DataError(
                f"{rel} has no column {name!r} for {flag}; its columns: "
                f"{describe_schema(pf.schema_arrow)}"
            )
        t = found[1]
        ok = {
            "label": pa.types.is_integer(t),
            "length": pa.types.is_integer(t),
            "split": pa.types.is_string(t)
            or pa.types.is_large_string(t)
            or pa.types.is_dictionary(t),
            "key": pa.types.is_string(t) or pa.types.is_large_string(t) or pa.types.is_integer(t),
        }[role]
        if not ok:
            allowed = {
                "label": "integers (class indices)",
                "length": "integers",
                "split": "strings",
                "key": "strings or integers",
            }[role]
            raise DataError(f"{rel}: column {name!r} ({flag}) is {t}; it must hold {allowed}")
        return found


def _check_row_counts(rel: str, f: IO[bytes], metadata: pq.FileMetaData, payload: Payload) -> None:
    """The footer's row counts agree with each other and with the payload's values, and,
    where a row group claims more rows than its payload chunk has bits, with its page headers
    (each row of the footer becomes a catalog row: a footer that lies must not make an
    ingest of billions of rows).

    Raises:
        DataError: naming the file and row group.
    """
    total = 0
    for group in range(metadata.num_row_groups):
        meta = metadata.row_group(group)
        rows = meta.num_rows
        if rows < 0:
            raise _lying(rel, group, rows, "a row count cannot be negative")
        for leaf in payload.leaves:
            values = meta.column(leaf).num_values
            repeated = metadata.schema.column(leaf).max_repetition_level > 0
            if values < rows or (values != rows and not repeated):
                raise _lying(rel, group, rows, f"its payload column has {values} values")
        _, nbytes = chunk_range(meta, payload.leaves)
        if rows > _ROWS_PER_BYTE * nbytes:

            def read(at: int, count: int) -> bytes:
                f.seek(at)
                return f.read(count)

            try:
                pages_bound(metadata, payload, group, read, f"{rel}: row group {group}")
            except BadSample as e:
                raise _lying(rel, group, rows, f"its pages do not say so ({e})") from e
        total += rows
    if total != metadata.num_rows:
        raise DataError(
            f"{rel}: its footer says it has {metadata.num_rows} rows, its row groups "
            f"{total}: the file is corrupt or was cut short; rewrite it"
        )


def _lying(rel: str, group: int, rows: int, why: str) -> DataError:
    return DataError(
        f"{rel}: its footer says row group {group} has {rows} rows, but {why}: the file is "
        "corrupt or was cut short; rewrite it"
    )


def _field(table: pa.Table, path: Sequence[str]) -> pa.Array:
    """The column at ``path`` (a struct's field for a dotted name) as one array."""
    array = table.column(path[0]).combine_chunks()
    for name in path[1:]:
        array = array.flatten()[array.type.get_field_index(name)]
    return array
