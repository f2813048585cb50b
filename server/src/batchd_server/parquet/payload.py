"""The payload column of a Parquet file: where it is in the schema, what its values are, and
which bytes of a row group hold them.

A payload is named like ``image`` or, for a field of a struct, ``image.bytes`` (as Hugging
Face exports images: ``struct<bytes: binary, path: string>``). Its values are one of:

- **binary** (``binary``, ``large_binary``, ``fixed_size_binary``): each row's bytes are a
  sample as if they were a file (an encoded image, a ``.npy``, raw records). A string column
  (``string``, ``large_string``) is binary too: its rows are their UTF-8 text (the ingest
  takes one only as ``--text``, for ``batchd.Text``).
- **list** (``list``/``large_list`` of numbers): a variable-length sequence, such as tokens.
- **fixed** (``fixed_size_list`` of numbers, nested for more dimensions): a fixed-shape array.

A row group stores each leaf column as one contiguous *column chunk*; the payload's leaves
(one, or two for a list: its offsets are in the same leaf) span one byte range of the file,
:func:`chunk_range`, which is all a worker reads of the row group.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Final

import pyarrow as pa
import pyarrow.parquet as pq

from batchd_server.errors import DataError

__all__ = ["KINDS", "Payload", "chunk_range", "find_field", "resolve_payload"]

KINDS: Final = ("binary", "list", "fixed")
_ALLOWED: Final = (
    "binary (image bytes, .npy, raw records), a list of numbers (tokens) or a fixed-size "
    "list of numbers (arrays)"
)


@dataclass(frozen=True)
class Payload:
    """A resolved payload column."""

    column: str
    """As it was named: ``image.bytes``."""
    names: tuple[str, ...]
    """The Arrow field path: ``("image", "bytes")``."""
    kind: str
    """One of :data:`KINDS`."""
    value_type: pa.DataType | None
    """The numbers' type for ``list`` and ``fixed``; None for ``binary``."""
    width: int
    """``fixed``: numbers in one row (the product of the nested sizes); 0 otherwise."""
    leaves: tuple[int, ...]
    """Indices of the payload's leaf columns in the Parquet schema."""


def find_field(schema: pa.Schema, column: str) -> tuple[tuple[str, ...], pa.DataType] | None:
    """The field path and type that ``column`` names, or None.

    A name is first looked for whole (a top-level column may have a dot in its name), then
    as ``struct.field`` paths, longest prefix first at each level.
    """
    fields = {f.name: f.type for f in schema}
    return _find(fields, column.split("."))


def _find(
    fields: dict[str, pa.DataType], parts: list[str]
) -> tuple[tuple[str, ...], pa.DataType] | None:
    for cut in range(len(parts), 0, -1):
        name = ".".join(parts[:cut])
        if name not in fields:
            continue
        found = fields[name]
        if cut == len(parts):
            return (name,), found
        if pa.types.is_struct(found):
            inner = _find(
                {found.field(i).name: found.field(i).type for i in range(found.num_fields)},
                parts[cut:],
            )
            if inner is not None:
                return (name, *inner[0]), inner[1]
    return None


def _numeric(t: pa.DataType) -> bool:
    return pa.types.is_integer(t) or pa.types.is_floating(t)


def _classify(t: pa.DataType) -> tuple[str, pa.DataType | None, int] | None:
    if pa.types.is_binary(t) or pa.types.is_large_binary(t) or pa.types.is_fixed_size_binary(t):
        return "binary", None, 0
    if pa.types.is_string(t) or pa.types.is_large_string(t):
        return "binary", None, 0
    if (pa.types.is_list(t) or pa.types.is_large_list(t)) and _numeric(t.value_type):
        return "list", t.value_type, 0
    if pa.types.is_fixed_size_list(t):
        width, inner = t.list_size, t.value_type
        while pa.types.is_fixed_size_list(inner):
            width, inner = width * inner.list_size, inner.value_type
        if _numeric(inner):
            return "fixed", inner, width
    return None


def resolve_payload(pf: pq.ParquetFile, column: str, where: str) -> Payload:
    """The payload ``column`` of the file ``pf`` (``where`` names it in messages).

    Raises:
        DataError: no such column, or not one of the payload types.
    """
    schema = pf.schema_arrow
    found = find_field(schema, column)
    if found is None:
        raise DataError(
            f"{where} has no column {column!r} for --payload; its columns: "
            f"{describe_schema(schema)}"
        )
    names, arrow_type = found
    classified = _classify(arrow_type)
    if classified is None:
        hint = ""
        if pa.types.is_struct(arrow_type) and arrow_type.get_field_index("bytes") >= 0:
            hint = f" (a struct: for its bytes, pass --payload {column}.bytes)"
        raise DataError(
            f"{where}: column {column!r} is {arrow_type}{hint}; a payload must be {_ALLOWED}"
        )
    kind, value_type, width = classified
    prefix = ".".join(names)
    parquet_schema = pf.schema
    leaves = tuple(
        i
        for i in range(len(parquet_schema))
        if parquet_schema.column(i).path == prefix
        or parquet_schema.column(i).path.startswith(prefix + ".")
    )
    assert leaves, f"an Arrow field has Parquet leaves: {prefix}"
    return Payload(column, names, kind, value_type, width, leaves)


def describe_schema(schema: pa.Schema) -> str:
    """``name: type`` of each top-level column, for messages."""
    text = ", ".join(f"{f.name}: {f.type}" for f in schema)
    return text if len(text) <= 400 else text[:397] + "..."


def chunk_range(row_group: pq.RowGroupMetaData, leaves: tuple[int, ...]) -> tuple[int, int]:
    """``(offset, length)`` of the file bytes that hold the ``leaves`` column chunks of one
    row group: where Arrow's reader reads them from (the dictionary page first, if any)."""
    start, end = None, 0
    for i in leaves:
        column = row_group.column(i)
        first = column.data_page_offset
        dictionary = column.dictionary_page_offset
        if column.has_dictionary_page and dictionary is not None and 0 < dictionary < first:
            first = dictionary
        start = first if start is None else min(start, first)
        end = max(end, first + column.total_compressed_size)
    assert start is not None, "a payload has at least one leaf"
    return start, end - start
