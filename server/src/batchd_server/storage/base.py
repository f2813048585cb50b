"""The seam between reading an object store and caching what was read."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Protocol, runtime_checkable

__all__ = [
    "ObjectChanged",
    "PinsVersions",
    "RangeFetcher",
    "StreamsRanges",
    "TooLarge",
    "WholeFetcher",
]


class TooLarge(Exception):
    """An object is larger than a whole-object read may take; ``size`` says how large (the
    reader turns it into a ``too_large`` bad sample with its own advice)."""

    def __init__(self, url: str, size: int) -> None:
        super().__init__(f"{url}: {size} bytes")
        self.size = size


class RangeFetcher(Protocol):
    """Fetches byte ranges of objects named by URL (``s3://bucket/key``).

    The object-store client implements it; the node cache wraps one and is one itself, so a
    worker's reads go through the cache without knowing whether there is one.
    """

    def fetch(self, url: str, ranges: Sequence[tuple[int, int]]) -> list[bytes | memoryview]:
        """The bytes of each ``(offset, length)`` range of the object at ``url``, in order.

        Raises:
            BadSample: kind ``missing`` (no such object, naming the URL) or ``transient``
                (the store kept failing after the retries).
        """
        ...


@runtime_checkable
class WholeFetcher(Protocol):
    """A fetcher that reads a whole object in one request, without asking its size first
    (a HEAD before each GET costs a round trip per object: most of a small image's time)."""

    def fetch_whole(self, url: str, max_bytes: int) -> bytes | memoryview:
        """The whole object at ``url`` (memory of its own, not reused by a later call).

        Raises:
            TooLarge: it has more than ``max_bytes`` (found before its body is read).
            BadSample: as :meth:`RangeFetcher.fetch`.
        """
        ...


@runtime_checkable
class StreamsRanges(Protocol):
    """A fetcher that can hand one range's bytes over as they arrive: the node cache writes
    them to its block files as they come rather than taking a new buffer per block."""

    def stream(self, url: str, offset: int, length: int) -> Iterator[bytes | memoryview]:
        """The bytes ``[offset, offset + length)`` in pieces, in order (fewer in all when the
        object is shorter).

        Raises:
            BadSample: as :meth:`RangeFetcher.fetch`.
        """
        ...


class ObjectChanged(Exception):
    """The object is not of the version asked for: it was rewritten in place."""


@runtime_checkable
class PinsVersions(Protocol):
    """A fetcher that can say an object's version (its ETag, else its version id) and read
    only that version: the node cache fills every block of an object from the version it
    recorded, whichever process fills it (NOTE [ Object versions ] in ``block_format.py``). A
    ``version`` of None asks for whatever version the store has."""

    def head(self, url: str) -> tuple[int, str | None]:
        """The object's size and version (a HEAD).

        Raises:
            BadSample: as :meth:`RangeFetcher.fetch`.
        """
        ...

    def fetch_version(
        self, url: str, ranges: Sequence[tuple[int, int]], version: str | None
    ) -> list[bytes | memoryview]:
        """As :meth:`RangeFetcher.fetch`, every range of ``version``.

        Raises:
            ObjectChanged: the object is not of ``version`` (or its ranges came from several).
            BadSample: as :meth:`RangeFetcher.fetch`.
        """
        ...

    def stream_version(
        self, url: str, offset: int, length: int, version: str | None
    ) -> Iterator[bytes | memoryview]:
        """As :meth:`StreamsRanges.stream`, of ``version``.

        Raises:
            ObjectChanged: the object is not of ``version``.
            BadSample: as :meth:`RangeFetcher.fetch`.
        """
        ...

    def fetch_whole_version(
        self, url: str, max_bytes: int
    ) -> tuple[str | None, bytes | memoryview]:
        """As :meth:`WholeFetcher.fetch_whole`, and the version it read.

        Raises:
            TooLarge, BadSample: as :meth:`WholeFetcher.fetch_whole`.
        """
        ...
