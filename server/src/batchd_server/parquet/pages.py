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
as before. So is a chunk that does not add up (a header that does not parse, a page or value
past its end, more values than the footer's): the bytes may be hostile, and walking them
costs time and memory bounded by their size and the footer's count, whatever they say
(``thrift.py`` reads the headers so).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Final

import numpy as np
import numpy.typing as npt
import pyarrow.parquet as pq

from batchd_server.parquet.thrift import Compact, Malformed, Short
from batchd_server.pipelines.base import BadSample
from batchd_server.storage.ranges import Ranges

__all__ = [
    "NotPlain",
    "PageHeader",
    "Read",
    "RowPlaces",
    "chunk_pages",
    "gather_in_place",
    "places_of_rows",
    "plain_places",
    "row_places",
]

_DATA_PAGE: Final = 0
_DICTIONARY_PAGE: Final = 2
_DATA_PAGE_V2: Final = 3
_PLAIN: Final = 0
_PLAIN_DICTIONARY: Final = 2
_RLE: Final = 3
_RLE_DICTIONARY: Final = 8
_HEADER_READ: Final = 1024
"""Bytes read for a page header at first; a longer one (large statistics) is read again."""
_MAX_HEADER: Final = 1 << 20
_PLACE_BYTES: Final = 16
"""A row's place: its offset and length."""

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
    max_bytes: int,
) -> RowPlaces | None:
    """The places of the rows of a row group's payload chunk (``offset``, ``length``), when
    it is one leaf, an uncompressed binary column, not repeated, and stored plainly, and its
    places take at most ``max_bytes``; else None (decode it: the decoding refuses what is too
    large)."""
    if len(leaves) != 1:
        return None
    column = metadata.row_group(row_group).column(leaves[0])
    described = metadata.schema.column(leaves[0])
    if (
        column.compression != "UNCOMPRESSED"
        or column.physical_type != "BYTE_ARRAY"
        or described.max_repetition_level != 0
        or column.num_values != metadata.row_group(row_group).num_rows
        or column.num_values * _PLACE_BYTES > max_bytes
    ):
        return None
    try:
        return row_places(read, offset, length, described.max_definition_level, column.num_values)
    except NotPlain:
        return None


def row_places(read: Read, start: int, size: int, max_definition: int, expected: int) -> RowPlaces:
    """The places of the ``expected`` values of the chunk of ``size`` bytes at ``start`` (a
    binary column, not repeated, whose definition levels go up to ``max_definition``).

    Nothing here trusts the bytes: a page claims no more values than are left of
    ``expected`` (the footer's count, which the caller checks against the row group), a
    page's bytes lie inside the chunk, a value's inside its page, and the page headers are
    read by the bounded :class:`~batchd_server.parquet.thrift.Compact`; so the work and
    memory are bounded by ``size`` and ``expected``, whatever the bytes hold.

    Raises:
        NotPlain: as the module says (a malformed chunk included).
    """
    dictionary: tuple[npt.NDArray[np.int64], npt.NDArray[np.int64]] | None = None
    offsets: list[npt.NDArray[np.int64]] = []
    lengths: list[npt.NDArray[np.int64]] = []
    left = expected
    for header, body in chunk_pages(read, start, size):
        page_end = body + header.size
        if header.size != header.uncompressed:
            raise NotPlain("a compressed page")
        if header.kind == _DICTIONARY_PAGE:
            if header.encoding not in (_PLAIN, _PLAIN_DICTIONARY) or dictionary is not None:
                raise NotPlain("a dictionary page that is not plain")
            dictionary = _plain_values(read, body, page_end, header.values)
        elif header.kind == _DATA_PAGE:
            if header.values > left:
                raise NotPlain("a page of more values than its column chunk has")
            left -= header.values
            o, n = _data_page(read, header, body, page_end, max_definition, dictionary)
            offsets.append(o)
            lengths.append(n)
        else:
            raise NotPlain(f"a page of type {header.kind}")
    if left:
        raise NotPlain("pages of fewer values than their column chunk has")
    if not offsets:
        return RowPlaces(np.zeros(0, np.int64), np.zeros(0, np.int64))
    return RowPlaces(np.concatenate(offsets), np.concatenate(lengths))


def chunk_pages(read: Read, start: int, size: int) -> Iterator[tuple[PageHeader, int]]:
    """The page headers of the column chunk of ``size`` bytes at ``start``, each with where
    its page's bytes begin; every page lies inside the chunk, so there are at most ``size``
    of them.

    Raises:
        NotPlain: a header that does not parse, or a page that runs past the chunk.
    """
    end = start + size
    at = start
    while at < end:
        header, body = _page_header(read, at, end)
        if body + header.size > end:
            raise NotPlain("a page runs past its column chunk")
        yield header, body
        at = body + header.size


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
class PageHeader:
    """What a page header says of its page (-1: not said)."""

    kind: int
    """0 data page, 1 index page, 2 dictionary page, 3 data page version 2."""
    size: int
    """Its bytes in the file (compressed)."""
    uncompressed: int
    values: int
    """A data page's values (nulls included), a dictionary page's entries."""
    encoding: int
    definition_encoding: int


def _page_header(read: Read, at: int, end: int) -> tuple[PageHeader, int]:
    """The page header at ``at`` and where the page's bytes begin."""
    want = min(_HEADER_READ, end - at)
    while True:
        raw = read(at, want)
        try:
            reader = Compact(raw)
            header = _read_page_header(reader)
            return header, at + reader.pos
        except Short:
            if want >= min(_MAX_HEADER, end - at) or len(raw) < want:
                raise NotPlain("a page header that does not parse") from None
            want = min(_MAX_HEADER, end - at, want * 64)
        except Malformed as e:
            raise NotPlain(f"a page header that does not parse ({e})") from None


def _read_page_header(r: Compact) -> PageHeader:
    kind = values = encoding = definition = -1
    compressed_size = uncompressed_size = -1
    for field, kind_of in r.fields():
        if field == 1 and kind_of == 5:
            kind = r.zigzag()
        elif field == 2 and kind_of == 5:
            uncompressed_size = r.zigzag()
        elif field == 3 and kind_of == 5:
            compressed_size = r.zigzag()
        elif field in (5, 7, 8) and kind_of == 12:
            for sub, sub_kind in r.fields():
                if sub == 1 and sub_kind == 5:
                    values = r.zigzag()
                elif sub == (4 if field == 8 else 2) and sub_kind == 5:
                    encoding = r.zigzag()
                elif sub == 3 and sub_kind == 5 and field == 5:
                    definition = r.zigzag()
                else:
                    r.skip(sub_kind, 1)
        else:
            r.skip(kind_of)
    if compressed_size < 0 or uncompressed_size < 0:
        raise Malformed("a page header without its sizes")
    if kind in (_DATA_PAGE, _DICTIONARY_PAGE, _DATA_PAGE_V2) and values < 0:
        raise Malformed("a page header without its number of values")
    return PageHeader(kind, compressed_size, uncompressed_size, values, encoding, definition)


def _data_page(
    read: Read,
    header: PageHeader,
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
        if at + 4 + count > end:
            raise NotPlain("definition levels that run past their page")
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
    if count > (end - at) // 4:
        raise NotPlain("more values than their page has bytes for")
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
    r = Compact(raw)
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
    except (Short, Malformed):
        raise NotPlain("levels or indexes cut short") from None
    return out
