"""Where a worker's reader of sample bytes comes from: one place, chosen by the root.

:func:`open_sample_files` gives a local root a
:class:`~batchd_server.pipelines.files.SampleFiles` and an ``s3://`` root an
:class:`~batchd_server.storage.objects.ObjectFiles`, whose bytes come from
:func:`make_fetcher`. That function is the one place where the object-store client is made,
so it is where a wrapper goes (the node cache wraps the client there: a ``CachingFetcher``
is itself a :class:`~batchd_server.storage.base.RangeFetcher`). Keep it that small.

:class:`~batchd_server.storage.options.StoreOptions` carries the server's object-store
settings to the worker processes (on every task's ``SessionSpec``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Final

from batchd_server.pipelines.files import MAX_SAMPLE_BYTES, SampleFiles
from batchd_server.storage.base import RangeFetcher
from batchd_server.storage.cache import CachingFetcher, cached
from batchd_server.storage.objects import ObjectFiles
from batchd_server.storage.options import StoreOptions
from batchd_server.storage.s3 import S3Fetcher, is_object_url

__all__ = ["OPEN_CHECK_RETRY_S", "make_fetcher", "open_sample_files"]

OPEN_CHECK_RETRY_S: Final = 10.0
"""How long the reachability check at session open retries, at most."""


def make_fetcher(options: StoreOptions) -> RangeFetcher:
    """The object store's client as a RangeFetcher, read through the node cache when the
    server has one (``--cache-dir``)."""
    inner = S3Fetcher(retry_s=options.retry_s)
    cache_dir = None if options.cache_dir is None else Path(options.cache_dir)
    return cached(inner, cache_dir, capacity_bytes=options.cache_size_bytes)


def open_sample_files(
    root: str,
    *,
    max_sample_bytes: int = MAX_SAMPLE_BYTES,
    store: StoreOptions | None = None,
) -> SampleFiles | ObjectFiles:
    """The reader of sample bytes under ``root``: a local directory or an ``s3://`` prefix.

    Raises:
        FailedPrecondition: a local ``root`` is not a directory.
    """
    if not is_object_url(root):
        return SampleFiles(root, max_sample_bytes=max_sample_bytes)
    options = store or StoreOptions()
    fetcher = make_fetcher(options)
    # Through the cache, a cached object's size is known without a request (the store down).
    sizes = fetcher if isinstance(fetcher, CachingFetcher) else S3Fetcher(retry_s=options.retry_s)
    return ObjectFiles(root, fetcher, sizes.size, max_sample_bytes=max_sample_bytes)
