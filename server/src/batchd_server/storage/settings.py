"""Storage's server settings: how large one sample may be, how long a failing object-store
request is retried, and the node cache of object-store bytes (see NOTE [ Cache files ] in
``blocks.py`` and the docs page ``server/object-cache.md``).

``assembly.py`` hands the workers what they need of them as
:class:`~batchd_server.storage.options.StoreOptions`.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Final

from batchd_server.limits import MAX_SAMPLE_BYTES
from batchd_server.settings import (
    EVERY_COMMAND,
    Check,
    at_least,
    count,
    path,
    seconds,
    size,
    within,
)
from batchd_server.storage.options import DEFAULT_LIST_CACHE_S, DEFAULT_RETRY_S

__all__ = ["DEFAULT_CACHE_BYTES", "DEFAULT_PREFETCH_BATCHES", "StorageSettings"]

DEFAULT_CACHE_BYTES: Final = 10 << 30
DEFAULT_PREFETCH_BATCHES: Final = 8
_MIN_CACHE_BYTES: Final = 64 << 20
"""Sixteen blocks: less would hold less than one batch of most datasets."""


def _absolute(path: Path) -> str | None:
    return None if path.is_absolute() else f"is {str(path)!r}, not an absolute path"


@dataclass(frozen=True, kw_only=True)
class StorageSettings:
    """Storage's settings: sample reads, object-store requests and the node cache."""

    max_sample_bytes: int = size(
        flag="--max-sample-bytes",
        default=MAX_SAMPLE_BYTES,
        check=at_least(1),
        help="a sample larger than this many bytes (a runaway or sparse file, a range past the "
        "file) is not read: it is a bad sample of kind 'too_large', handled by the "
        "session's on_error",
    )

    object_store_retry_s: float = seconds(
        flag="--object-store-retry-s",
        default=DEFAULT_RETRY_S,
        check=within(0, 3600),
        help="retry a failing object-store request (throttling, 5xx, resets, timeouts, the store "
        "down) with backoff for up to this many seconds; what still fails is a bad sample of "
        "kind 'transient'. Keep it below --task-timeout-s",
        commands=(EVERY_COMMAND,),
    )

    object_store_list_cache_s: float = seconds(
        flag="--object-store-list-cache-s",
        default=DEFAULT_LIST_CACHE_S,
        check=within(0, 3600),
        help="a session open on an object-store dataset lists its root to check that the store "
        "answers; trust that answer for this many seconds (the opens of one job's ranks cost "
        "one listing); 0: list at every open",
    )

    cache_dir: Path | None = path(
        flag="--cache-dir",
        check=Check("an absolute path", _absolute),
        help="keep the bytes read from object-store datasets in this directory (a local disk or an "
        "emptyDir), shared by every session and kept across restarts; unset: no cache",
        metavar="DIR",
        default_text="none",
    )

    cache_size_bytes: int = size(
        flag="--cache-size",
        default=DEFAULT_CACHE_BYTES,
        check=at_least(_MIN_CACHE_BYTES, size=True),
        help="the most bytes the cache's files may take; when it is full, what no live "
        "session reads again goes first, then what is read farthest ahead",
    )

    cache_prefetch_batches: int = count(
        flag="--cache-prefetch-batches",
        default=DEFAULT_PREFETCH_BATCHES,
        check=within(0, 1024),
        help="fetch into the cache the bytes of this many batches ahead of each stream; 0: "
        "none (workers then fetch what they miss)",
    )
