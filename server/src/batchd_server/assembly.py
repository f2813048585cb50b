"""The composition root: the one place that builds the server's parts from a
:class:`~batchd_server.config.ServerConfig` and wires them together (the catalog engine,
shared memory, the decode workers, the catalog cache, the sample-error writer, the session
manager, the doorbell, the health monitor and the metrics endpoint), and the one place that
takes them down again, in the reverse order.

It imports no gRPC: grpcio is not fork-safe, and the decode workers are started here before
any gRPC object exists. ``api/server.py`` puts the gRPC face (servicer, health service,
admission, credentials, the listener) over the :class:`Parts` built here.
"""

from __future__ import annotations

import contextlib
import functools
import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from batchd_server.cache_policy.manager import CacheManager
from batchd_server.catalog.db import SERVING_STATEMENT_TIMEOUT_S, make_engine, ping
from batchd_server.catalog.sample_errors import SampleErrorWriter
from batchd_server.catalog_cache import CatalogCache
from batchd_server.config import ServerConfig, available_cpus
from batchd_server.decode_cache import DecodeCacheOwner
from batchd_server.delivery.doorbell import DoorbellServer
from batchd_server.errors import FailedPrecondition
from batchd_server.health import HealthMonitor, HealthReport
from batchd_server.metrics import admission as admission_metrics
from batchd_server.metrics import decode_cache as decode_cache_metrics
from batchd_server.metrics import node_cache as node_cache_metrics
from batchd_server.metrics import scaling as scaling_metrics
from batchd_server.metrics import stall as stall_metrics
from batchd_server.metrics import workers as worker_metrics
from batchd_server.metrics.endpoint import MetricsEndpoint, serve
from batchd_server.sessions import SessionManager
from batchd_server.sessions.cache_reads import start_cache_manager
from batchd_server.settings import setting_of
from batchd_server.shm import PREFIX, ShmRegistry
from batchd_server.shm.space import shm_space
from batchd_server.storage.open import make_fetcher
from batchd_server.storage.options import StoreOptions
from batchd_server.storage.roots import STORE_STATUS
from batchd_server.workers.pool import WorkerPool
from batchd_server.workers.sizing import Autoscaler
from batchd_server.workers.task import BatchResult, BatchTask, ReadOptions

if TYPE_CHECKING:  # only catalog/ imports SQLAlchemy
    from batchd_server.catalog.db import Engine

__all__ = ["Parts", "assemble"]

_MONITOR_STOP_S = 1.0
"""The most a shutdown waits for the health monitor's thread, in seconds."""


@dataclass
class Parts:
    """What a server owns besides gRPC, in the order it is built (and reversed to close)."""

    engine: Engine
    registry: ShmRegistry
    pool: WorkerPool
    catalog: CatalogCache
    sessions: SessionManager
    doorbell: DoorbellServer
    monitor: HealthMonitor
    sample_errors: SampleErrorWriter
    metrics_endpoint: MetricsEndpoint | None = None
    cache: CacheManager | None = None
    """The node cache's manager (``--cache-dir``)."""
    autoscaler: Autoscaler | None = None
    """Sizes the pool by demand when ``--workers`` is a range MIN..MAX."""
    decode_cache: DecodeCacheOwner | None = None

    def end_sessions(self, timeout_s: float) -> None:
        """End every stream and session at once (the doorbell's too), freeing their rings."""
        self.doorbell.close()
        self.sessions.close_all(timeout_s=timeout_s)

    def close(self, timeout_s: float = 5.0) -> None:
        """Stop everything within about ``timeout_s`` seconds (stuck workers are killed)."""
        deadline = time.monotonic() + timeout_s

        def left() -> float:
            return max(0.0, deadline - time.monotonic())

        try:
            # The probing thread is a daemon: a probe stuck in the database driver is left to
            # end with the process rather than taking the sessions' and workers' grace.
            self.monitor.stop(min(left(), _MONITOR_STOP_S))
            if self.metrics_endpoint is not None:
                self.metrics_endpoint.close()
            self.end_sessions(left())
            if self.cache is not None:
                self.cache.close()
            self.catalog.close()
            self.sample_errors.close()
        finally:
            try:
                if self.autoscaler is not None:
                    self.autoscaler.stop()
                self.pool.stop(timeout_s=left())
            finally:
                try:
                    if self.decode_cache is not None:
                        self.decode_cache.close()  # after the workers: none writes any more
                finally:
                    try:
                        self.registry.close()
                    finally:
                        self.engine.dispose()


