"""Every Prometheus metric the server exports, in one place, in base units.

The metrics live in a registry of their own (not prometheus_client's global one) so that
several servers in one process, as in the tests, do not collide; :func:`serve` exposes it.

Labels are bounded by what an operator configures: ``dataset`` (a catalog name, or a mix's
names sorted and joined by ``+``), ``stage``, ``kind`` (of sample error), ``transport``.
Never a session, rank or sample id: those would make a new series per job and grow
Prometheus without bound. Clients choose which datasets they mix, so ``dataset`` is capped
besides (:func:`dataset_label`): past :data:`MAX_DATASET_LABELS` distinct values, a new one
is reported as :data:`OTHER_DATASET`.

A mix's sources (``batchd_mix_*_total``) are labelled ``dataset`` (the mix's label) and
``source`` (a source's ``dataset:split``, ``@version`` when pinned), capped the same way
(:data:`MAX_SOURCE_LABELS`, then :data:`OTHER_DATASET`): served samples and tokens per
source beside the samples its weights (and schedule) expected (:func:`record_mix_batch`).

Stall attribution, read top-down: ``batchd_batch_seconds`` is a batch's time from the
server's hand-off to a worker until its result; ``batchd_queue_wait_seconds`` is the part
before a worker began it (too few workers), ``batchd_stage_seconds{stage}`` the worker's own
time in reading, decoding and collating (which of them is slow). The workers measure those
themselves and send them back with each result (``workers.task.StageTimes``).

NOTE [ Client wait histogram ]
Whether the GPU starves is known only in the trainer: each client measures, per batch, how
long ``next()`` blocked (wait) and how long the loop worked before asking for it (step), and
sends those pairs with its acks (``Ack.batch_wait_s`` / ``batch_step_s``). Each pair is one
observation of ``batchd_client_wait_seconds`` and ``batchd_client_step_seconds`` and feeds
``batchd_data_stall_ratio`` (wait / (wait + step) over the last minute), per dataset.
Values are clamped (:func:`clamp_client_seconds`): a client cannot poison the aggregates.
A dataset no client reported on for a whole minute has no ratio: its window and its series
are dropped (:class:`StallRatios`), so finished jobs neither hold memory nor show a stale one.
"""

from __future__ import annotations

import contextlib
import itertools
import math
import threading
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Final

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server

if TYPE_CHECKING:
    from wsgiref.simple_server import WSGIServer

    from batchd_server.workers.task import BatchResult, BatchTask

__all__ = [
    "BATCHES",
    "BATCH_SECONDS",
    "BYTES_SERVED",
    "CATALOG_LOAD_SECONDS",
    "CLIENT_STEP_SECONDS",
    "CLIENT_WAIT_SECONDS",
    "DATA_STALL_RATIO",
    "FIRST_BATCH_SECONDS",
    "MAX_CLIENT_SECONDS",
    "MAX_DATASET_LABELS",
    "MAX_SOURCE_LABELS",
    "MAX_TIMINGS_PER_ACK",
    "MIX_EXPECTED_SAMPLES",
    "MIX_SAMPLES",
    "MIX_TOKENS",
    "OTHER_DATASET",
    "QUEUE_WAIT_SECONDS",
    "READY",
    "RECENT_STALL",
    "REGISTRY",
    "SAMPLES",
    "SAMPLE_ERRORS",
    "SESSIONS",
    "SHM_BUDGET_BYTES",
    "SHM_FREE_BYTES",
    "SHM_RESERVED_BYTES",
    "STAGES",
    "STAGE_SECONDS",
    "STALL_RATIOS",
    "STREAMS",
    "WORKERS_ALIVE",
    "WORKERS_CONFIGURED",
    "WORKERS_CRASH_LOOP",
    "WORKER_RESTARTS",
    "WORKER_TIMEOUTS",
    "LabelValues",
    "MetricsEndpoint",
    "StallRatios",
    "StallWindow",
    "clamp_client_seconds",
    "dataset_label",
    "observe_worker_result",
    "record_catalog_load",
    "record_client_batch",
    "record_client_timings",
    "record_delivery",
    "record_mix_batch",
    "record_sample_error",
    "serve",
]

