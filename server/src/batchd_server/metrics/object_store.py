"""Whether the object store answers (``batchd_object_store_up``), as the session-open check
of ``s3://`` roots last saw it (``storage/roots.py``)."""

from __future__ import annotations

from prometheus_client import Gauge

from batchd_server.metrics.registry import REGISTRY

__all__ = ["OBJECT_STORE_UP"]

OBJECT_STORE_UP = Gauge(
    "batchd_object_store_up",
    "1 when the object store answered the last listing of a dataset root in this bucket at "
    "session open, 0 when it did not (sessions then read what the node cache holds).",
    ["bucket"],
    registry=REGISTRY,
)
