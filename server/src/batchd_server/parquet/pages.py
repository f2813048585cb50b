"""Where each row's value lies in the file, for a binary column stored as is.

A row group's payload chunk whose pages are uncompressed keeps every binary value as its own
bytes, prefixed by their length: in the dictionary page (values a data page then names by
index) or in a plain data page itself. Walking the chunk's page headers and those length
prefixes, never the values, gives each row's ``(offset, length)`` in the file, so a worker
can read just its rows, as it reads tar members, instead of reading and decoding the whole
chunk (:class:`~batchd_server.parquet.rows.ParquetRows` does that for every other chunk).

What is read here: the page headers (Thrift compact protocol; only the fields used are kept,
the rest skipped), the definition levels and dictionary indices of each data page (small),
and four bytes per value. Anything else (compressed pages, data page v2, repeated columns, an
encoding other than PLAIN or a dictionary) is :class:`NotPlain`: the caller decodes the chunk
as before.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Final

import numpy as np
import numpy.typing as npt
import pyarrow.parquet as pq

from batchd_server.pipelines.base import BadSample
from batchd_server.storage.ranges import Ranges

__all__ = [
    "NotPlain",
    "RowPlaces",
    "gather_in_place",
    "places_of_rows",
    "plain_places",
    "row_places",
]

_DATA_PAGE: Final = 0
_DICTIONARY_PAGE: Final = 2
_PLAIN: Final = 0
_PLAIN_DICTIONARY: Final = 2
_RLE: Final = 3
_RLE_DICTIONARY: Final = 8
_HEADER_READ: Final = 1024
"""Bytes read for a page header at first; a longer one (large statistics) is read again."""
_MAX_HEADER: Final = 1 << 20

Read = Callable[[int, int], bytes]
"""``read(offset, length)``: bytes of the file (fewer only at its end)."""


class NotPlain(Exception):
    """The chunk is not one whose values can be read in place (or is malformed): decode it."""


@dataclass(frozen=True)
class RowPlaces:
    """Row ``i``'s value is ``length[i]`` bytes at ``offset[i]`` of the file; -1: null."""

    offset: npt.NDArray[np.int64]
    length: npt.NDArray[np.int64]


def plain_places(
    metadata: pq.FileMetaData,
    leaves: tuple[int, ...],
    row_group: int,
    read: Read,
    offset: int,
    length: int,
) -> RowPlaces | None:
    """The places of the rows of a row group's payload chunk (``offset``, ``length``), when
    it is one leaf, an uncompressed binary column, not repeated, and stored plainly; else
    None (decode it)."""
    if len(leaves) != 1:
        return None
    column = metadata.row_group(row_group).column(leaves[0])
    described = metadata.schema.column(leaves[0])
    if (
        column.compression != "UNCOMPRESSED"
        or column.physical_type != "BYTE_ARRAY"
        or described.max_repetition_level != 0
    ):
        return None
    try:
        places = row_places(read, offset, length, described.max_definition_level)
    except NotPlain:
        return None
    return places if len(places.offset) == column.num_values else None


def row_places(read: Read, start: int, size: int, max_definition: int) -> RowPlaces:
    """The places of the values of the chunk of ``size`` bytes at ``start`` (a binary column,
    not repeated, whose definition levels go up to ``max_definition``).

    Raises:
        NotPlain: as the module says.
    """
    end = start + size
    at = start
    dictionary: tuple[npt.NDArray[np.int64], npt.NDArray[np.int64]] | None = None
    offsets: list[npt.NDArray[np.int64]] = []
    lengths: list[npt.NDArray[np.int64]] = []
    while at < end:
        header, body = _page_header(read, at, end)
        page_end = body + header.size
        if page_end > end:
            raise NotPlain("a page runs past its column chunk")
        if header.kind == _DICTIONARY_PAGE:
            if header.encoding not in (_PLAIN, _PLAIN_DICTIONARY) or dictionary is not None:
                raise NotPlain("a dictionary page that is not plain")
            dictionary = _plain_values(read, body, page_end, header.values)
        elif header.kind == _DATA_PAGE:
            o, n = _data_page(read, header, body, page_end, max_definition, dictionary)
            offsets.append(o)
            lengths.append(n)
        else:
            raise NotPlain(f"a page of type {header.kind}")
        at = page_end
    if not offsets:
        return RowPlaces(np.zeros(0, np.int64), np.zeros(0, np.int64))
    return RowPlaces(np.concatenate(offsets), np.concatenate(lengths))


PlacesOf = Callable[[str, int, int, int], "RowPlaces | None"]
"""``(path, row group, chunk offset, chunk length)`` -> the rows' places, None: not plain."""
ReadRanges = Callable[[Ranges], tuple[npt.NDArray[np.uint8], npt.NDArray[np.int64]]]


