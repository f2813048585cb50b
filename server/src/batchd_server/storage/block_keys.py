"""The names of the node cache's blocks and what it records of an object (NOTE [ Cache
files ] in ``blocks.py``)."""

from __future__ import annotations

import functools
import hashlib
from dataclasses import dataclass

__all__ = ["BlockKey", "ObjectMeta", "object_hash"]


@functools.lru_cache(maxsize=1 << 16)
def object_hash(url: str) -> str:
    """The 40 hex digits naming ``url``'s files (NOTE [ Cache files ]); remembered, since a
    warm epoch of one object per image asks for each of them once per read."""
    return hashlib.sha256(url.encode("utf-8")).hexdigest()[:40]


@dataclass(frozen=True, order=True)
class BlockKey:
    """Block ``index`` of the object whose URL hashes to ``object``."""

    object: str
    index: int

    @property
    def name(self) -> str:
        return f"{self.object}.{self.index}"

    @classmethod
    def parse(cls, name: str) -> BlockKey | None:
        """The key of a block file's name; None for a name that is not one."""
        head, _, tail = name.partition(".")
        if len(head) != 40 or not tail.isdigit():
            return None
        return cls(head, int(tail))


@dataclass(frozen=True)
class ObjectMeta:
    """What the store said about an object when its first block was cached."""

    url: str
    size: int
    """Bytes."""
    version: str | None = None
    """Its ETag, else its version id (None: the store says none): NOTE [ Object versions ]
    in ``block_format.py``."""
