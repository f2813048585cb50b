"""Where a worker's reader of sample bytes comes from: one table, keyed by the root's scheme.

:data:`READERS` maps a root's scheme to how its reader is opened: ``""`` (a local directory)
to a :class:`~batchd_server.storage.files.SampleFiles`, ``s3``, ``gs`` and ``az`` to an
:class:`~batchd_server.storage.objects.ObjectFiles`, whose bytes come from
:func:`make_fetcher`. A new store is one more row; nothing above asks "store or disk?"
(it asks ``storage/schemes.is_local_root`` where a local root is checked against
``--data-root``).
:func:`make_fetcher` is the one place where the object-store client is made, so it is where
a wrapper goes (the node cache wraps the client there: a ``CachingFetcher`` is itself a
:class:`~batchd_server.storage.base.RangeFetcher`). Keep it that small.

:class:`~batchd_server.storage.options.StoreOptions` carries the server's object-store
settings to the worker processes (on every task's ``SessionSpec``).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from pathlib import Path
from types import MappingProxyType
from typing import Final

from batchd_server.errors import FailedPrecondition
from batchd_server.limits import MAX_SAMPLE_BYTES
from batchd_server.storage.base import RangeFetcher
from batchd_server.storage.cache import CachingFetcher, cached
from batchd_server.storage.files import SampleFiles
from batchd_server.storage.objects import ObjectFiles
from batchd_server.storage.options import StoreOptions
from batchd_server.storage.reader import SampleReader
from batchd_server.storage.s3 import S3Fetcher
from batchd_server.storage.schemes import scheme_of

__all__ = [
    "OPEN_CHECK_RETRY_S",
    "READERS",
    "OpenReader",
    "make_fetcher",
    "open_reader",
]

OPEN_CHECK_RETRY_S: Final = 10.0
"""How long the reachability check at session open retries, at most."""

OpenReader = Callable[[str, int, StoreOptions], SampleReader]
"""How one scheme's reader is opened: (root, max_sample_bytes, store settings)."""


def make_fetcher(options: StoreOptions) -> RangeFetcher:
    """The object store's client as a RangeFetcher, read through the node cache when the
    server has one (``--cache-dir``)."""
    inner = S3Fetcher(retry_s=options.retry_s)
    cache_dir = None if options.cache_dir is None else Path(options.cache_dir)
    return cached(inner, cache_dir, capacity_bytes=options.cache_size_bytes)


def _local(root: str, max_sample_bytes: int, store: StoreOptions) -> SampleReader:
    return SampleFiles(root, max_sample_bytes=max_sample_bytes)


def _object_store(root: str, max_sample_bytes: int, store: StoreOptions) -> SampleReader:
    fetcher = make_fetcher(store)
    # Through the cache, a cached object's size is known without a request (the store down).
    sizes = fetcher if isinstance(fetcher, CachingFetcher) else S3Fetcher(retry_s=store.retry_s)
    return ObjectFiles(root, fetcher, sizes.size, max_sample_bytes=max_sample_bytes)


READERS: Final[Mapping[str, OpenReader]] = MappingProxyType(
    {"": _local, "s3": _object_store, "gs": _object_store, "az": _object_store}
)
"""A root's scheme (``s3`` of ``s3://bucket/prefix``, ``gs``, ``az``; ``""`` for a local
path) -> how its reader is opened. Every object store is read alike: which store a URL
names, and how its client is made, is ``storage/clouds.py``."""


def open_reader(
    root: str,
    *,
    max_sample_bytes: int = MAX_SAMPLE_BYTES,
    store: StoreOptions | None = None,
) -> SampleReader:
    """The reader of sample bytes under ``root``, by its scheme (:data:`READERS`).

    Raises:
        FailedPrecondition: a local ``root`` is not a directory, or its scheme has no reader.
    """
    scheme = scheme_of(root)
    opener = READERS.get(scheme)
    if opener is None:
        known = ", ".join(f"{s}://" for s in READERS if s)
        raise FailedPrecondition(
            f"dataset root {root!r}: this server reads no {scheme}:// roots (it reads local "
            f"directories and {known}); re-ingest the dataset with a root it can read"
        )
    return opener(root, max_sample_bytes, store or StoreOptions())
