"""A row group's payload values, decoded by pyarrow, as one buffer of bytes and each row's
start in it: what :class:`~batchd_server.parquet.rows.ParquetRows` serves rows from.

Binary values are kept as they are; numbers (a list, a fixed-size list) are converted once to
the dtype the pipeline wants. A row that cannot be served (null, a number that does not fit)
is recorded with the kind of bad sample it is. A binary column read with its dictionary
(:func:`expanded_bytes`) is measured before its values are written out.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt
import pyarrow as pa

from batchd_server.parquet.payload import Payload

__all__ = ["Group", "decode", "expanded_bytes", "leaves"]


@dataclass(frozen=True)
class Group:
    """One row group's payload values: row ``i`` is ``data[starts[i]:starts[i + 1]]``."""

    data: npt.NDArray[np.uint8]
    starts: npt.NDArray[np.int64]
    bad: dict[int, tuple[str, str]]
    """Rows that cannot be served: (BadSample kind, why)."""
    numeric: bool

    @property
    def nbytes(self) -> int:
        return int(self.data.nbytes + self.starts.nbytes)


def leaves(column: pa.ChunkedArray, payload: Payload) -> list[pa.Array]:
    """The payload's values in each chunk of its top-level ``column``."""
    return [_leaf(chunk, payload.names[1:]) for chunk in column.chunks]


def expanded_bytes(parts: list[pa.Array]) -> int:
    """The bytes of dictionary-encoded binary ``parts`` once every row's entry is written
    out (nulls: none), computed from the dictionaries and indices alone."""
    total = 0
    for part in parts:
        if not pa.types.is_dictionary(part.type):
            total += _bytes_of(part.buffers()[-1]).nbytes
            continue
        entries = part.dictionary
        starts = np.frombuffer(entries.buffers()[1], _offset_type(entries.type))
        starts = starts[entries.offset : entries.offset + len(entries) + 1].astype(np.int64)
        indices = part.indices.fill_null(0).to_numpy(zero_copy_only=False).astype(np.intp)
        sizes = np.diff(starts)[indices] if len(entries) else np.zeros(len(part), np.int64)
        if part.null_count:
            sizes = sizes * part.is_valid().to_numpy(zero_copy_only=False)
        total += int(sizes.sum())
    return total


def _offset_type(t: pa.DataType) -> type[np.int32] | type[np.int64]:
    return np.int64 if pa.types.is_large_binary(t) or pa.types.is_large_string(t) else np.int32


def decode(parts: list[pa.Array], payload: Payload, target: np.dtype[Any] | None) -> Group:
    """A row group's payload values (``parts``: of each chunk, :func:`leaves`), joined, as
    bytes and row starts; dictionary-encoded parts are written out."""
    parts = [p.dictionary_decode() if pa.types.is_dictionary(p.type) else p for p in parts]
    datas: list[npt.NDArray[np.uint8]] = []
    starts_list = [np.zeros(1, np.int64)]
    bad: dict[int, tuple[str, str]] = {}
    base_row = base_byte = 0
    numeric = payload.kind != "binary"
    for array in parts:
        if numeric:
            data, starts, problems = _numbers(array, payload, target)
        else:
            data, starts, problems = _binary(array)
        first, last = int(starts[0]), int(starts[-1])
        datas.append(data[first:last])
        starts_list.append(starts[1:] - first + base_byte)
        bad.update((base_row + row, why) for row, why in problems.items())
        base_row += len(array)
        base_byte += last - first
    joined = datas[0] if len(datas) == 1 else np.concatenate([np.zeros(0, np.uint8), *datas])
    return Group(joined, np.concatenate(starts_list), bad, numeric)


def _leaf(array: pa.Array, names: tuple[str, ...]) -> pa.Array:
    """The field ``names`` of struct ``array``, with the structs' nulls as its own."""
    for name in names:
        array = array.flatten()[array.type.get_field_index(name)]
    return array


def _nulls(array: pa.Array) -> dict[int, tuple[str, str]]:
    if array.null_count == 0:
        return {}
    rows = np.flatnonzero(~array.is_valid().to_numpy(zero_copy_only=False))
    return {int(r): ("missing", "the payload is null in this row") for r in rows}


def _binary(
    array: pa.Array,
) -> tuple[npt.NDArray[np.uint8], npt.NDArray[np.int64], dict[int, tuple[str, str]]]:
    n = len(array)
    buffers = array.buffers()
    if pa.types.is_fixed_size_binary(array.type):
        width = array.type.byte_width
        data = _bytes_of(buffers[1])
        starts = (np.arange(n + 1, dtype=np.int64) + array.offset) * width
    else:
        large = pa.types.is_large_binary(array.type) or pa.types.is_large_string(array.type)
        dtype = np.int64 if large else np.int32
        offsets = np.frombuffer(buffers[1], dtype)[array.offset : array.offset + n + 1]
        starts = offsets.astype(np.int64)
        data = _bytes_of(buffers[2])
    return data, starts, _nulls(array)


def _bytes_of(buffer: pa.Buffer | None) -> npt.NDArray[np.uint8]:
    return np.zeros(0, np.uint8) if buffer is None else np.frombuffer(buffer, np.uint8)


def _numbers(
    array: pa.Array, payload: Payload, target: np.dtype[Any] | None
) -> tuple[npt.NDArray[np.uint8], npt.NDArray[np.int64], dict[int, tuple[str, str]]]:
    n = len(array)
    bad = _nulls(array)
    if payload.kind == "list":
        offsets = array.offsets.to_numpy().astype(np.int64)
        values = array.values
    else:
        values = array
        while pa.types.is_fixed_size_list(values.type):
            values = values.flatten()
        offsets = np.arange(n + 1, dtype=np.int64) * payload.width
        if len(values) != n * payload.width:  # flatten() of null rows keeps their slots
            return (
                np.zeros(0, np.uint8),
                np.zeros(n + 1, np.int64),
                {
                    r: ("corrupt", "the fixed-size list's values are not where they should be")
                    for r in range(n)
                },
            )
    numbers = values.to_numpy(zero_copy_only=False)
    if values.null_count:
        holes = np.flatnonzero(~values.is_valid().to_numpy(zero_copy_only=False))
        for r in np.unique(np.searchsorted(offsets, holes, side="right") - 1).tolist():
            bad.setdefault(int(r), ("corrupt", "a number in this row is null"))
    dtype = target if target is not None else numbers.dtype.newbyteorder("<")
    converted = numbers.astype(dtype)
    if not np.can_cast(numbers.dtype, dtype, "safe") and dtype.kind in "iub":
        off = np.flatnonzero(converted.astype(numbers.dtype) != numbers)
        if values.null_count:
            off = off[values.is_valid().to_numpy(zero_copy_only=False)[off]]
        for i in off.tolist():
            r = int(np.searchsorted(offsets, i, side="right") - 1)
            bad.setdefault(r, ("shape", f"{numbers[i]} does not fit the pipeline's {dtype.name}"))
    itemsize = dtype.itemsize
    return converted.view(np.uint8).reshape(-1), offsets * itemsize, bad