def places_of_rows(
    places_of: PlacesOf,
    chunks: Ranges,
    row_groups: npt.NDArray[np.int32],
    rows: npt.NDArray[np.int32],
) -> tuple[npt.NDArray[np.int64], npt.NDArray[np.int64]] | None:
    """Where each of many rows lies, ``(offset, length)`` (-1: null): row ``rows[i]`` of row
    group ``row_groups[i]`` of ``chunks.paths[chunks.files[i]]``, whose payload chunk the
    catalog puts at ``chunks.offsets[i]``, ``chunks.lengths[i]``. None when a row group
    cannot be read or a row is past its row group's end (the rows one by one then say
    which).

    Raises:
        NotPlain: some row group's chunk is not stored plainly (decode them).
    """
    paths, files, offsets, lengths = chunks.paths, chunks.files, chunks.offsets, chunks.lengths
    n = len(rows)
    at = np.empty(n, np.int64)
    size = np.empty(n, np.int64)
    keys = files.astype(np.int64) << 32 | row_groups.astype(np.int64)
    distinct, first, which = np.unique(keys, return_index=True, return_inverse=True)
    for k, (key, i) in enumerate(zip(distinct.tolist(), first.tolist(), strict=True)):
        try:
            places = places_of(paths[key >> 32], key & 0xFFFFFFFF, int(offsets[i]), int(lengths[i]))
        except BadSample:
            return None
        if places is None:
            raise NotPlain("decoded")
        members = np.flatnonzero(which == k)
        wanted = rows[members].astype(np.int64)
        if wanted.min() < 0 or wanted.max() >= len(places.offset):
            return None
        at[members], size[members] = places.offset[wanted], places.length[wanted]
    return at, size


def gather_in_place(
    places_of: PlacesOf,
    read_ranges: ReadRanges,
    chunks: Ranges,
    row_groups: npt.NDArray[np.int32],
    rows: npt.NDArray[np.int32],
) -> tuple[npt.NDArray[np.uint8], npt.NDArray[np.int64], npt.NDArray[np.int64], bool] | None:
    """``ParquetRows.gather`` of rows that all lie in plainly stored chunks, read where they
    lie with one ``read_ranges``; None as ``gather`` (a row group or row that cannot be
    served, or a null row: the rows one by one then say which).

    Raises:
        NotPlain: some row group's chunk is not stored plainly (decode them).
    """
    found = places_of_rows(places_of, chunks, row_groups, rows)
    if found is None:
        return None
    at, size = found
    if len(at) and at.min() < 0:
        return None
    try:
        data, starts = read_ranges(Ranges(chunks.paths, chunks.files, at, size))
    except BadSample:
        return None
    return data, starts, size, False


@dataclass(frozen=True)
class _Header:
    kind: int
    size: int
    values: int
    encoding: int
    definition_encoding: int


def _page_header(read: Read, at: int, end: int) -> tuple[_Header, int]:
    """The page header at ``at`` and where the page's bytes begin."""
    want = min(_HEADER_READ, end - at)
    while True:
        raw = read(at, want)
        try:
            reader = _Compact(raw)
            header = _read_page_header(reader)
            return header, at + reader.pos
        except _Short:
            if want >= min(_MAX_HEADER, end - at):
                raise NotPlain("a page header that does not parse") from None
            want = min(_MAX_HEADER, end - at, want * 64)


def _read_page_header(r: _Compact) -> _Header:
    kind = values = encoding = definition = -1
    compressed_size = uncompressed_size = -1
    for field, kind_of in r.fields():
        if field == 1 and kind_of == 5:
            kind = r.zigzag()
        elif field == 2 and kind_of == 5:
            uncompressed_size = r.zigzag()
        elif field == 3 and kind_of == 5:
            compressed_size = r.zigzag()
        elif field in (5, 7) and kind_of == 12:
            for sub, sub_kind in r.fields():
                if sub == 1 and sub_kind == 5:
                    values = r.zigzag()
                elif sub == 2 and sub_kind == 5:
                    encoding = r.zigzag()
                elif sub == 3 and sub_kind == 5 and field == 5:
                    definition = r.zigzag()
                else:
                    r.skip(sub_kind)
        else:
            r.skip(kind_of)
    if kind not in (_DATA_PAGE, _DICTIONARY_PAGE):
        raise NotPlain(f"a page of type {kind}")
    if compressed_size < 0 or values < 0 or encoding < 0:
        raise NotPlain("a page header without its sizes")
    if compressed_size != uncompressed_size:
        raise NotPlain("a compressed page")
    return _Header(kind, compressed_size, values, encoding, definition)


