"""The decode workers: how many are alive, how often they are replaced, and where their time
on each batch went.

Stall attribution, read top-down: ``batchd_batch_seconds`` is a batch's time from the
server's hand-off to a worker until its result; ``batchd_queue_wait_seconds`` is the part
before a worker began it (too few workers), ``batchd_stage_seconds{stage}`` the worker's own
time in reading, decoding and collating (which of them is slow). The workers measure those
themselves and send them back with each result (``workers.task.StageTimes``); the pool's
result hook, at the composition root, hands them to :func:`observe_batch` as plain numbers.
"""

from __future__ import annotations

from typing import Final

from prometheus_client import Counter, Gauge, Histogram

from batchd_server.metrics.registry import REGISTRY, STAGE_BUCKETS, dataset_label

__all__ = [
    "BATCH_SECONDS",
    "QUEUE_WAIT_SECONDS",
    "STAGES",
    "STAGE_SECONDS",
    "WORKERS_ALIVE",
    "WORKERS_CONFIGURED",
    "WORKERS_CRASH_LOOP",
    "WORKER_RESTARTS",
    "WORKER_TIMEOUTS",
    "observe_batch",
]

STAGES: Final = ("read", "decode", "collate")
"""The ``stage`` label's values: see ``workers.task.StageTimes``."""

WORKERS_ALIVE = Gauge("batchd_workers_alive", "Decode worker processes alive.", registry=REGISTRY)
WORKERS_CONFIGURED = Gauge(
    "batchd_workers_configured", "Decode worker processes configured.", registry=REGISTRY
)
WORKER_RESTARTS = Counter(
    "batchd_worker_restarts",
    "Decode workers replaced after dying or being killed (task deadline).",
    registry=REGISTRY,
)
WORKER_TIMEOUTS = Counter(
    "batchd_worker_task_timeouts",
    "Decode workers killed because a task ran past --task-timeout-s.",
    registry=REGISTRY,
)
WORKERS_CRASH_LOOP = Gauge(
    "batchd_workers_crash_loop",
    "1 while decode workers keep dying before they are ready (a crash loop), else 0.",
    registry=REGISTRY,
)
STAGE_SECONDS = Histogram(
    "batchd_stage_seconds",
    "A worker's time on one batch in one stage (read, decode, collate), as it measured it.",
    ["dataset", "stage"],
    buckets=STAGE_BUCKETS,
    registry=REGISTRY,
)
QUEUE_WAIT_SECONDS = Histogram(
    "batchd_queue_wait_seconds",
    "Time a batch waited after the server handed it to the pool until a worker began it.",
    ["dataset"],
    buckets=STAGE_BUCKETS,
    registry=REGISTRY,
)
BATCH_SECONDS = Histogram(
    "batchd_batch_seconds",
    "Time from handing a batch to the pool until its result was back (queue wait included).",
    ["dataset"],
    buckets=STAGE_BUCKETS,
    registry=REGISTRY,
)


def observe_batch(
    dataset: str,
    *,
    read_s: float,
    decode_s: float,
    collate_s: float,
    queued_s: float,
    latency_s: float,
) -> None:
    """Record one batch of ``dataset`` as its worker timed its stages, and its wait for a
    worker and its whole time as the server saw them."""
    dataset = dataset_label(dataset)
    for stage, seconds in zip(STAGES, (read_s, decode_s, collate_s), strict=True):
        STAGE_SECONDS.labels(dataset=dataset, stage=stage).observe(max(0.0, seconds))
    QUEUE_WAIT_SECONDS.labels(dataset=dataset).observe(max(0.0, queued_s))
    BATCH_SECONDS.labels(dataset=dataset).observe(max(0.0, latency_s))
