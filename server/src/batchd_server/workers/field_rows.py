"""The rows of one field of a sample of several fields (``pipelines/fields.py``), as
:class:`~batchd_server.workers.rows.RowReader` values.

- :class:`MemberRows`: a tar member of each sample's key, by extension. The catalog load
  puts every member's byte range in the source's arrays (``member.<ext>.offset`` /
  ``.length``, -1 where a sample has none: ``catalog/members.py``), so a field's rows are
  :class:`~batchd_server.workers.rows.RangeRows` over those ranges: read a batch at once,
  fetched ahead, through the node cache, as the one-field path reads its payload.
- :class:`ColumnRows`: a column of each sample's Parquet row. The catalog holds the payload
  column's chunk per row group; another column's chunk is read off the file's footer once
  per row group (``ParquetRows.chunk_of``).

A sample without the field is a bad sample of kind ``missing_field`` (an optional field's
absence is handled by the fill, which zeroes its rows).
"""

from __future__ import annotations

import dataclasses

import numpy as np
import numpy.typing as npt

from batchd_server.catalog.types import SampleColumns
from batchd_server.parquet.rows import ParquetRows
from batchd_server.pipelines.base import BadSample
from batchd_server.storage.reader import SampleReader
from batchd_server.workers.parquet_rows import ParquetRowReader
from batchd_server.workers.rows import (
    Gathered,
    Positions,
    RangeRows,
    paths_of,
    ranges_of,
    sample_path,
)

__all__ = ["ColumnRows", "MemberRows", "member_columns"]


def member_columns(
    columns: SampleColumns, offsets: npt.NDArray[np.int64], lengths: npt.NDArray[np.int64]
) -> SampleColumns:
    """``columns`` with each sample's byte range that of one of its members."""
    return dataclasses.replace(columns, byte_offsets=offsets, byte_lengths=lengths)


class MemberRows(RangeRows):
    """Each sample's tar member of one extension (see the module docs)."""

    def __init__(self, reader: SampleReader, columns: SampleColumns, field: str, ext: str) -> None:
        super().__init__(reader, columns)
        self.field = field
        self.ext = ext

    def _check(self, position: int) -> None:
        if self.columns.byte_lengths[position] < 0:
            raise BadSample(
                "missing_field",
                f"{sample_path(self.columns, position)}: the sample has no .{self.ext} member "
                f"for its field {self.field!r}; add it to the shard, or declare the field "
                "optional",
            )

    def read(self, position: int) -> memoryview:
        self._check(position)
        return super().read(position)

    def read_batch(self, positions: Positions) -> Gathered | None:
        if self.columns.byte_lengths[positions].min() < 0:
            return None
        return super().read_batch(positions)

    def read_ahead(self, positions: Positions, *, together: bool, decoded_cached: bool) -> None:
        present = positions[self.columns.byte_lengths[positions] >= 0]
        super().read_ahead(present, together=together, decoded_cached=decoded_cached)

    def read_part(self, position: int, first: int, count: int) -> memoryview:
        self._check(position)
        return super().read_part(position, first, count)


class ColumnRows(ParquetRowReader):
    """Each sample's value of one Parquet column (see the module docs)."""

    def __init__(self, parquet: ParquetRows, ranges: RangeRows, field: str) -> None:
        super().__init__(parquet, ranges)
        self.field = field
        self._chunks: dict[tuple[str, int], tuple[int, int]] = {}

    def _chunk(self, path: str, row_group: int) -> tuple[int, int]:
        key = (path, row_group)
        found = self._chunks.get(key)
        if found is None:
            found = self._chunks[key] = self.parquet.chunk_of(path, row_group)
        return found

    def range_of(self, position: int) -> tuple[int, int]:
        """Row ``position``'s chunk of this column (the sample's own range if not a Parquet
        row).

        Raises:
            BadSample: the file cannot tell (see ``ParquetRows.chunk_of``).
        """
        columns = self.columns
        row_group = int(columns.row_groups[position])
        if row_group < 0:
            return int(columns.byte_offsets[position]), int(columns.byte_lengths[position])
        return self._chunk(sample_path(columns, position), row_group)

    def _missing(self, e: BadSample, position: int) -> BadSample:
        if e.kind != "missing":
            return e
        return BadSample(
            "missing_field",
            f"{self.describe(position)}: column {self.parquet.column!r} of its field "
            f"{self.field!r} is null; fill it, or declare the field optional",
        )

    def read(self, position: int) -> memoryview:
        columns = self.columns
        row_group = int(columns.row_groups[position])
        if row_group < 0:
            return self.ranges.read(position)
        path = sample_path(columns, position)
        try:
            offset, length = self._chunk(path, row_group)
            row = int(columns.row_indexes[position])
            return self.parquet.value(path, row_group, row, offset, length)[0]
        except BadSample as e:
            raise self._missing(e, position) from e

    def _ranges(self, positions: Positions) -> tuple[npt.NDArray[np.int64], npt.NDArray[np.int64]]:
        paths, files = paths_of(self.columns, positions)
        groups = self.columns.row_groups[positions]
        offsets = np.empty(positions.size, np.int64)
        lengths = np.empty(positions.size, np.int64)
        pairs, inverse = np.unique(
            np.stack([files.astype(np.int64), groups.astype(np.int64)]), axis=1, return_inverse=True
        )
        for i, (f, g) in enumerate(pairs.T.tolist()):
            offset, length = self._chunk(paths[f], g)
            mine = inverse.reshape(-1) == i
            offsets[mine], lengths[mine] = offset, length
        return offsets, lengths

    def read_batch(self, positions: Positions) -> Gathered | None:
        columns = self.columns
        groups = columns.row_groups[positions]
        if groups.min() < 0:
            return None
        try:
            offsets, lengths = self._ranges(positions)
        except BadSample:
            return None
        chunks = ranges_of(columns, positions, offsets, lengths)
        self.parquet.load(chunks, groups)
        return self.parquet.gather(chunks, groups, columns.row_indexes[positions])

    def read_ahead(self, positions: Positions, *, together: bool, decoded_cached: bool) -> None:
        return  # the rows are read a batch at once (read_batch) or one by one

    def read_part(self, position: int, first: int, count: int) -> memoryview:
        return self.read(position)[first : first + count]

    def read_parts(
        self, positions: Positions, firsts: Positions, counts: Positions
    ) -> tuple[npt.NDArray[np.uint8], npt.NDArray[np.int64]] | None:
        return None