REGISTRY = CollectorRegistry(auto_describe=True)

STAGES: Final = ("read", "decode", "collate")
"""The ``stage`` label's values: see ``workers.task.StageTimes``."""

# A batch's stages take from tens of microseconds (a few raw records) to seconds (64 large
# JPEGs on a busy core); catalog loads and first batches take up to minutes (millions of rows).
_STAGE_BUCKETS: Final = (
    0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05,
    0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0,
)  # fmt: skip
_SLOW_BUCKETS: Final = (
    0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0,
)  # fmt: skip
_CLIENT_BUCKETS: Final = (
    0.0001, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05,
    0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0,
)  # fmt: skip

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
SESSIONS = Gauge("batchd_sessions", "Open sessions.", registry=REGISTRY)
STREAMS = Gauge("batchd_streams", "Open StreamBatches calls.", registry=REGISTRY)
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
REFUSED = Counter(
    "batchd_refused",
    "Calls and session opens refused with RESOURCE_EXHAUSTED, by the limit they hit "
    "(max_concurrent_rpcs, client_max_calls, max_sessions, client_max_sessions, "
    "client_shm_quota; open_calls_per_peer and open_calls for health probes).",
    ["limit"],
    registry=REGISTRY,
)
WORKERS_CRASH_LOOP = Gauge(
    "batchd_workers_crash_loop",
    "1 while decode workers keep dying before they are ready (a crash loop), else 0.",
    registry=REGISTRY,
)
READY = Gauge(
    "batchd_ready",
    "1 while the health service says SERVING (may take sessions), else 0.",
    registry=REGISTRY,
)
CATALOG_LOAD_SECONDS = Histogram(
    "batchd_catalog_load_seconds",
    "Time to load a split's rows from the catalog into shared memory.",
    ["dataset"],
    buckets=_SLOW_BUCKETS,
    registry=REGISTRY,
)
STAGE_SECONDS = Histogram(
    "batchd_stage_seconds",
    "A worker's time on one batch in one stage (read, decode, collate), as it measured it.",
    ["dataset", "stage"],
    buckets=_STAGE_BUCKETS,
    registry=REGISTRY,
)
QUEUE_WAIT_SECONDS = Histogram(
    "batchd_queue_wait_seconds",
    "Time a batch waited after the server handed it to the pool until a worker began it.",
    ["dataset"],
    buckets=_STAGE_BUCKETS,
    registry=REGISTRY,
)
BATCH_SECONDS = Histogram(
    "batchd_batch_seconds",
    "Time from handing a batch to the pool until its result was back (queue wait included).",
    ["dataset"],
    buckets=_STAGE_BUCKETS,
    registry=REGISTRY,
)
FIRST_BATCH_SECONDS = Histogram(
    "batchd_first_batch_seconds",
    "Time from a session's open to its first batch delivered.",
    ["dataset"],
    buckets=_SLOW_BUCKETS,
    registry=REGISTRY,
)
CLIENT_WAIT_SECONDS = Histogram(
    "batchd_client_wait_seconds",
    "Time a training loop's next() blocked for a batch, per batch, as clients report it.",
    ["dataset"],
    buckets=_CLIENT_BUCKETS,
    registry=REGISTRY,
)
CLIENT_STEP_SECONDS = Histogram(
    "batchd_client_step_seconds",
    "Time a training loop spent between two batches (its step), per batch, as clients report it.",
    ["dataset"],
    buckets=_CLIENT_BUCKETS,
    registry=REGISTRY,
)
DATA_STALL_RATIO = Gauge(
    "batchd_data_stall_ratio",
    "Share of training-loop time spent waiting for data over the last minute: "
    "wait / (wait + step). Near 0: the loader keeps up; near 1: the GPU starves.",
    ["dataset"],
    registry=REGISTRY,
)
# -- the decode cache (decode_cache/) --
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

