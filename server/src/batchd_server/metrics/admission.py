"""What the server takes on and what it turns away: readiness, open sessions and streams,
calls refused by a limit, and the shared memory they hold."""

from __future__ import annotations

from prometheus_client import Counter, Gauge

from batchd_server.metrics.registry import REGISTRY

__all__ = [
    "READY",
    "REFUSED",
    "SESSIONS",
    "SHM_BUDGET_BYTES",
    "SHM_FREE_BYTES",
    "SHM_RESERVED_BYTES",
    "STREAMS",
]

READY = Gauge(
    "batchd_ready",
    "1 while the health service says SERVING (may take sessions), else 0.",
    registry=REGISTRY,
)
SESSIONS = Gauge("batchd_sessions", "Open sessions.", registry=REGISTRY)
STREAMS = Gauge("batchd_streams", "Open StreamBatches calls.", registry=REGISTRY)
REFUSED = Counter(
    "batchd_refused",
    "Calls and session opens refused with RESOURCE_EXHAUSTED, by the limit they hit "
    "(max_concurrent_rpcs, client_max_calls, max_sessions, client_max_sessions, "
    "client_shm_quota, client_plan_quota; open_calls_per_peer and open_calls for health probes).",
    ["limit"],
    registry=REGISTRY,
)
SHM_RESERVED_BYTES = Gauge(
    "batchd_shm_reserved_bytes", "Shared memory reserved by rings and catalogs.", registry=REGISTRY
)
SHM_FREE_BYTES = Gauge(
    "batchd_shm_free_bytes",
    "Bytes still free in the shared-memory filesystem (/dev/shm).",
    registry=REGISTRY,
)
SHM_BUDGET_BYTES = Gauge(
    "batchd_shm_budget_bytes",
    "The effective shm budget: --shm-budget, or less when /dev/shm cannot hold that much.",
    registry=REGISTRY,
)
