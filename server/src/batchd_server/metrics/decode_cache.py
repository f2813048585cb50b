"""The decode cache (``decode_cache/``): lookups by result, bytes written, and what each tier
holds, may hold and evicts."""

from __future__ import annotations

from typing import Protocol

from prometheus_client import Counter, Gauge

from batchd_server.metrics.registry import REGISTRY, dataset_label

__all__ = [
    "DECODE_CACHE_BYTES",
    "DECODE_CACHE_EVICTIONS",
    "DECODE_CACHE_LIMIT_BYTES",
    "DECODE_CACHE_LOOKUPS",
    "DECODE_CACHE_WRITTEN_BYTES",
    "Lookups",
    "record_lookups",
]


class Lookups(Protocol):
    """One batch's lookups in the decode cache, as these metrics read them
    (``decode_cache.worker.CacheCounts`` is one; described here, not imported)."""

    @property
    def hits(self) -> int: ...
    @property
    def misses(self) -> int: ...
    @property
    def corrupt(self) -> int: ...
    @property
    def written_bytes(self) -> int: ...


DECODE_CACHE_LOOKUPS = Counter(
    "batchd_decode_cache_lookups",
    "Decode cache lookups by dataset and result: hit, miss (decoded, then offered to the "
    "cache) or corrupt (an entry that did not check out, decoded again; also a miss).",
    ["dataset", "result"],
    registry=REGISTRY,
)
DECODE_CACHE_WRITTEN_BYTES = Counter(
    "batchd_decode_cache_written_bytes",
    "Bytes of decode cache entries written by the workers.",
    registry=REGISTRY,
)
DECODE_CACHE_BYTES = Gauge(
    "batchd_decode_cache_bytes",
    "Bytes the decode cache holds, by tier (shm, disk).",
    ["tier"],
    registry=REGISTRY,
)
DECODE_CACHE_LIMIT_BYTES = Gauge(
    "batchd_decode_cache_limit_bytes",
    "The decode cache's bound by tier (--decode-cache-size, --decode-cache-dir-size).",
    ["tier"],
    registry=REGISTRY,
)
DECODE_CACHE_EVICTIONS = Counter(
    "batchd_decode_cache_evictions",
    "Decode cache entries evicted, by tier (from shm they move to the disk tier, if any).",
    ["tier"],
    registry=REGISTRY,
)


def record_lookups(dataset: str, lookups: Lookups) -> None:
    """Add one batch's ``lookups`` in the decode cache of a session of ``dataset``."""
    label = dataset_label(dataset)
    for outcome, count in (("hit", lookups.hits), ("miss", lookups.misses)):
        DECODE_CACHE_LOOKUPS.labels(dataset=label, result=outcome).inc(count)
    if lookups.corrupt:
        DECODE_CACHE_LOOKUPS.labels(dataset=label, result="corrupt").inc(lookups.corrupt)
    DECODE_CACHE_WRITTEN_BYTES.inc(lookups.written_bytes)