def _data_page(
    read: Read,
    header: _Header,
    body: int,
    end: int,
    max_definition: int,
    dictionary: tuple[npt.NDArray[np.int64], npt.NDArray[np.int64]] | None,
) -> tuple[npt.NDArray[np.int64], npt.NDArray[np.int64]]:
    n = header.values
    present = np.ones(n, bool)
    at = body
    if max_definition > 0:
        if header.definition_encoding != _RLE:
            raise NotPlain("definition levels that are not RLE")
        raw = read(at, 4)
        if len(raw) < 4:
            raise NotPlain("a page cut short")
        count = int.from_bytes(raw, "little")
        levels = _rle(read(at + 4, count), (max_definition).bit_length(), n)
        present = levels == max_definition
        at += 4 + count
    k = int(present.sum())
    offsets = np.full(n, -1, np.int64)
    lengths = np.full(n, -1, np.int64)
    if header.encoding == _PLAIN:
        o, size = _plain_values(read, at, end, k)
    elif header.encoding in (_PLAIN_DICTIONARY, _RLE_DICTIONARY) and dictionary is not None:
        raw = read(at, end - at)
        if not raw:
            raise NotPlain("a page cut short")
        indexes = _rle(raw[1:], raw[0], k) if k else np.zeros(0, np.int64)
        if k and (indexes.min() < 0 or indexes.max() >= len(dictionary[0])):
            raise NotPlain("a dictionary index out of range")
        o, size = dictionary[0][indexes], dictionary[1][indexes]
    else:
        raise NotPlain(f"values of encoding {header.encoding}")
    offsets[present], lengths[present] = o, size
    return offsets, lengths


def _plain_values(
    read: Read, at: int, end: int, count: int
) -> tuple[npt.NDArray[np.int64], npt.NDArray[np.int64]]:
    """``count`` plain binary values from ``at``: each a 4-byte length and its bytes."""
    offsets = np.empty(count, np.int64)
    lengths = np.empty(count, np.int64)
    for i in range(count):
        raw = read(at, 4)
        if len(raw) < 4:
            raise NotPlain("a page cut short")
        size = int.from_bytes(raw, "little")
        offsets[i], lengths[i] = at + 4, size
        at += 4 + size
        if at > end:
            raise NotPlain("a value runs past its page")
    return offsets, lengths


def _rle(raw: bytes, width: int, count: int) -> npt.NDArray[np.int64]:
    """``count`` values of the RLE / bit-packed hybrid encoding, ``width`` bits each."""
    if not 0 <= width <= 32:
        raise NotPlain("a bit width over 32")
    out = np.zeros(count, np.int64)
    if width == 0:  # every value is 0
        return out
    r = _Compact(raw)
    done = 0
    byte_width = (width + 7) // 8
    try:
        while done < count:
            head = r.varint()
            if head & 1:  # bit-packed groups of 8
                groups = head >> 1
                packed = np.frombuffer(r.take(groups * width), np.uint8)
                bits = np.unpackbits(packed, bitorder="little").reshape(-1, width)
                values = (bits.astype(np.int64) << np.arange(width)).sum(axis=1)
                take = min(len(values), count - done)
                out[done : done + take] = values[:take]
                done += take
            else:
                run = head >> 1
                value = int.from_bytes(r.take(byte_width), "little")
                take = min(run, count - done)
                out[done : done + take] = value
                done += take
                if run == 0:
                    raise NotPlain("an empty run")
    except _Short:
        raise NotPlain("levels or indexes cut short") from None
    return out


class _Short(Exception):
    """The bytes ended inside what was being read."""


class _Compact:
    """A reader of the Thrift compact protocol, as far as page headers need."""

    def __init__(self, data: bytes) -> None:
        self.data = data
        self.pos = 0

    def take(self, n: int) -> bytes:
        if self.pos + n > len(self.data):
            raise _Short
        got = self.data[self.pos : self.pos + n]
        self.pos += n
        return got

    def byte(self) -> int:
        if self.pos >= len(self.data):
            raise _Short
        self.pos += 1
        return self.data[self.pos - 1]

    def varint(self) -> int:
        shift = value = 0
        while True:
            b = self.byte()
            value |= (b & 0x7F) << shift
            if not b & 0x80:
                return value
            shift += 7
            if shift > 70:
                raise NotPlain("a varint too long")

    def zigzag(self) -> int:
        v = self.varint()
        return (v >> 1) ^ -(v & 1)

    def fields(self) -> _Fields:
        return _Fields(self)

    def skip(self, kind: int) -> None:
        if kind in (1, 2):  # booleans live in the field header
            return
        if kind == 3:
            self.take(1)
        elif kind in (4, 5, 6):
            self.varint()
        elif kind == 7:
            self.take(8)
        elif kind == 8:
            self.take(self.varint())
        elif kind in (9, 10):
            head = self.byte()
            size, element = head >> 4, head & 0x0F
            if size == 15:
                size = self.varint()
            for _ in range(size):
                if element in (1, 2):
                    self.take(1)
                else:
                    self.skip(element)
        elif kind == 11:
            size = self.varint()
            if size:
                types = self.byte()
                for _ in range(size):
                    self.skip(types >> 4)
                    self.skip(types & 0x0F)
        elif kind == 12:
            for _, sub in self.fields():
                self.skip(sub)
        else:
            raise NotPlain(f"a Thrift type {kind}")


class _Fields:
    """The (field id, type) of a struct's fields, in order, until its stop byte."""

    def __init__(self, reader: _Compact) -> None:
        self.r = reader
        self.last = 0

    def __iter__(self) -> _Fields:
        return self

    def __next__(self) -> tuple[int, int]:
        head = self.r.byte()
        if head == 0:
            raise StopIteration
        delta, kind = head >> 4, head & 0x0F
        self.last = self.last + delta if delta else self.r.zigzag()
        return self.last, kind
