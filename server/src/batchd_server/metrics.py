"""Every Prometheus metric the server exports, in one place, in base units.

The metrics live in a registry of their own (not prometheus_client's global one) so that
several servers in one process, as in the tests, do not collide; :func:`serve` exposes it.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server

__all__ = [
    "BATCHES",
    "BYTES_SERVED",
    "CATALOG_LOAD_SECONDS",
    "CLIENT_WAIT_SECONDS",
    "REGISTRY",
    "SAMPLES",
    "SAMPLE_ERRORS",
    "SESSIONS",
    "SHM_RESERVED_BYTES",
    "STREAMS",
    "WORKERS_ALIVE",
    "WORKER_RESTARTS",
    "serve",
]

REGISTRY = CollectorRegistry(auto_describe=True)

BATCHES = Counter("batchd_batches", "Batches delivered to clients.", registry=REGISTRY)
SAMPLES = Counter("batchd_samples", "Samples delivered to clients.", registry=REGISTRY)
BYTES_SERVED = Counter(
    "batchd_served_bytes",
    "Batch bytes delivered, by transport.",
    ["transport"],
    registry=REGISTRY,
)
SAMPLE_ERRORS = Counter(
    "batchd_sample_errors", "Samples that failed to read or decode.", ["kind"], registry=REGISTRY
)
SESSIONS = Gauge("batchd_sessions", "Open sessions.", registry=REGISTRY)
STREAMS = Gauge("batchd_streams", "Open StreamBatches calls.", registry=REGISTRY)
SHM_RESERVED_BYTES = Gauge(
    "batchd_shm_reserved_bytes", "Shared memory reserved by rings and catalogs.", registry=REGISTRY
)
WORKERS_ALIVE = Gauge("batchd_workers_alive", "Decode worker processes alive.", registry=REGISTRY)
WORKER_RESTARTS = Counter(
    "batchd_worker_restarts", "Decode workers replaced after dying.", registry=REGISTRY
)
CATALOG_LOAD_SECONDS = Histogram(
    "batchd_catalog_load_seconds", "Time to load a split from the catalog.", registry=REGISTRY
)
CLIENT_WAIT_SECONDS = Counter(
    "batchd_client_wait_seconds",
    "Time training loops spent waiting for batches, as clients report it.",
    registry=REGISTRY,
)


def serve(port: int) -> None:
    """Serve ``/metrics`` on ``port`` (all interfaces) from a daemon thread."""
    start_http_server(port, registry=REGISTRY)
