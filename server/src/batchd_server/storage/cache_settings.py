"""The node cache's settings, declared once (``settings.py``) on a base of
:class:`~batchd_server.config.ServerConfig`: the flags, variables, checks and the reference
page follow from these fields as from ServerConfig's own (see NOTE [ Cache files ] in
``blocks.py`` and the docs page ``server/object-cache.md``)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Final

from batchd_server.settings import Check, at_least, parse_bytes, setting, within

__all__ = ["DEFAULT_CACHE_BYTES", "DEFAULT_PREFETCH_BATCHES", "CacheSettings"]

DEFAULT_CACHE_BYTES: Final = 10 << 30
DEFAULT_PREFETCH_BATCHES: Final = 8
_MIN_CACHE_BYTES: Final = 64 << 20
"""Sixteen blocks: less would hold less than one batch of most datasets."""


def _absolute(path: Path) -> str | None:
    return None if path.is_absolute() else f"is {str(path)!r}, not an absolute path"


@dataclass(frozen=True, kw_only=True)
class CacheSettings:
    """The settings of the node cache of object-store bytes."""

    cache_dir: Path | None = field(
        default=None,
        metadata=setting(
            "keep the bytes read from s3:// datasets in this directory (a local disk or an "
            "emptyDir), shared by every session and kept across restarts; unset: no cache",
            flag="--cache-dir",
            env="BATCHD_CACHE_DIR",
            parse=Path,
            metavar="DIR",
            default_text="none",
            check=Check("an absolute path", _absolute),
        ),
    )
    cache_size_bytes: int = field(
        default=DEFAULT_CACHE_BYTES,
        metadata=setting(
            "the most bytes the cache's files may take; when it is full, what no live "
            "session reads again goes first, then what is read farthest ahead",
            flag="--cache-size",
            env="BATCHD_CACHE_SIZE",
            parse=parse_bytes,
            check=at_least(_MIN_CACHE_BYTES, size=True),
            metavar="BYTES",
        ),
    )
    cache_prefetch_batches: int = field(
        default=DEFAULT_PREFETCH_BATCHES,
        metadata=setting(
            "fetch into the cache the bytes of this many batches ahead of each stream; 0: "
            "none (workers then fetch what they miss)",
            flag="--cache-prefetch-batches",
            env="BATCHD_CACHE_PREFETCH_BATCHES",
            parse=int,
            check=within(0, 1024),
            metavar="N",
        ),
    )
