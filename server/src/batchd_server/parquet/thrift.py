"""A reader of the Thrift compact protocol, as far as Parquet page headers need, bounded for
bytes that may be hostile.

Every step consumes at least one byte of what it was given, or refuses: a collection claims
no more elements than there are bytes left (a boolean in a collection is a byte of its own;
only a struct's boolean *field* lives in the field header), nesting deeper than
:data:`MAX_DEPTH` is refused instead of recursing on, and a varint longer than 64 bits is
refused. So reading or skipping ``n`` bytes costs at most ``n`` steps, whatever they hold.
"""

from __future__ import annotations

from typing import Final

__all__ = ["MAX_DEPTH", "Compact", "Malformed", "Short"]

MAX_DEPTH: Final = 16
"""Nested structs, lists and maps skipped; a page header nests three deep (statistics)."""
_BOOL_TRUE: Final = 1
_BOOL_FALSE: Final = 2
_STRUCT: Final = 12


class Short(Exception):
    """The bytes ended inside what was being read (more bytes may complete it)."""


class Malformed(Exception):
    """What was read is not Thrift compact protocol (no more bytes would help)."""


class Compact:
    """Reads Thrift compact protocol from ``data``; :attr:`pos` is where the next read
    begins."""

    def __init__(self, data: bytes) -> None:
        self.data = data
        self.pos = 0

    def left(self) -> int:
        return len(self.data) - self.pos

    def take(self, n: int) -> bytes:
        if n < 0:
            raise Malformed("a negative length")
        if self.pos + n > len(self.data):
            raise Short
        got = self.data[self.pos : self.pos + n]
        self.pos += n
        return got

    def byte(self) -> int:
        if self.pos >= len(self.data):
            raise Short
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
            if shift >= 64:
                raise Malformed("a varint longer than 64 bits")

    def zigzag(self) -> int:
        v = self.varint()
        return (v >> 1) ^ -(v & 1)

    def fields(self) -> Fields:
        return Fields(self)

    def skip(self, kind: int, depth: int = 0) -> None:
        """Skips a value of Thrift type ``kind`` (a struct field's: a boolean is in its field
        header, so nothing is read for it)."""
        if kind in (_BOOL_TRUE, _BOOL_FALSE):
            return
        self._skip(kind, depth)

    def _element(self, kind: int, depth: int) -> None:
        """Skips an element of a list, set or map: a boolean is a byte of its own."""
        if kind in (_BOOL_TRUE, _BOOL_FALSE):
            self.take(1)
        else:
            self._skip(kind, depth)

    def _skip(self, kind: int, depth: int) -> None:
        if depth >= MAX_DEPTH:
            raise Malformed(f"values nested more than {MAX_DEPTH} deep")
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
            self._fits(size)
            for _ in range(size):
                self._element(element, depth + 1)
        elif kind == 11:
            size = self.varint()
            if size:
                self._fits(2 * size + 1)
                types = self.byte()
                for _ in range(size):
                    self._element(types >> 4, depth + 1)
                    self._element(types & 0x0F, depth + 1)
        elif kind == _STRUCT:
            for _, sub in Fields(self):
                self.skip(sub, depth + 1)
        else:
            raise Malformed(f"a Thrift type {kind}")

    def _fits(self, elements: int) -> None:
        """Each element takes a byte at least: more than are left cannot be there."""
        if elements > self.left():
            raise Short


class Fields:
    """The (field id, type) of a struct's fields, in order, until its stop byte."""

    def __init__(self, reader: Compact) -> None:
        self.r = reader
        self.last = 0

    def __iter__(self) -> Fields:
        return self

    def __next__(self) -> tuple[int, int]:
        head = self.r.byte()
        if head == 0:
            raise StopIteration
        delta, kind = head >> 4, head & 0x0F
        self.last = self.last + delta if delta else self.r.zigzag()
        return self.last, kind
