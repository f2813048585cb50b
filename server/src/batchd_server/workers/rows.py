"""Where a source's rows come from in a worker: one interface, :class:`RowReader`.

A worker fills a batch from the rows of each source; what a row's bytes are depends on how
the dataset was ingested: a byte range of a file, a tar member or an object (:class:`RangeRows`,
over the source's :class:`~batchd_server.storage.reader.SampleReader`), or a row of a Parquet
file (``workers/parquet_rows.py``). The fill (``workers/context.py``, ``workers/packed.py``)
asks only this interface; a new kind of row is one more implementation, picked where a
source is opened (``workers/fields.py``).

Positions here are a source's own rows (its catalog columns' indices).
"""

from __future__ import annotations

from typing import Any, Protocol

import numpy as np
import numpy.typing as npt

from batchd_server.catalog.types import SampleColumns
from batchd_server.pipelines.base import BadSample
from batchd_server.storage.ranges import Ranges
from batchd_server.storage.reader import SampleReader

__all__ = [
    "Gathered",
    "Positions",
    "RangeRows",
    "RowReader",
    "paths_of",
    "ranges_of",
    "sample_path",
]

Positions = npt.NDArray[np.int64]
Gathered = tuple[npt.NDArray[np.uint8], npt.NDArray[np.int64], npt.NDArray[np.int64], bool]
"""Many rows' bytes at once: ``(data, starts, lengths, numbers)``: row ``i`` is
``data[starts[i]:starts[i] + lengths[i]]``; ``numbers``: they are raw numbers of the
pipeline's dtype (a Parquet list), not the bytes of a file."""


class RowReader(Protocol):
    """A source's rows as bytes, one at a time or a batch at once."""

    def describe(self, position: int) -> str:
        """Row ``position`` for messages (its path, and its place in the path)."""
        ...

    def read(self, position: int) -> memoryview:
        """Row ``position``'s bytes.

        Raises:
            BadSample: it cannot be read, saying why.
        """
        ...

    def numeric(self, position: int) -> bool:
        """Whether row ``position``'s bytes are raw numbers (see :data:`Gathered`).

        Raises:
            BadSample: as :meth:`read`.
        """
        ...

    def read_batch(self, positions: Positions) -> Gathered | None:
        """Every row's bytes at once, for a pipeline's ``decode_batch``; None when a row is
        not right or the run does not qualify: read them one by one, which says which."""
        ...

    def read_ahead(self, positions: Positions, *, together: bool, decoded_cached: bool) -> None:
        """Fetch what these rows read before they are read one by one: whole objects ahead,
        and (``together``: not a redo looking for the row that hangs) a batch's byte ranges
        or row groups at once; not the bytes of rows whose decodes may come from the decode
        cache (``decoded_cached``). Failures are left for :meth:`read` to report."""
        ...

    def read_part(self, position: int, first: int, count: int) -> memoryview:
        """Bytes ``[first, first + count)`` of row ``position`` (a packed piece of a document:
        never the whole document).

        Raises:
            BadSample: as :meth:`read`, or kind ``shape`` when the row is shorter.
        """
        ...

    def read_parts(
        self, positions: Positions, firsts: Positions, counts: Positions
    ) -> tuple[npt.NDArray[np.uint8], npt.NDArray[np.int64]] | None:
        """:meth:`read_part` of many rows at once: ``(data, starts)``, part ``i`` at
        ``data[starts[i]:starts[i] + counts[i]]``; None as :meth:`read_batch`."""
        ...

    def begin_batch(self) -> None: ...

    def close(self) -> None: ...


def sample_path(columns: SampleColumns, position: int) -> str:
    """Row ``position``'s path, relative to its dataset's root."""
    start, end = columns.path_offsets[position], columns.path_offsets[position + 1]
    return columns.path_bytes[start:end].tobytes().decode("utf-8", "replace")