MAX_CLIENT_SECONDS: Final = 3600.0
"""A client-reported duration is clamped to this: one batch never takes an hour to wait for."""
MAX_DATASET_LABELS: Final = 128
"""Distinct values of the ``dataset`` label a process reports; each costs about 160 series
(the histograms' buckets), so the cap keeps a server under about 20,000 of them."""
OTHER_DATASET: Final = "other"
"""The ``dataset`` label of every dataset or mix served after :data:`MAX_DATASET_LABELS`."""


class LabelValues:
    """The values one label takes: the first ``limit`` distinct ones as they come, every
    later one as ``other``. A value once admitted stays (its series exist). Thread-safe."""

    def __init__(self, limit: int, other: str) -> None:
        if limit < 1:
            raise ValueError(f"limit={limit} must be >= 1")
        self.limit = limit
        self.other = other
        self._admitted: set[str] = set()
        self._lock = threading.Lock()

    def __call__(self, value: str) -> str:
        """``value`` as the label reports it."""
        with self._lock:
            if value in self._admitted:
                return value
            if len(self._admitted) < self.limit:
                self._admitted.add(value)
                return value
        return self.other


_DATASET_LABELS: Final = LabelValues(MAX_DATASET_LABELS, OTHER_DATASET)


def dataset_label(dataset: str) -> str:
    """``dataset`` (a catalog name or a mix's label) as the ``dataset`` label reports it:
    itself, or :data:`OTHER_DATASET` once :data:`MAX_DATASET_LABELS` others were seen."""
    return _DATASET_LABELS(dataset)


def observe_worker_result(
    task: BatchTask, result: BatchResult, queued_s: float, latency_s: float
) -> None:
    """Record a worker's timings of one batch (the pool's ``on_result``)."""
    dataset = dataset_label(task.spec.dataset)
    times = result.times
    for stage, seconds in zip(STAGES, (times.read_s, times.decode_s, times.collate_s), strict=True):
        STAGE_SECONDS.labels(dataset=dataset, stage=stage).observe(max(0.0, seconds))
    QUEUE_WAIT_SECONDS.labels(dataset=dataset).observe(max(0.0, queued_s))
    BATCH_SECONDS.labels(dataset=dataset).observe(max(0.0, latency_s))
    cache = result.cache
    if task.spec.decode_cache is not None:
        for outcome, count in (("hit", cache.hits), ("miss", cache.misses)):
            DECODE_CACHE_LOOKUPS.labels(dataset=dataset, result=outcome).inc(count)
        if cache.corrupt:
            DECODE_CACHE_LOOKUPS.labels(dataset=dataset, result="corrupt").inc(cache.corrupt)
        DECODE_CACHE_WRITTEN_BYTES.inc(cache.written_bytes)


def record_delivery(dataset: str, rows: int, *, since_open_s: float | None = None) -> None:
    """Count one batch of ``rows`` handed to a client; ``since_open_s`` for a session's first."""
    dataset = dataset_label(dataset)
    BATCHES.labels(dataset=dataset).inc()
    SAMPLES.labels(dataset=dataset).inc(rows)
    if since_open_s is not None:
        FIRST_BATCH_SECONDS.labels(dataset=dataset).observe(max(0.0, since_open_s))


MIX_SAMPLES = Counter(
    "batchd_mix_samples",
    "Samples of each source of a mix delivered to clients.",
    ["dataset", "source"],
    registry=REGISTRY,
)
MIX_TOKENS = Counter(
    "batchd_mix_tokens",
    "Tokens (before padding) of each source of a mix delivered to clients; token pipelines.",
    ["dataset", "source"],
    registry=REGISTRY,
)
MIX_EXPECTED_SAMPLES = Counter(
    "batchd_mix_expected_samples",
    "Samples of each source of a mix that its weights in force expected of the batches "
    "delivered (rows times the source's share at each batch's step).",
    ["dataset", "source"],
    registry=REGISTRY,
)
MAX_SOURCE_LABELS: Final = 256
"""Distinct values of the ``source`` label a process reports (3 plain counters each)."""
_SOURCE_LABELS: Final = LabelValues(MAX_SOURCE_LABELS, OTHER_DATASET)