def _observe_result(
    task: BatchTask, result: BatchResult, queued_s: float, latency_s: float
) -> None:
    """The pool's result hook: a batch's timings, its decode cache lookups and what its
    worker read through the node cache, taken out of the task and its result here (the
    metrics know neither)."""
    dataset = task.spec.dataset
    times = result.times
    worker_metrics.observe_batch(
        dataset,
        read_s=times.read_s,
        decode_s=times.decode_s,
        collate_s=times.collate_s,
        queued_s=queued_s,
        latency_s=latency_s,
    )
    if task.spec.decode_cache is not None:
        decode_cache_metrics.record_lookups(dataset, result.cache)
    node_cache_metrics.record_cache(dataset, times.node_cache)


def _start_workers(config: ServerConfig, registry: ShmRegistry) -> WorkerPool:
    pool = WorkerPool(
        config.workers.min,
        task_timeout_s=config.task_timeout_s,
        on_restart=worker_metrics.WORKER_RESTARTS.inc,
        on_timeout=worker_metrics.WORKER_TIMEOUTS.inc,
        on_result=_observe_result,
    )
    pool.start()
    worker_metrics.WORKERS_ALIVE.set_function(lambda: pool.alive)
    worker_metrics.WORKERS_CONFIGURED.set(config.workers.max)
    scaling_metrics.WORKERS_MIN.set(config.workers.min)
    scaling_metrics.WORKERS_TARGET.set_function(lambda: pool.size)
    worker_metrics.WORKERS_CRASH_LOOP.set_function(lambda: pool.crash_loop is not None)
    admission_metrics.SHM_RESERVED_BYTES.set_function(registry.reserved_bytes)
    admission_metrics.SHM_FREE_BYTES.set_function(registry.free_bytes)
    admission_metrics.SHM_BUDGET_BYTES.set_function(registry.effective_budget_bytes)
    return pool


_DECODE_CACHE = "the decode cache"
_DECODE_CACHE_FLAG = f"{setting_of(ServerConfig, 'decode_cache_bytes').flag}"


def _check_decode_cache_room(config: ServerConfig, budget_bytes: int) -> None:
    """Refuse to start when the decode cache leaves the shm budget (``budget_bytes``, the
    one the server uses) too little for one session, which every session would otherwise
    find out one by one.

    Raises:
        FailedPrecondition: it does, saying what to change.
    """
    if not config.decode_cache_bytes:
        return
    problem = config.set_aside_problem(
        budget_bytes, config.decode_cache_bytes, purpose=_DECODE_CACHE, flag=_DECODE_CACHE_FLAG
    )
    if problem is not None:
        raise FailedPrecondition(problem)


def _start_decode_cache(config: ServerConfig, registry: ShmRegistry) -> DecodeCacheOwner | None:
    """The decode cache's tiers, its bytes taken from the shm budget; None without one."""
    size = config.decode_cache_bytes
    if not size:
        return None
    evictions = decode_cache_metrics.DECODE_CACHE_EVICTIONS
    owner = DecodeCacheOwner(
        shm_dir=registry.shm_dir,
        instance=registry.instance,
        size_bytes=size,
        disk_dir=config.decode_cache_dir,
        disk_bytes=config.decode_cache_dir_bytes or 4 * size,
        on_evict=lambda tier, n: evictions.labels(tier=tier).inc(n),
    )
    try:
        purpose = f"{_DECODE_CACHE} ({_DECODE_CACHE_FLAG})"
        registry.set_aside(size, purpose=purpose, used=owner.used_bytes)
    except BaseException:
        owner.close()
        raise
    for tier in ("shm", "disk") if owner.disk is not None else ("shm",):
        bound = owner.shm if tier == "shm" else owner.disk
        assert bound is not None
        decode_cache_metrics.DECODE_CACHE_BYTES.labels(tier=tier).set_function(
            functools.partial(owner.used_bytes, tier)
        )
        decode_cache_metrics.DECODE_CACHE_LIMIT_BYTES.labels(tier=tier).set(bound.limit_bytes)
    owner.start()
    return owner


def _shm_size_bytes(config: ServerConfig) -> int | None:
    """The shm directory's size, which the shm defaults follow (``ServerConfig.shm_limits``);
    None when it cannot be read (``ShmRegistry`` then says what is wrong with it)."""
    try:
        return shm_space(config.shm_dir).size_bytes
    except OSError:
        return None