def paths_of(columns: SampleColumns, positions: Positions) -> tuple[list[str], npt.NDArray[Any]]:
    """The distinct paths of the rows at ``positions``, and each row's index in them."""
    raw = columns.path_bytes
    starts = columns.path_offsets[positions]
    ends = columns.path_offsets[positions + 1]
    width = int(ends[0] - starts[0])
    if width and (ends - starts == width).all():  # the usual run: one shard for all
        names = raw[starts[:, None] + np.arange(width)]
        if (names == names[0]).all():
            return [sample_path(columns, int(positions[0]))], np.zeros(len(positions), np.intp)
        # Files of one naming pattern (part-0000.parquet, ...): one vectorised unique.
        distinct, files = np.unique(
            np.ascontiguousarray(names).view(np.dtype((np.void, width))).reshape(-1),
            return_inverse=True,
        )
        paths = [d.tobytes().decode("utf-8", "replace") for d in distinct]
        return paths, files.astype(np.intp).reshape(-1)
    seen: dict[bytes, int] = {}
    files = np.fromiter(
        (
            seen.setdefault(raw[a:b].tobytes(), len(seen))
            for a, b in zip(starts.tolist(), ends.tolist(), strict=True)
        ),
        np.intp,
        len(positions),
    )
    return [k.decode("utf-8", "replace") for k in seen], files


def ranges_of(
    columns: SampleColumns, positions: Positions, offsets: Positions, lengths: Positions
) -> Ranges:
    """The byte ranges ``offsets``, ``lengths`` of the rows at ``positions``' paths."""
    paths, files = paths_of(columns, positions)
    return Ranges(paths, files, offsets, lengths)


class RangeRows:
    """Rows that are byte ranges of files or objects (a whole file: offset and length -1; a
    record or tar member: its range), read through the source's reader."""

    def __init__(self, reader: SampleReader, columns: SampleColumns) -> None:
        self.reader = reader
        self.columns = columns

    def describe(self, position: int) -> str:
        return sample_path(self.columns, position)

    def read(self, position: int) -> memoryview:
        columns = self.columns
        offset, length = int(columns.byte_offsets[position]), int(columns.byte_lengths[position])
        return self.reader.read(sample_path(columns, position), offset, length)

    def numeric(self, position: int) -> bool:
        return False

    def read_batch(self, positions: Positions) -> Gathered | None:
        offsets = self.columns.byte_offsets[positions]
        lengths = self.columns.byte_lengths[positions]
        if offsets.min() < 0 or lengths.min() < 0:  # whole files, or "to the end"
            return None
        try:
            data, starts = self.reader.read_ranges(
                ranges_of(self.columns, positions, offsets, lengths)
            )
        except BadSample:
            return None
        return data, starts, lengths, False

    def read_ahead(self, positions: Positions, *, together: bool, decoded_cached: bool) -> None:
        reader = self.reader
        if not reader.fetches_ahead or not positions.size:
            return
        columns = self.columns
        offsets = columns.byte_offsets[positions]
        # Whole objects (image files) are fetched ahead, several at once, while the first
        # ones decode: one round trip per sample would bound the worker's rate.
        whole = positions[offsets < 0]
        if whole.size:
            reader.prefetch([sample_path(columns, int(p)) for p in whole.tolist()])
        if not together or decoded_cached:
            return
        # Byte ranges inside objects, such as tar members: several objects at once and
        # each block once, not one round trip per sample.
        lengths = columns.byte_lengths[positions]
        ranged = (offsets >= 0) & (lengths >= 0)
        if int(ranged.sum()) >= 2:
            rows = positions[ranged]
            reader.stage(ranges_of(columns, rows, offsets[ranged], lengths[ranged]))

    def read_part(self, position: int, first: int, count: int) -> memoryview:
        columns = self.columns
        offset, length = int(columns.byte_offsets[position]), int(columns.byte_lengths[position])
        path = sample_path(columns, position)
        if offset >= 0 and 0 <= length < first + count:
            raise BadSample(
                "shape",
                f"{path}: its record has {length} bytes, the catalog's length says at least "
                f"{first + count}; fix the length column",
            )
        return self.reader.read(path, max(offset, 0) + first, count)

    def read_parts(
        self, positions: Positions, firsts: Positions, counts: Positions
    ) -> tuple[npt.NDArray[np.uint8], npt.NDArray[np.int64]] | None:
        offsets = self.columns.byte_offsets[positions]
        lengths = self.columns.byte_lengths[positions]
        if offsets.min() < 0 or (lengths < firsts + counts).any():
            return None
        try:
            return self.reader.read_ranges(
                ranges_of(self.columns, positions, offsets + firsts, counts)
            )
        except BadSample:
            return None

    def begin_batch(self) -> None:
        self.reader.begin_batch()

    def close(self) -> None:
        self.reader.close()
