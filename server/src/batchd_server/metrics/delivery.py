"""A session's way to its batches: the catalog load at its open, its first batch, then every
batch, sample and byte handed to its clients, the samples that failed on the way, and the
batches a share group's member got from another member."""

from __future__ import annotations

from prometheus_client import Counter, Histogram

from batchd_server.metrics.registry import REGISTRY, SLOW_BUCKETS, dataset_label

__all__ = [
    "BATCHES",
    "BYTES_SERVED",
    "CATALOG_LOAD_SECONDS",
    "FIRST_BATCH_SECONDS",
    "SAMPLES",
    "SAMPLE_ERRORS",
    "SHARED_BATCHES",
    "record_catalog_load",
    "record_delivery",
    "record_sample_error",
    "record_shared_batch",
]

BATCHES = Counter("batchd_batches", "Batches delivered to clients.", ["dataset"], registry=REGISTRY)
SAMPLES = Counter("batchd_samples", "Samples delivered to clients.", ["dataset"], registry=REGISTRY)
BYTES_SERVED = Counter(
    "batchd_served_bytes",
    "Batch bytes delivered, by transport.",
    ["transport"],
    registry=REGISTRY,
)
SAMPLE_ERRORS = Counter(
    "batchd_sample_errors",
    "Samples that failed to read or decode, by dataset and kind of failure.",
    ["dataset", "kind"],
    registry=REGISTRY,
)
CATALOG_LOAD_SECONDS = Histogram(
    "batchd_catalog_load_seconds",
    "Time to load a split's rows from the catalog into shared memory.",
    ["dataset"],
    buckets=SLOW_BUCKETS,
    registry=REGISTRY,
)
FIRST_BATCH_SECONDS = Histogram(
    "batchd_first_batch_seconds",
    "Time from a session's open to its first batch delivered.",
    ["dataset"],
    buckets=SLOW_BUCKETS,
    registry=REGISTRY,
)
# Share groups (``sessions/share.py``): batches a member got as a copy of another member's
# decoded batch, not from a worker of its own.
SHARED_BATCHES = Counter(
    "batchd_shared_batches",
    "Batches a session of a share group got from another member instead of decoding: "
    "read in that member's slot (how=read) or copied into its own (how=copied).",
    ["dataset", "how"],
    registry=REGISTRY,
)


def record_delivery(dataset: str, rows: int, *, since_open_s: float | None = None) -> None:
    """Count one batch of ``rows`` handed to a client; ``since_open_s`` for a session's first."""
    dataset = dataset_label(dataset)
    BATCHES.labels(dataset=dataset).inc()
    SAMPLES.labels(dataset=dataset).inc(rows)
    if since_open_s is not None:
        FIRST_BATCH_SECONDS.labels(dataset=dataset).observe(max(0.0, since_open_s))


def record_sample_error(dataset: str, kind: str) -> None:
    """Count one sample of ``dataset`` that failed with ``kind``."""
    SAMPLE_ERRORS.labels(dataset=dataset_label(dataset), kind=kind).inc()


def record_catalog_load(dataset: str, seconds: float) -> None:
    """Observe one split of ``dataset`` loaded from the catalog in ``seconds``."""
    CATALOG_LOAD_SECONDS.labels(dataset=dataset_label(dataset)).observe(max(0.0, seconds))


def record_shared_batch(dataset: str, *, how: str) -> None:
    """Count one batch of ``dataset`` shared within a share group, ``how``: read or copied."""
    SHARED_BATCHES.labels(dataset=dataset_label(dataset), how=how).inc()