def assemble(config: ServerConfig, *, on_health_change: Callable[[HealthReport], None]) -> Parts:
    """Build and start every part ``config`` asks for: the catalog engine, shared memory
    (sweeping what a dead earlier run left), then the workers, then the session machinery,
    the metrics endpoint and the health checks, whose every new report goes to
    ``on_health_change``. What was built is undone when a later step fails.

    Raises:
        FailedPrecondition: the metrics address cannot be bound, or the decode cache leaves
            the shm budget too little for a session.
    """
    shm = config.shm_limits(_shm_size_bytes(config))
    _check_decode_cache_room(config, shm.budget_bytes)
    engine = make_engine(config.database_url, statement_timeout_s=SERVING_STATEMENT_TIMEOUT_S)
    # Until the parts are whole, each step's undo is pushed as it is built and a failure
    # unwinds them in reverse; then Parts.close takes over.
    with contextlib.ExitStack() as undo:
        undo.callback(engine.dispose)
        registry = ShmRegistry(budget_bytes=shm.budget_bytes, shm_dir=config.shm_dir)
        undo.callback(registry.close)
        after_workers = undo.enter_context(contextlib.ExitStack())
        pool = _start_workers(config, registry)
        undo.callback(pool.stop)
        decode_cache = _start_decode_cache(config, registry)
        if decode_cache is not None:
            after_workers.callback(decode_cache.close)  # once the workers stop writing to it
        catalog = CatalogCache(engine, registry)
        sample_errors = SampleErrorWriter(engine)
        undo.callback(sample_errors.close)
        undo.callback(catalog.close)
        bell_path = registry.shm_dir / f"{PREFIX}-{registry.instance}-bell-{secrets.token_hex(16)}"
        store = StoreOptions(
            retry_s=config.object_store_retry_s,
            cache_dir=None if config.cache_dir is None else str(config.cache_dir),
            cache_size_bytes=config.cache_size_bytes,
            list_cache_s=config.object_store_list_cache_s,
        )
        sessions = SessionManager(
            catalog=catalog,
            pool=pool,
            registry=registry,
            limits=config,
            client_shm_quota_bytes=shm.client_quota_bytes,
            record_errors=sample_errors.submit,
            doorbell=bell_path.name,
            read=ReadOptions(
                max_sample_bytes=config.max_sample_bytes,
                store=store,
                decode_cache=decode_cache.spec if decode_cache is not None else None,
            ),
        )
        undo.callback(sessions.close_all)
        if decode_cache is not None:
            decode_cache.live_roots = sessions.live_roots
        monitor = HealthMonitor(
            space=registry.space,
            min_free_shm_bytes=config.min_free_shm_bytes,
            catalog_probe=lambda: ping(engine),
            catalog_timeout_s=config.catalog_timeout_s,
            workers_wanted=lambda: pool.size,
            workers_alive=lambda: pool.alive,
            dispatcher_alive=lambda: pool.dispatcher_alive,
            crash_loop=lambda: pool.crash_loop,
            notes=STORE_STATUS.notes,
            interval_s=config.health_interval_s,
            on_change=on_health_change,
        )
        doorbell = DoorbellServer(bell_path, sessions, heartbeat_s=config.heartbeat_interval_s)
        undo.pop_all()
    parts = Parts(engine, registry, pool, catalog, sessions, doorbell, monitor, sample_errors)
    parts.decode_cache = decode_cache
    try:
        address = config.metrics_address()
        if address is not None:
            try:
                parts.metrics_endpoint = serve(*address)
            except OSError as e:
                flag = setting_of(ServerConfig, "metrics_listen").flag
                raise FailedPrecondition(
                    f"cannot serve metrics on {address[0]}:{address[1]}: {e.strerror or e}; "
                    f"choose another {flag}"
                ) from e
        if not config.workers.fixed:
            parts.autoscaler = Autoscaler(
                pool,
                config.workers,
                cpus=available_cpus(),
                stall_ratio=stall_metrics.RECENT_STALL.current,
                on_change=scaling_metrics.record_worker_scaling,
                on_signals=scaling_metrics.record_scaling_signals,
            )
            parts.autoscaler.start()
        parts.cache = start_cache_manager(
            sessions.live,
            make_fetcher(store),
            prefetch_batches=config.cache_prefetch_batches,
            workers=lambda: pool.size,
        )
        monitor.start()
    except BaseException:
        parts.close()
        raise
    return parts
