"""The rows of a Parquet source as a :class:`~batchd_server.workers.rows.RowReader`.

A dataset ingested from Parquet has catalog rows whose ``row_groups`` is a row group of the
file (its ``byte_offsets``/``byte_lengths`` that group's payload chunk) and ``row_indexes``
the row in it; :class:`~batchd_server.parquet.rows.ParquetRows` serves their values. Rows of
the same source that are not Parquet rows (``row_groups`` -1) are byte ranges, served by the
:class:`~batchd_server.workers.rows.RangeRows` it wraps.
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt

from batchd_server.catalog.types import SampleColumns
from batchd_server.parquet.rows import ParquetRows
from batchd_server.pipelines.base import BadSample
from batchd_server.workers.rows import Gathered, Positions, RangeRows, ranges_of, sample_path

__all__ = ["ParquetRowReader"]


class ParquetRowReader:
    """A source's rows where some are rows of Parquet files (see the module docs)."""

    def __init__(self, parquet: ParquetRows | None, ranges: RangeRows) -> None:
        self._rows = parquet
        """None: the dataset names no payload column (its Parquet rows cannot be served)."""
        self.ranges = ranges
        self.columns: SampleColumns = ranges.columns

    @property
    def parquet(self) -> ParquetRows:
        if self._rows is None:
            raise BadSample(
                "corrupt",
                "a Parquet row of a dataset that names no payload column; re-ingest it with "
                "batchd-server ingest parquet",
            )
        return self._rows

    def describe(self, position: int) -> str:
        row_group = int(self.columns.row_groups[position])
        if row_group < 0:
            return self.ranges.describe(position)
        row = int(self.columns.row_indexes[position])
        return f"{sample_path(self.columns, position)} (row group {row_group}, row {row})"

    def read(self, position: int) -> memoryview:
        columns = self.columns
        row_group = int(columns.row_groups[position])
        if row_group < 0:
            return self.ranges.read(position)
        offset, length = int(columns.byte_offsets[position]), int(columns.byte_lengths[position])
        row = int(columns.row_indexes[position])
        path = sample_path(columns, position)
        return self.parquet.value(path, row_group, row, offset, length)[0]

    def numeric(self, position: int) -> bool:
        if self.columns.row_groups[position] < 0:
            return False
        return self.parquet.numeric(sample_path(self.columns, position))

    def read_batch(self, positions: Positions) -> Gathered | None:
        columns = self.columns
        groups = columns.row_groups[positions]
        if groups.max() < 0:
            return self.ranges.read_batch(positions)
        if groups.min() < 0 or self._rows is None:
            return None
        chunks = ranges_of(
            columns, positions, columns.byte_offsets[positions], columns.byte_lengths[positions]
        )
        self.parquet.load(chunks, groups)
        return self.parquet.gather(chunks, groups, columns.row_indexes[positions])

    def read_ahead(self, positions: Positions, *, together: bool, decoded_cached: bool) -> None:
        columns = self.columns
        in_parquet = columns.row_groups[positions] >= 0
        self.ranges.read_ahead(
            positions[~in_parquet], together=together, decoded_cached=decoded_cached
        )
        rows = positions[in_parquet]
        if not together or rows.size < 2 or self._rows is None:
            return
        chunks = ranges_of(columns, rows, columns.byte_offsets[rows], columns.byte_lengths[rows])
        self.parquet.load(
            chunks, columns.row_groups[rows], None if decoded_cached else columns.row_indexes[rows]
        )

    def read_part(self, position: int, first: int, count: int) -> memoryview:
        if self.columns.row_groups[position] < 0:
            return self.ranges.read_part(position, first, count)
        return self.read(position)[first : first + count]

    def read_parts(
        self, positions: Positions, firsts: Positions, counts: Positions
    ) -> tuple[npt.NDArray[np.uint8], npt.NDArray[np.int64]] | None:
        if self.columns.row_groups[positions].max() >= 0:  # Parquet rows: piece by piece
            return None
        return self.ranges.read_parts(positions, firsts, counts)

    def begin_batch(self) -> None:
        self.ranges.begin_batch()
        if self._rows is not None:
            self._rows.begin_batch()

    def close(self) -> None:
        if self._rows is not None:
            self._rows.close()
        self.ranges.close()
