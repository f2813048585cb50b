"""Parse the text ``COPY ... TO STDOUT`` output of a packed split query with numpy.

``reader.split_query(packed=True)`` selects two columns per row: the numeric columns packed
into one fixed-width hex field (``PACKED`` is its layout) and the path. So each chunk of
output is parsed with a few vectorised passes: find the newlines, gather the hex,
reinterpret it as big-endian integers and floats, and cut out the paths. Only rows whose
path needed a COPY escape (a backslash, tab, newline, ...) take a per-row slow path.
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING, Final

import numpy as np
import numpy.typing as npt
from numpy.lib.stride_tricks import sliding_window_view

if TYPE_CHECKING:
    from batchd_server.catalog.columns import ColumnBuilder

__all__ = ["PACKED", "PackedCopyParser"]

# Numeric columns as the Postgres query packs them: big-endian, in this order. Nulls are
# COALESCEd to -1 in SQL, so every record has the same width.
PACKED: Final = np.dtype(
    [
        ("id", ">i8"),
        ("label", ">i8"),
        ("byte_offset", ">i8"),
        ("byte_length", ">i8"),
        ("weight", ">f8"),
        ("length", ">i4"),
        ("row_group", ">i4"),
        ("row_index", ">i4"),
    ]
)
_HEX_WIDTH: Final = 2 * PACKED.itemsize
_HEX_DIGITS: Final = np.frombuffer(b"0123456789abcdef", np.uint8).astype(np.uint16)
_HEX_PAIR: Final = np.zeros(1 << 16, np.uint8)
"""Byte value of two hex characters read as one little-endian uint16."""
_HEX_PAIR[_HEX_DIGITS[:, None] | (_HEX_DIGITS[None, :] << 8)] = np.arange(256).reshape(16, 16)

# Escapes that COPY's text format writes for a backslash and for control characters.
_COPY_ESCAPES: Final = {
    ord("b"): b"\b",
    ord("f"): b"\f",
    ord("n"): b"\n",
    ord("r"): b"\r",
    ord("t"): b"\t",
    ord("v"): b"\v",
}
_COPY_ESCAPE_RE: Final = re.compile(rb"\\(.)", re.DOTALL)

Int64Array = npt.NDArray[np.int64]


class PackedCopyParser:
    """A file-like sink for the text ``COPY`` output of ``split_query(packed=True)``.

    psycopg2 calls ``write`` with whatever pieces of output it has (in practice one row
    each). Once ``chunk_bytes`` are pending, every complete line is parsed with numpy and
    handed to ``rows``; an incomplete last line waits for the next write.
    """

    def __init__(self, rows: ColumnBuilder, *, chunk_bytes: int) -> None:
        self._rows = rows
        self._chunk_bytes = chunk_bytes
        self._pending = bytearray()

    def write(self, data: bytes) -> None:
        self._pending += data
        if len(self._pending) >= self._chunk_bytes:
            self._parse_complete_lines()

    def close(self) -> None:
        self._parse_complete_lines()
        assert not self._pending, f"COPY output ended inside a row: {bytes(self._pending)[:80]!r}"

    def _parse_complete_lines(self) -> None:
        end = self._pending.rfind(b"\n") + 1
        if end == 0:
            return
        # Swap buffers rather than delete in place: numpy views pin the old one's size.
        data, self._pending = self._pending, self._pending[end:]
        self._parse(np.frombuffer(data, np.uint8, count=end))

    def _parse(self, buf: npt.NDArray[np.uint8]) -> None:
        line_ends = np.flatnonzero(buf == ord("\n"))
        starts = np.empty_like(line_ends)
        starts[0] = 0
        starts[1:] = line_ends[:-1] + 1
        path_starts = starts + (_HEX_WIDTH + 1)
        assert (path_starts <= line_ends).all(), "every line has the packed prefix"
        assert (buf[starts + _HEX_WIDTH] == ord("\t")).all(), "the prefix is one field"

        # Each row's hex is _HEX_WIDTH contiguous bytes: gather them as rows of a sliding window,
        # then decode two characters at a time through a table of every hex pair.
        hex_rows = sliding_window_view(buf, _HEX_WIDTH)[starts]
        records = _HEX_PAIR[hex_rows.view("<u2")].view(PACKED).reshape(-1)
        # The paths are what remains without each row's hex, tab and newline. (The windows do
        # not overlap, and would be harmless if they did: they all write False.)
        is_path = np.ones(buf.size, bool)
        sliding_window_view(is_path, _HEX_WIDTH + 1, writeable=True)[starts] = False
        is_path[line_ends] = False
        path_lengths = line_ends - path_starts
        path_bytes = _unescape_paths(buf[is_path], path_lengths)
        self._rows.add(
            ids=records["id"],
            labels=records["label"],
            lengths=records["length"],
            weights=records["weight"],
            byte_offsets=records["byte_offset"],
            byte_lengths=records["byte_length"],
            path_bytes=path_bytes,
            path_lengths=path_lengths,
            row_groups=records["row_group"],
            row_indexes=records["row_index"],
        )


def _unescape_paths(escaped: npt.NDArray[np.uint8], lengths: Int64Array) -> npt.NDArray[np.uint8]:
    """Undo COPY's text escapes in the concatenated paths; ``lengths`` is updated in place.

    Every escape starts with a backslash, and paths rarely hold one, so only the paths that
    do are decoded one by one.
    """
    backslashes = np.flatnonzero(escaped == ord("\\"))
    if backslashes.size == 0:
        return escaped
    offsets = np.zeros(lengths.size + 1, np.int64)
    np.cumsum(lengths, out=offsets[1:])
    rows = np.unique(np.searchsorted(offsets, backslashes, side="right") - 1)
    pieces = []
    done = 0
    for row in rows.tolist():
        start, end = int(offsets[row]), int(offsets[row + 1])
        path = _COPY_ESCAPE_RE.sub(_unescape_one, escaped[start:end].tobytes())
        pieces += [escaped[done:start], np.frombuffer(path, np.uint8)]
        lengths[row] = len(path)
        done = end
    pieces.append(escaped[done:])
    return np.concatenate(pieces)


def _unescape_one(match: re.Match[bytes]) -> bytes:
    char = match[1]
    return _COPY_ESCAPES.get(char[0], char)
