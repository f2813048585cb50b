"""The server's share groups, and the dispatcher a member of one gets (NOTE [ Share groups ]
in ``share.py``).

:meth:`ShareGroups.dispatch` is where a session is made a member or left alone: it builds
the session's dispatcher (``dispatch.py``) before the session, from its options.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
from collections.abc import Callable
from concurrent.futures import Future

from batchd._wire.share import LOANS_OUT
from batchd_server.errors import BatchdError
from batchd_server.logs import session_log_id
from batchd_server.planning.sampling import EpochPlan
from batchd_server.sessions.dispatch import Dispatch, Loaned, SoloDispatch, Wait
from batchd_server.sessions.options import SessionOptions
from batchd_server.sessions.ready import SubmitsTasks
from batchd_server.sessions.ring import ShareMember
from batchd_server.sessions.share import DEFAULT_LOAN_TIMEOUT_S, ShareGroup
from batchd_server.sessions.share_records import ShareCounts
from batchd_server.workers.task import BatchResult, BatchTask

__all__ = ["GroupDispatch", "ShareGroups", "group_key", "lent_slots"]

logger = logging.getLogger(__name__)


def group_key(options: SessionOptions, snapshot: str) -> str:
    """What a session's group is named by: its share key and everything that decides its
    batches (``snapshot``: the token that pins every source, as OpenSession answers it)."""
    # The snapshot token names every source's version and rows: a version asked for by name
    # and the newest one resolved to it are the same batches.
    batches = dataclasses.replace(options, prefetch=1, snapshot=None, version=None)
    return f"{options.share}\x00{snapshot}\x00{batches!r}"


def lent_slots(options: SessionOptions) -> int:
    """Slots a session's ring has beyond a lone session's: for a share group's member, room
    for what other members' clients may hold of its slots (loans), so that a reader that
    stalls holds none of its own window (NOTE [ Share groups ])."""
    return LOANS_OUT if options.share else 0


class ShareGroups:
    """The server's share groups, by :func:`group_key`; a group lives while it has members."""

    def __init__(self, pool: SubmitsTasks, loan_timeout_s: float = DEFAULT_LOAN_TIMEOUT_S) -> None:
        self._pool = pool
        self.loan_timeout_s = loan_timeout_s
        """``--share-loan-timeout-s``: how long a loan may keep a slot its session is done
        with (:meth:`ShareGroup.reclaim`)."""
        self._lock = threading.Lock()
        self._groups: dict[str, ShareGroup] = {}
        self.counts = ShareCounts()

    def dispatch(self, member: ShareMember, options: SessionOptions, snapshot: str) -> Dispatch:
        """The dispatcher of the session whose ring is ``member``: a member's of its group
        when ``options.share`` names one (``snapshot``: as :func:`group_key`), else a lone
        session's. Its :meth:`Dispatch.leave` takes the session out of the group again."""
        if not options.share:
            return SoloDispatch(self._pool)
        return GroupDispatch(self, self._join(member, options, snapshot), member)

    def _join(self, member: ShareMember, options: SessionOptions, snapshot: str) -> ShareGroup:
        key = group_key(options, snapshot)
        with self._lock:
            group = self._groups.get(key)
            if group is None:
                group = ShareGroup(
                    key,
                    options.share,
                    options.dataset,
                    member.layout,
                    self._pool,
                    self.counts,
                    self.loan_timeout_s,
                )
                self._groups[key] = group
            group.members.add(member.id)
            size = len(group.members)
        logger.info(
            "session %s joined share group %r of %s: %d member(s)",
            session_log_id(member.id),
            options.share,
            options.dataset,
            size,
        )
        return group

    def leave(self, member: ShareMember, group: ShareGroup, release: Callable[[], object]) -> None:
        """``member`` closed; ``release()`` frees its ring, now or once the last loan of its
        slots is repaid (:meth:`ShareGroup.leave`)."""
        group.leave(member, release)
        with self._lock:
            group.members.discard(member.id)
            if not group.members and self._groups.get(group.key) is group:
                del self._groups[group.key]

    def __len__(self) -> int:
        with self._lock:
            return len(self._groups)

    def kept_bytes(self, client: str) -> int:
        """Bytes of closed members' rings that loans to ``client``'s sessions keep: charged
        to ``client``'s shm quota (:meth:`ShareGroup.kept_bytes`)."""
        with self._lock:
            groups = list(self._groups.values())
        return sum(group.kept_bytes(client) for group in groups)

    def reclaim(self, now: float | None = None) -> int:
        """End the loans held past the loan timeout in every group; how many."""
        with self._lock:
            groups = list(self._groups.values())
        return sum(group.reclaim(now) for group in groups)


class GroupDispatch:
    """A share group's member's dispatcher: its group decides who decodes each batch and
    where it is read (NOTE [ Share groups ])."""

    def __init__(self, groups: ShareGroups, group: ShareGroup, member: ShareMember) -> None:
        self._groups = groups
        self._group = group
        self._member = member

    def submit(self, task: BatchTask, *, borrow: bool) -> Future[BatchResult]:
        return self._group.claim(self._member, task, borrow=borrow)

    def lend(self, slot: int) -> Loaned | Wait | None:
        return self._group.lend_out(self._member, slot)

    def keep(self, slot: int, repaid: Callable[[], object]) -> bool:
        return self._group.keep(self._member, slot, repaid)

    def forget(self, slot: int) -> None:
        self._group.forget(self._member, slot)

    def position(self, epoch: int, plan: EpochPlan) -> int:
        return self._group.position(epoch, plan)

    def leave(self, release: Callable[[], object]) -> None:
        self._groups.leave(self._member, self._group, release)

    def revoked(self) -> BatchdError | None:
        return self._group.revoked(self._member)
