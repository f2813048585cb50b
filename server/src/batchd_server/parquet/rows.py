"""A worker's side of Parquet: read a row group's payloads once, serve its rows as bytes.

Every byte comes through the source's :class:`~batchd_server.storage.reader.SampleReader`
(``size(path)`` and ranged ``read(path, offset, length)``), so the node cache and an
object store see plain ranged reads:

1. **Footer, once per file per worker.** The last 8 bytes give the footer's length, one
   more ranged read fetches it; the parsed ``FileMetaData`` and the payload column's place
   in it are kept (:data:`_MAX_FILES` files, least recently used out).
2. **The payload's column chunk, once per row group.** The catalog row's byte range is that
   chunk (``payload.chunk_range``): one ranged read fetches it, and pyarrow decodes it,
   given the cached metadata, from a file object that serves those bytes (anything else
   it asks for, which pyarrow's own reader never does for these columns, is read through the
   reader too). The decoded values are kept while the batch lasts and after it, up to
   :data:`_DECODED_CACHE_BYTES`, so the other rows of a row group in this batch or the next
   cost a slice, not a read and a decode.
3. **A row's value** is handed to the pipeline as bytes, as if it were a file: binary
   values as they are; numbers (a list, a fixed-size list) as raw little-endian numbers of
   the dtype the pipeline wants (``target``), converted once per row group. A null row, or a
   number that does not fit the wanted dtype, is a bad sample like any other.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Final

import numpy as np
import numpy.typing as npt
import pyarrow as pa
import pyarrow.parquet as pq

from batchd_server.errors import DataError
from batchd_server.limits import MAX_SAMPLE_BYTES
from batchd_server.parquet.budget import footer_bound, pages_bound
from batchd_server.parquet.pages import (
    NotPlain,
    RowPlaces,
    gather_in_place,
    places_of_rows,
    plain_places,
)
from batchd_server.parquet.payload import Payload, chunk_range, resolve_payload
from batchd_server.parquet.values import Group, decode, expanded_bytes, leaves
from batchd_server.pipelines.base import BadSample
from batchd_server.pipelines.ranges import take_ranges
from batchd_server.shm.space import format_bytes
from batchd_server.storage.ranges import Ranges
from batchd_server.storage.reader import MAX_SAMPLE_HINT, SampleReader
from batchd_server.storage.seekable import SeekableBytes

__all__ = ["ParquetRows"]

_MAGIC: Final = b"PAR1"
_MAX_FILES: Final = 64
"""Footers kept per source in a worker."""
_DECODED_CACHE_BYTES: Final = 256 << 20
"""Decoded row groups kept beyond the current batch's, per source."""
_MAX_PLACES: Final = 1 << 16
"""Row groups whose rows' places in their file are kept, per source."""


@dataclass(frozen=True)
class _File:
    size: int
    metadata: pq.FileMetaData
    payload: Payload
    reader: pq.ParquetFile
    window: _Window


class _Window(SeekableBytes):
    """A read-only file of ``size`` bytes whose bytes at ``start`` are ``data``; a read
    elsewhere goes through the sample reader."""

    def __init__(self, files: SampleReader, path: str, size: int) -> None:
        super().__init__(path, size)
        self._files, self._path = files, path
        self.start = 0
        self.data: bytes | memoryview = b""

    def read(self, size: int = -1) -> bytes | memoryview:
        start = self._at
        end = self._size if size < 0 else min(self._size, start + size)
        self._at = max(start, end)
        if end <= start:
            return b""
        first = start - self.start
        if first >= 0 and end - self.start <= len(self.data):
            if first == 0 and end - start == len(self.data):
                return self.data
            return self.data[first : end - self.start]
        return bytes(self._files.read(self._path, start, end - start))

    def readinto(self, buffer: Any) -> int:
        got = self.read(len(buffer))
        buffer[: len(got)] = got
        return len(got)


