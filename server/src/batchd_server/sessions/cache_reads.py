"""What the node cache's manager needs to know of the live sessions: where each stream is
and what it will read (NOTE [ Cache manager ] in ``storage/cache_manager.py``)."""

from __future__ import annotations

from collections.abc import Callable

from batchd_server.planning.sampling import EpochPlan
from batchd_server.sessions.session import Session
from batchd_server.storage.cache_manager import Reading, SourceRef

__all__ = ["readings_of"]


def readings_of(live: Callable[[], list[Session]]) -> Callable[[], list[Reading]]:
    """A :class:`Reading` of every live stream among the sessions ``live()`` returns."""

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
                    plan=stream.plan,
                    cursor=cursor,
                    ahead=stream.next_submit,
                    stride=stream.stride,
                    sources=sources,
                    next_plan=_next_plan(session, stream.epoch + 1),
                    next_start=stream.start % max(stream.stride, 1),
                )
            )
        return found

    return readings


def _next_plan(session: Session, epoch: int) -> Callable[[], EpochPlan | None]:
    def plan() -> EpochPlan | None:
        if session.closed:
            return None
        return session.plan(epoch)

    return plan
