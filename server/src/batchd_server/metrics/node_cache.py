"""The node cache of object-store bytes (``batchd_cache_*``, ``batchd_object_get_seconds``).

Workers count what they read through the cache (``storage.cache.STATS``) and send the counts
with each result (``StageTimes.node_cache``); the pool's result hook adds them here
(:func:`record_cache`), and the cache manager adds its prefetches' own.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from prometheus_client import Counter, Gauge, Histogram

from batchd_server.metrics.registry import REGISTRY, STAGE_BUCKETS, dataset_label

__all__ = [
    "CACHE_CAPACITY_BYTES",
    "CACHE_CORRUPT",
    "CACHE_EVICTED",
    "CACHE_FETCHED_BYTES",
    "CACHE_GET_SECONDS",
    "CACHE_HITS",
    "CACHE_MISSES",
    "CACHE_PREFETCH_LEAD",
    "CACHE_UNKEPT",
    "CACHE_USED_BYTES",
    "CacheCounts",
    "record_cache",
]


class CacheCounts(Protocol):
    """What a process read through the node cache since it last counted, as these metrics
    read it (``storage.cache.NodeCacheCounts`` is one; described here, not imported, so the
    metrics stay below the rooms they count)."""

    @property
    def hits(self) -> int: ...
    @property
    def misses(self) -> int: ...
    @property
    def fetched_bytes(self) -> int:
        """Bytes received from the store, prefetches included."""
        ...

    @property
    def prefetched_bytes(self) -> int: ...
    @property
    def corrupt(self) -> int: ...
    @property
    def unkept(self) -> int: ...
    @property
    def get_seconds(self) -> Sequence[float]: ...


CACHE_HITS = Counter(
    "batchd_cache_hits",
    "Cache blocks a worker found on the node's disk, intact.",
    ["dataset"],
    registry=REGISTRY,
)
CACHE_MISSES = Counter(
    "batchd_cache_misses",
    "Cache blocks a worker had to fetch from the object store.",
    ["dataset"],
    registry=REGISTRY,
)
CACHE_FETCHED_BYTES = Counter(
    "batchd_cache_fetched_bytes",
    "Bytes fetched from the object store, by reader (worker: a miss; prefetch: ahead).",
    ["reader"],
    registry=REGISTRY,
)
CACHE_CORRUPT = Counter(
    "batchd_cache_corrupt_blocks",
    "Cache block files found corrupt, truncated, unreadable or not regular files, removed "
    "and fetched again.",
    registry=REGISTRY,
)
CACHE_UNKEPT = Counter(
    "batchd_cache_unkept_blocks",
    "Missed cache blocks the full cache could not keep: only the ranges asked were fetched.",
    registry=REGISTRY,
)
CACHE_EVICTED = Counter(
    "batchd_cache_evicted_blocks",
    "Cache blocks deleted to make room (by the live sessions' plans).",
    registry=REGISTRY,
)
CACHE_GET_SECONDS = Histogram(
    "batchd_object_get_seconds",
    "Latency of one request (GET of byte ranges) to the object store.",
    buckets=STAGE_BUCKETS,
    registry=REGISTRY,
)
CACHE_PREFETCH_LEAD = Gauge(
    "batchd_cache_prefetch_lead_batches",
    "Batches ahead of a stream whose bytes are all cached (the least over the dataset's "
    "streams); up to --cache-prefetch-batches plus those being read.",
    ["dataset"],
    registry=REGISTRY,
)
CACHE_USED_BYTES = Gauge(
    "batchd_cache_used_bytes", "Bytes the cache's files take on disk.", registry=REGISTRY
)
CACHE_CAPACITY_BYTES = Gauge(
    "batchd_cache_capacity_bytes", "The cache's size bound (--cache-size).", registry=REGISTRY
)


def record_cache(dataset: str | None, counts: CacheCounts | None) -> None:
    """Add a process's cache counts: a worker's with its task's ``dataset``, the cache
    manager's prefetches with None."""
    if counts is None:
        return
    if dataset is not None:
        label = dataset_label(dataset)
        if counts.hits:
            CACHE_HITS.labels(dataset=label).inc(counts.hits)
        if counts.misses:
            CACHE_MISSES.labels(dataset=label).inc(counts.misses)
    worker = counts.fetched_bytes - counts.prefetched_bytes
    if worker:
        CACHE_FETCHED_BYTES.labels(reader="worker").inc(worker)
    if counts.prefetched_bytes:
        CACHE_FETCHED_BYTES.labels(reader="prefetch").inc(counts.prefetched_bytes)
    if counts.corrupt:
        CACHE_CORRUPT.inc(counts.corrupt)
    if counts.unkept:
        CACHE_UNKEPT.inc(counts.unkept)
    for seconds in counts.get_seconds:
        CACHE_GET_SECONDS.observe(max(0.0, seconds))
