"""The worker autoscaler (``--workers MIN..MAX``, see ``workers/sizing.py``): its bounds, its
target, its changes and the signals it decided on."""

from __future__ import annotations

from typing import Protocol

from prometheus_client import Counter, Gauge

from batchd_server.metrics.registry import REGISTRY

__all__ = [
    "SCALING_SIGNAL",
    "WORKERS_MIN",
    "WORKERS_TARGET",
    "WORKER_SCALING",
    "Signals",
    "record_scaling_signals",
    "record_worker_scaling",
]


class Signals(Protocol):
    """What the autoscaler decided on, as these metrics read it (``workers.sizing.Signals``
    is one; described here, not imported, so the metrics stay below the workers)."""

    @property
    def busy(self) -> float: ...
    @property
    def queued_share(self) -> float: ...
    @property
    def idle_cores(self) -> float: ...
    @property
    def stall_ratio(self) -> float | None: ...
    @property
    def ceiling(self) -> int: ...


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