class ParquetRows:
    """Serves Parquet rows of one source in a worker (see the module docs).

    Args:
        files: The source's sample reader.
        column: The dataset's payload column (``image.bytes``).
        target: The numpy dtype numeric payloads are handed over in; None keeps the
            column's own (little-endian).
        max_bytes: The most bytes a row group's payload may take decoded (the server's
            ``--max-sample-bytes``); a row group that may take more, by its footer or its
            page headers (``budget.py``), is not decoded: its rows are ``too_large``.
    """

    def __init__(
        self,
        files: SampleReader,
        column: str,
        target: np.dtype[Any] | None,
        max_bytes: int = MAX_SAMPLE_BYTES,
    ) -> None:
        self.files = files
        self.column = column
        self.target = target
        self.max_bytes = max_bytes
        self._own_memory = files.fresh_buffers
        """Whether the reader's answers are memory of their own (an object store's) that a
        chunk may view, rather than a buffer its next read reuses (a local file's)."""
        self._in_place = self._own_memory and files.cached
        """Whether rows of plainly stored binary chunks are read where they lie (through the
        node cache, where a small read is a file read) rather than decoded with their row
        group (``parquet/pages.py``)."""
        self._places: OrderedDict[tuple[str, int], RowPlaces | None] = OrderedDict()
        """(path, row group) -> its rows' places; None: the chunk is not stored plainly."""
        self._files: OrderedDict[str, _File] = OrderedDict()
        self._groups: OrderedDict[tuple[str, int], tuple[Group, int]] = OrderedDict()
        """(path, row group) -> (decoded values, the batch it was last used in)."""
        self._bytes = 0
        self._batch = 0

    def begin_batch(self) -> None:
        """A new batch begins: row groups of earlier batches may be dropped from now on."""
        self._batch += 1

    def close(self) -> None:
        self._files.clear()
        self._places.clear()
        self._groups.clear()
        self._bytes = 0

    def value(
        self, path: str, row_group: int, row: int, offset: int, length: int
    ) -> tuple[memoryview, bool]:
        """Row ``row`` of ``row_group`` of ``path`` as bytes, and whether they are numbers
        (raw, of ``target``'s dtype or the column's own). ``offset``/``length`` are the
        catalog's byte range of the row group's payload chunk.

        Raises:
            BadSample: the file is missing or not Parquet, the row is past the file's rows,
                the file changed since it was cataloged, or the row's value is null or does
                not fit ``target``.
        """
        places = self._row_places(path, row_group, offset, length)
        if places is not None:
            if not 0 <= row < len(places.offset):
                raise _no_row(path, row_group, len(places.offset), row)
            if places.offset[row] < 0:
                raise BadSample(
                    "missing",
                    f"{path} (row group {row_group}, row {row}): the payload is null in this row",
                )
            return self.files.read(path, int(places.offset[row]), int(places.length[row])), False
        group = self._group(path, row_group, offset, length)
        if not 0 <= row < len(group.starts) - 1:
            raise _no_row(path, row_group, len(group.starts) - 1, row)
        problem = group.bad.get(row)
        if problem is not None:
            raise BadSample(problem[0], f"{path} (row group {row_group}, row {row}): {problem[1]}")
        start, end = int(group.starts[row]), int(group.starts[row + 1])
        return group.data[start:end].data, group.numeric

    def chunk_of(self, path: str, row_group: int) -> tuple[int, int]:
        """The byte range of ``row_group``'s chunk of this column in ``path``, by its footer
        (for a column the catalog does not hold the chunks of: another field's).

        Raises:
            BadSample: As :meth:`value`, for the file or a row group it does not have.
        """
        file = self._file(path)
        if not 0 <= row_group < file.metadata.num_row_groups:
            raise BadSample(
                "corrupt",
                f"{path}: has {file.metadata.num_row_groups} row groups, not a row group "
                f"{row_group}: the file changed since it was ingested; re-ingest it",
            )
        return chunk_range(file.metadata.row_group(row_group), file.payload.leaves)

    def numeric(self, path: str) -> bool:
        """Whether the payload of ``path`` is numbers (a list or fixed-size list), not bytes.

        Raises:
            BadSample: As :meth:`value`, for the file.
        """
        return self._file(path).payload.kind != "binary"

    def load(
        self,
        chunks: Ranges,
        row_groups: npt.NDArray[np.int32],
        rows: npt.NDArray[np.int32] | None = None,
    ) -> None:
        """Read the payload chunks of a batch's row groups that are not decoded yet in one
        ``read_ranges`` (on an object store: several objects' GETs in flight at once, not
        one round trip per row group as the rows ask), and decode each; rows read in place
        (``pages.py``) are instead read together, when ``rows`` are given, for
        :meth:`value` to serve. Arguments as :meth:`gather`. What fails here is left for
        :meth:`value` and :meth:`gather` to meet again and report, row by row."""
        paths, files, offsets, lengths = chunks.paths, chunks.files, chunks.offsets, chunks.lengths
        keys = files.astype(np.int64) << 32 | row_groups.astype(np.int64)
        distinct, first = np.unique(keys, return_index=True)
        todo = [
            int(i)
            for key, i in zip(distinct.tolist(), first.tolist(), strict=True)
            if (paths[key >> 32], key & 0xFFFFFFFF) not in self._groups
        ]
        if self._in_place and todo:
            todo = self._place(chunks, row_groups, todo)
            if rows is not None and not todo:  # all in place: read together, as tar members
                found = places_of_rows(self._row_places, chunks, row_groups, rows)
                if found is not None:
                    at, size = found
                    kept = at >= 0
                    self.files.stage(Ranges(paths, files[kept], at[kept], size[kept]))
        if len(todo) < 2:
            return
        try:
            for name in {paths[int(files[i])] for i in todo}:
                self._file(name)
        except BadSample:
            return
        todo = [i for i in todo if self._fits(paths[int(files[i])], int(row_groups[i]))]
        if len(todo) < 2:
            return
        chosen = np.array(todo, np.intp)
        try:
            data, starts = self.files.read_ranges(chunks.take(chosen))
        except BadSample:
            return
        # A local reader's ``data`` is its buffer until its next read: chunks are copied.
        own = self._own_memory
        fetched = [
            data[int(a) : int(a) + int(n)].data if own else bytes(data[int(a) : int(a) + int(n)])
            for a, n in zip(starts.tolist(), lengths[chosen].tolist(), strict=True)
        ]
        for i, chunk in zip(todo, fetched, strict=True):
            path, group = paths[int(files[i])], int(row_groups[i])
            try:
                self._group(path, group, int(offsets[i]), int(lengths[i]), chunk)
            except BadSample:
                continue

    def gather(
        self, chunks: Ranges, row_groups: npt.NDArray[np.int32], rows: npt.NDArray[np.int32]
    ) -> tuple[npt.NDArray[np.uint8], npt.NDArray[np.int64], npt.NDArray[np.int64], bool] | None:
        """The values of many rows at once, for a pipeline's ``decode_batch``: sample ``i``
        is row ``rows[i]`` of ``row_groups[i]`` of ``chunks.paths[chunks.files[i]]``
        (``chunks``: the catalog's byte ranges of each row's payload chunk, as for
        :meth:`value`).

        Returns:
            ``(data, starts, lengths, numbers)``: sample ``i``'s bytes are
            ``data[starts[i]:starts[i] + lengths[i]]``, a copy of the rows' values alone. None
            when a row group cannot be read or a row is bad: serve them one by one with
            :meth:`value`, which says what is wrong with which.
        """
        if self._in_place:
            try:
                return gather_in_place(
                    self._row_places, self.files.read_ranges, chunks, row_groups, rows
                )
            except NotPlain:
                pass  # some row groups are decoded
        paths, files, offsets, lengths = chunks.paths, chunks.files, chunks.offsets, chunks.lengths
        n = len(rows)
        keys = files.astype(np.int64) << 32 | row_groups.astype(np.int64)
        distinct, which = np.unique(keys, return_inverse=True)
        order = np.argsort(which, kind="stable")
        bounds = np.searchsorted(which[order], np.arange(len(distinct) + 1))
        begins = np.empty(n, np.int64)
        sizes = np.empty(n, np.int64)
        pieces: list[tuple[npt.NDArray[np.uint8], npt.NDArray[np.intp]]] = []
        numbers = False
        for k, key in enumerate(distinct.tolist()):
            members = order[bounds[k] : bounds[k + 1]]
            first = int(members[0])
            try:
                group = self._group(
                    paths[key >> 32], key & 0xFFFFFFFF, int(offsets[first]), int(lengths[first])
                )
            except BadSample:
                return None
            wanted = rows[members].astype(np.int64)
            if wanted.min() < 0 or wanted.max() >= len(group.starts) - 1:
                return None
            if group.bad and not group.bad.keys().isdisjoint(wanted.tolist()):
                return None
            begins[members] = group.starts[wanted]
            sizes[members] = group.starts[wanted + 1] - begins[members]
            pieces.append((group.data, members))
            numbers = group.numeric
        starts = np.zeros(n, np.int64)
        np.cumsum(sizes[:-1], out=starts[1:])
        data = np.empty(int(starts[-1] + sizes[-1]) if n else 0, np.uint8)
        width = int(sizes[0]) if n else 0
        for source, members in pieces:
            if width and (sizes[members] == width).all():  # fixed-size values: one gather
                taken = take_ranges(source, begins[members], width).view(np.uint8)
                data[(starts[members, None] + np.arange(width)).reshape(-1)] = taken
                continue
            for row in members.tolist():
                a, size = int(begins[row]), int(sizes[row])
                data[starts[row] : starts[row] + size] = source[a : a + size]
        return data, starts, sizes, numbers

    def _place(
        self, chunks: Ranges, row_groups: npt.NDArray[np.int32], todo: list[int]
    ) -> list[int]:
        """Find the rows' places of the ``todo`` row groups (their chunks first brought into
        the node cache together); returns those that must be decoded instead."""
        paths, files, offsets, lengths = chunks.paths, chunks.files, chunks.offsets, chunks.lengths
        fresh = [i for i in todo if (paths[int(files[i])], int(row_groups[i])) not in self._places]
        if fresh:
            self.files.warm(chunks.take(np.array(fresh, np.intp)))
        rest = []
        for i in todo:
            try:
                places = self._row_places(
                    paths[int(files[i])], int(row_groups[i]), int(offsets[i]), int(lengths[i])
                )
            except BadSample:
                continue  # met again, and reported, by the rows
            if places is None:
                rest.append(i)
        return rest

    def _row_places(self, path: str, row_group: int, offset: int, length: int) -> RowPlaces | None:
        """Where the rows of a row group's payload lie in its file, or None when its chunk is
        not stored plainly (or places are not looked for: a local file, no node cache)."""
        if not self._in_place:
            return None
        key = (path, row_group)
        if key in self._places:
            self._places.move_to_end(key)
            return self._places[key]
        file = self._file(path)
        places: RowPlaces | None = None
        if file.payload.kind == "binary":
            self._check_group(file, path, row_group, offset, length)

            def read(at: int, count: int) -> bytes:
                return bytes(self.files.read(path, at, count))

            places = plain_places(
                file.metadata, file.payload.leaves, row_group, read, offset, length, self.max_bytes
            )
        self._places[key] = places
        if len(self._places) > _MAX_PLACES:
            self._places.popitem(last=False)
        return places

    def _check_group(
        self, file: _File, path: str, row_group: int, offset: int, length: int
    ) -> None:
        """The catalog's row group and byte range still match the file."""
        if not 0 <= row_group < file.metadata.num_row_groups:
            raise BadSample(
                "corrupt",
                f"{path}: has {file.metadata.num_row_groups} row groups, not a row group "
                f"{row_group}: the file changed since it was ingested; re-ingest it",
            )
        where = chunk_range(file.metadata.row_group(row_group), file.payload.leaves)
        if where != (offset, length):
            raise BadSample(
                "corrupt",
                f"{path}: row group {row_group}'s {self.column!r} is at bytes {where}, the "
                f"catalog says {(offset, length)}: the file changed since it was ingested; "
                "re-ingest it",
            )

    def _file(self, path: str) -> _File:
        found = self._files.get(path)
        if found is not None:
            self._files.move_to_end(path)
            return found
        size = self.files.size(path)
        if size < 12:
            raise BadSample("corrupt", f"{path}: {size} bytes is too short for a Parquet file")
        tail = bytes(self.files.read(path, size - 8, 8))
        footer_bytes = int.from_bytes(tail[:4], "little")
        if tail[4:] != _MAGIC or footer_bytes + 12 > size:
            raise BadSample("corrupt", f"{path}: not a Parquet file (no PAR1 footer)")
        footer = bytes(self.files.read(path, size - 8 - footer_bytes, footer_bytes + 8))
        window = _Window(self.files, path, size)
        try:
            metadata = pq.read_metadata(pa.BufferReader(footer))
            reader = pq.ParquetFile(window, metadata=metadata)
            payload = resolve_payload(reader, self.column, path)
        except DataError as e:
            raise BadSample("corrupt", f"{e}: the file changed since it was ingested") from e
        except (pa.ArrowException, OSError, ValueError) as e:
            raise BadSample("corrupt", f"{path}: unreadable Parquet footer ({e})") from e
        found = self._files[path] = _File(size, metadata, payload, reader, window)
        if len(self._files) > _MAX_FILES:
            self._files.popitem(last=False)
        return found

    def _group(
        self,
        path: str,
        row_group: int,
        offset: int,
        length: int,
        data: bytes | memoryview | None = None,
    ) -> Group:
        key = (path, row_group)
        cached = self._groups.get(key)
        if cached is not None:
            self._groups[key] = (cached[0], self._batch)
            self._groups.move_to_end(key)
            return cached[0]
        file = self._file(path)
        self._check_group(file, path, row_group, offset, length)
        where = f"{path}: row group {row_group}'s {self.column!r}"
        footer = footer_bound(file.metadata, file.payload.leaves, row_group)
        self._check_size(where, footer, "its footer")
        file.window.start = offset
        if data is None:
            data = self.files.read(path, offset, length)
            data = data if self._own_memory else bytes(data)
        chunk = data

        def read(at: int, count: int) -> bytes:
            first = max(0, at - offset)
            return bytes(chunk[first : first + count]) if at >= offset else b""

        bound = pages_bound(file.metadata, file.payload, row_group, read, where)
        self._check_size(where, bound.plain, "its page headers")
        repeated = bound.plain + bound.repeated > self.max_bytes
        file.window.data = data
        try:
            reader = file.reader
            if repeated:  # measure the rows before writing each one's entry out
                reader = pq.ParquetFile(
                    file.window,
                    metadata=file.metadata,
                    read_dictionary=[".".join(file.payload.names)],
                )
            table = reader.read_row_group(
                row_group, columns=[".".join(file.payload.names)], use_threads=False
            )
        except (pa.ArrowException, OSError, ValueError) as e:
            raise BadSample("corrupt", f"{where} cannot be decoded ({e})") from e
        finally:
            file.window.data = b""
        parts = leaves(table.column(0), file.payload)
        if repeated:
            self._check_size(where, bound.plain + expanded_bytes(parts), "its dictionary")
        group = decode(parts, file.payload, self.target)
        self._remember(key, group)
        return group

    def _fits(self, path: str, row_group: int) -> bool:
        """Whether the footer lets ``row_group``'s payload be decoded (else it is left to
        :meth:`_group` to refuse, row by row)."""
        file = self._file(path)
        if not 0 <= row_group < file.metadata.num_row_groups:
            return False
        return footer_bound(file.metadata, file.payload.leaves, row_group) <= self.max_bytes

    def _check_size(self, where: str, bound: int, by: str) -> None:
        if bound > self.max_bytes:
            raise BadSample(
                "too_large",
                f"{where} would take {format_bytes(bound)} decoded (by {by}), more than the "
                f"server's --max-sample-bytes ({format_bytes(self.max_bytes)}), so no row of "
                f"it is read (a compression bomb, or a row group too large). {MAX_SAMPLE_HINT}",
            )

    def _remember(self, key: tuple[str, int], group: Group) -> None:
        self._groups[key] = (group, self._batch)
        self._bytes += group.nbytes
        while self._bytes > _DECODED_CACHE_BYTES:
            oldest_key, (oldest, used) = next(iter(self._groups.items()))
            if used == self._batch:  # everything left is this batch's own
                break
            del self._groups[oldest_key]
            self._bytes -= oldest.nbytes


def _no_row(path: str, row_group: int, rows: int, row: int) -> BadSample:
    return BadSample(
        "corrupt",
        f"{path}: row group {row_group} has {rows} rows, not a row {row}: the file changed "
        "since it was ingested; re-ingest it",
    )
