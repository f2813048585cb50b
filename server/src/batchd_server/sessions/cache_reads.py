"""What the node cache's manager needs to know of the live sessions: where each stream is
and what it will read (NOTE [ Cache manager ] in ``cache_policy/manager.py``)."""

from __future__ import annotations

from collections.abc import Callable

from batchd_server.cache_policy.manager import CacheManager, Reading, SourceRef
from batchd_server.planning.sampling import EpochPlan
from batchd_server.sessions.session import Session
from batchd_server.storage.base import RangeFetcher
from batchd_server.storage.cache import CachingFetcher

__all__ = ["readings_of", "start_cache_manager"]


def start_cache_manager(
    live: Callable[[], list[Session]],
    fetcher: RangeFetcher,
    *,
    prefetch_batches: int,
    workers: Callable[[], int] = lambda: 1,
) -> CacheManager | None:
    """The node cache's manager over the sessions ``live()`` returns, started; None when
    ``fetcher`` reads through no cache (no ``--cache-dir``). ``workers()``: the decode
    workers now (see :func:`readings_of`).

    Raises:
        FailedPrecondition: another server holds the cache directory.
    """
    if not isinstance(fetcher, CachingFetcher):
        return None
    readings = readings_of(live, workers)
    manager = CacheManager(fetcher, readings, prefetch_batches=prefetch_batches)
    manager.start()
    return manager


def readings_of(
    live: Callable[[], list[Session]], workers: Callable[[], int] = lambda: 1
) -> Callable[[], list[Reading]]:
    """A :class:`Reading` of every live stream among the sessions ``live()`` returns.

    Prefetch starts ``workers()`` batches after a stream's first undelivered one (those the
    workers are likely reading now, which a prefetch would only fetch twice), or at the first
    batch not yet handed to the pool if that comes sooner. A deep ring queues many batches
    in the pool at once: those after the workers' are fetched ahead too, in parallel, which
    is the point of prefetching from a store whose latency, not bandwidth, bounds a worker.
    """

    def readings() -> list[Reading]:
        found = []
        for session in live():
            at = session.position()
            if at is None:
                continue
            stream, cursor = at
            sources = tuple(
                SourceRef(spec.catalog_segment, spec.start, entry.arrays, spec.root)
                for spec, entry in zip(session.spec.sources, session.catalogs, strict=True)
            )
            found.append(
                Reading(
                    dataset=session.options.dataset,
                    plan=stream.plan.catalog_plan(),
                    cursor=cursor,
                    ahead=min(stream.next_submit, cursor + stream.stride * max(workers(), 1)),
                    stride=stream.stride,
                    sources=sources,
                    next_plan=_next_plan(session, stream.epoch + 1),
                    next_start=stream.start % max(stream.stride, 1),
                    max_sample_bytes=session.spec.read.max_sample_bytes,
                )
            )
        return found

    return readings


def _next_plan(session: Session, epoch: int) -> Callable[[], EpochPlan | None]:
    def plan() -> EpochPlan | None:
        if session.closed:
            return None
        return session.plan(epoch).catalog_plan()

    return plan
