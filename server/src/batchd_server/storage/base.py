"""The seam between reading an object store and caching what was read."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

__all__ = ["RangeFetcher"]


class RangeFetcher(Protocol):
    """Fetches byte ranges of objects named by URL (``s3://bucket/key``).

    The object-store client implements it; the node cache wraps one and is one itself, so a
    worker's reads go through the cache without knowing whether there is one.
    """

    def fetch(self, url: str, ranges: Sequence[tuple[int, int]]) -> list[bytes]:
        """The bytes of each ``(offset, length)`` range of the object at ``url``, in order.

        Raises:
            BadSample: kind ``missing`` (no such object, naming the URL) or ``transient``
                (the store kept failing after the retries).
        """
        ...