def record_mix_batch(
    dataset: str,
    sources: Sequence[str],
    samples: Sequence[int],
    tokens: Sequence[int] | None,
    expected: Sequence[float],
) -> None:
    """Count one delivered batch of the mix ``dataset``: each source's ``samples`` (and
    ``tokens``, for token pipelines) and the samples its share ``expected``."""
    dataset = dataset_label(dataset)
    for i, source in enumerate(sources):
        label = _SOURCE_LABELS(source)
        MIX_SAMPLES.labels(dataset=dataset, source=label).inc(samples[i])
        MIX_EXPECTED_SAMPLES.labels(dataset=dataset, source=label).inc(max(0.0, expected[i]))
        if tokens is not None:
            MIX_TOKENS.labels(dataset=dataset, source=label).inc(tokens[i])


def record_sample_error(dataset: str, kind: str) -> None:
    """Count one sample of ``dataset`` that failed with ``kind``."""
    SAMPLE_ERRORS.labels(dataset=dataset_label(dataset), kind=kind).inc()


def record_catalog_load(dataset: str, seconds: float) -> None:
    """Observe one split of ``dataset`` loaded from the catalog in ``seconds``."""
    CATALOG_LOAD_SECONDS.labels(dataset=dataset_label(dataset)).observe(max(0.0, seconds))


def clamp_client_seconds(value: float) -> float:
    """A duration a client reported, made safe to aggregate: NaN and negatives are 0, and
    infinities and absurd values are :data:`MAX_CLIENT_SECONDS`."""
    if math.isnan(value) or value <= 0.0:
        return 0.0
    return min(value, MAX_CLIENT_SECONDS)


class StallWindow:
    """The data-stall ratio ``wait / (wait + step)`` over the last ``window_s`` seconds.

    Pure bookkeeping: the caller passes the clock, so it is tested without sleeping.
    Thread-safe.
    """

    def __init__(self, window_s: float = 60.0) -> None:
        if not window_s > 0:
            raise ValueError(f"window_s={window_s} must be > 0")
        self.window_s = window_s
        self._entries: deque[tuple[float, float, float]] = deque()
        self._wait_s = 0.0
        self._step_s = 0.0
        self._lock = threading.Lock()

    def add(self, now: float, wait_s: float, step_s: float) -> None:
        """One batch: the loop waited ``wait_s`` for it and then stepped for ``step_s``."""
        wait_s, step_s = clamp_client_seconds(wait_s), clamp_client_seconds(step_s)
        with self._lock:
            self._entries.append((now, wait_s, step_s))
            self._wait_s += wait_s
            self._step_s += step_s
            self._expire(now)

    def empty(self, now: float) -> bool:
        """Whether no batch of the window ending at ``now`` is left."""
        with self._lock:
            self._expire(now)
            return not self._entries

    def ratio(self, now: float) -> float | None:
        """The ratio over the window ending at ``now``; None when it holds no time at all."""
        with self._lock:
            self._expire(now)
            if not self._entries:
                # Re-sum from nothing: floating-point residue must not outlive the entries.
                self._wait_s = self._step_s = 0.0
                return None
            total = self._wait_s + self._step_s
            return None if total <= 0.0 else min(1.0, max(0.0, self._wait_s / total))

    def _expire(self, now: float) -> None:
        horizon = now - self.window_s
        while self._entries and self._entries[0][0] <= horizon:
            _, wait_s, step_s = self._entries.popleft()
            self._wait_s -= wait_s
            self._step_s -= step_s


class StallRatios:
    """A :class:`StallWindow` per ``dataset`` label, each setting its series of ``gauge``.

    A window that holds no batch (nobody reported on its dataset for ``window_s``) is
    dropped with its series, looked for at most once per ``window_s`` (of the callers'
    clock): memory follows the datasets being trained on, not every one ever served.
    Thread-safe.
    """

    def __init__(self, gauge: Gauge, window_s: float = 60.0) -> None:
        self._gauge = gauge
        self.window_s = window_s
        self._windows: dict[str, StallWindow] = {}
        self._lock = threading.Lock()
        self._swept: float | None = None

    def __len__(self) -> int:
        with self._lock:
            return len(self._windows)

    def add(self, dataset: str, wait_s: float, step_s: float, *, now: float) -> None:
        """One batch of ``dataset`` (a label value): the loop waited, then stepped."""
        with self._lock:
            window = self._windows.get(dataset)
            if window is None:
                window = self._windows[dataset] = StallWindow(self.window_s)
            window.add(now, wait_s, step_s)
            ratio = window.ratio(now)
            if ratio is not None:
                self._gauge.labels(dataset=dataset).set(ratio)
            # Either way round: a caller's clock that jumps back must not stop the sweeps.
            if self._swept is None or abs(now - self._swept) >= self.window_s:
                self._swept = now
                self._sweep(now)

    def _sweep(self, now: float) -> None:
        for dataset in [d for d, w in self._windows.items() if w.empty(now)]:
            del self._windows[dataset]
            with contextlib.suppress(KeyError):  # never set: no time in the window at all
                self._gauge.remove(dataset)


