"""Planning's costs (``batchd_plan_*``): how long building an epoch's plan took, and how
often a packed session's placement came from the cache shared by the sessions of one
dataset (``planning/placement_cache.py``)."""

from __future__ import annotations

from prometheus_client import Counter, Histogram

from batchd_server.metrics.registry import REGISTRY

__all__ = ["PLACEMENTS", "PLAN_SECONDS"]

PLAN_SECONDS = Histogram(
    "batchd_plan_seconds",
    "Seconds building one epoch's plan of a session took (an open plans its first epoch).",
    buckets=(0.001, 0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0),
    registry=REGISTRY,
)
PLACEMENTS = Counter(
    "batchd_plan_placements",
    "Packed sources' placements (where each document's remainder goes, from the lengths "
    "alone), by result: hit (reused from another session with the same lengths) or miss "
    "(placed anew).",
    ["result"],
    registry=REGISTRY,
)
