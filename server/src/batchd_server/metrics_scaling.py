"""The worker autoscaler's metrics (``--workers MIN..MAX``, see ``workers/sizing.py``), in the
process's registry beside the rest (``metrics.py``)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from prometheus_client import Counter, Gauge

from batchd_server.metrics import REGISTRY

if TYPE_CHECKING:
    from batchd_server.workers.sizing import Signals

__all__ = [
    "SCALING_SIGNAL",
    "WORKERS_MIN",
    "WORKERS_TARGET",
    "WORKER_SCALING",
    "record_scaling_signals",
    "record_worker_scaling",
]

WORKERS_MIN = Gauge(
    "batchd_workers_min",
    "The fewest decode workers --workers allows (equal to batchd_workers_configured when fixed).",
    registry=REGISTRY,
)
WORKERS_TARGET = Gauge(
    "batchd_workers_target",
    "Decode workers the pool runs now: --workers, or what the autoscaler chose within MIN..MAX.",
    registry=REGISTRY,
)
WORKER_SCALING = Counter(
    "batchd_worker_scaling",
    "Autoscaler changes of the pool's size, by direction (up, down) and reason (stall: "
    "trainers waited on queued work with idle cores; idle: a worker was not needed; limits: "
    "memory or CPUs no longer afford the size).",
    ["direction", "reason"],
    registry=REGISTRY,
)
SCALING_SIGNAL = Gauge(
    "batchd_worker_scaling_signal",
    "What the autoscaler last decided on, averaged over its growth window: busy (workers "
    "holding a task), queued (share of samples with work waiting for a worker), idle_cores, "
    "stall_ratio (-1: no client reported), ceiling (most workers allowed now).",
    ["signal"],
    registry=REGISTRY,
)


def record_worker_scaling(direction: str, reason: str) -> None:
    """One change of the pool's size by the autoscaler."""
    WORKER_SCALING.labels(direction=direction, reason=reason).inc()


def record_scaling_signals(signals: Signals) -> None:
    """The signals of the autoscaler's latest growth window."""
    stall = -1.0 if signals.stall_ratio is None else signals.stall_ratio
    for name, value in (
        ("busy", signals.busy),
        ("queued", signals.queued_share),
        ("idle_cores", signals.idle_cores),
        ("stall_ratio", stall),
        ("ceiling", float(signals.ceiling)),
    ):
        SCALING_SIGNAL.labels(signal=name).set(value)