STALL_RATIOS: Final = StallRatios(DATA_STALL_RATIO)
"""The process's stall windows, behind ``batchd_data_stall_ratio``."""


class RecentStall:
    """The stall ratio of every client together over the last few seconds: the demand the
    worker autoscaler reacts to (a minute, as the gauge shows, is too slow to act on)."""

    def __init__(self, window_s: float = 5.0) -> None:
        self._window = StallWindow(window_s)

    def add(self, wait_s: float, step_s: float, *, now: float) -> None:
        self._window.add(now, wait_s, step_s)

    def current(self) -> float | None:
        """The ratio over the window ending now (``time.monotonic``); None with no reports."""
        return self._window.ratio(time.monotonic())


RECENT_STALL: Final = RecentStall()


def record_client_batch(dataset: str, wait_s: float, step_s: float, *, now: float) -> None:
    """One batch as a client reported it (see NOTE [ Client wait histogram ])."""
    dataset = dataset_label(dataset)
    wait_s, step_s = clamp_client_seconds(wait_s), clamp_client_seconds(step_s)
    CLIENT_WAIT_SECONDS.labels(dataset=dataset).observe(wait_s)
    CLIENT_STEP_SECONDS.labels(dataset=dataset).observe(step_s)
    STALL_RATIOS.add(dataset, wait_s, step_s, now=now)
    RECENT_STALL.add(wait_s, step_s, now=now)


MAX_TIMINGS_PER_ACK: Final = 4096
"""Batch timings one ack may carry; more is a broken client, and the rest are ignored."""


def record_client_timings(
    dataset: str, waits: Sequence[float], steps: Sequence[float], *, now: float
) -> None:
    """The per-batch timings of one ack (pairs up to the shorter list, at most
    MAX_TIMINGS_PER_ACK)."""
    for wait_s, step_s in itertools.islice(zip(waits, steps, strict=False), MAX_TIMINGS_PER_ACK):
        record_client_batch(dataset, wait_s, step_s, now=now)


@dataclass
class MetricsEndpoint:
    """A running ``/metrics`` HTTP server; :meth:`close` stops it."""

    host: str
    port: int
    _httpd: WSGIServer

    @property
    def address(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{host}:{self.port}"

    def close(self) -> None:
        self._httpd.shutdown()
        self._httpd.server_close()


def serve(host: str, port: int) -> MetricsEndpoint:
    """Serve ``/metrics`` on ``host:port`` (port 0: a free one) from a daemon thread.

    Raises:
        OSError: the address cannot be bound.
    """
    httpd, _thread = start_http_server(port, addr=host, registry=REGISTRY)
    return MetricsEndpoint(host, int(httpd.server_address[1]), httpd)


# Share groups (``sessions/share.py``): batches a member got as a copy of another member's
# decoded batch, not from a worker of its own.
SHARED_BATCHES = Counter(
    "batchd_shared_batches",
    "Batches a session of a share group got from another member instead of decoding: "
    "read in that member's slot (how=read) or copied into its own (how=copied).",
    ["dataset", "how"],
    registry=REGISTRY,
)


def record_shared_batch(dataset: str, *, how: str) -> None:
    """Count one batch of ``dataset`` shared within a share group, ``how``: read or copied."""
    SHARED_BATCHES.labels(dataset=dataset_label(dataset), how=how).inc()
