"""What a share group keeps of the batches its members' slots hold (``share.py``, NOTE
[ Share groups ]): each batch's source slot and who waits for it, each loan, and the counts
of how every batch was got."""

from __future__ import annotations

import threading
from concurrent.futures import Future
from dataclasses import dataclass, field

from batchd_server.sessions.ring import ShareMember
from batchd_server.workers.task import BatchResult, BatchTask

__all__ = ["BatchKey", "Loan", "ShareCounts", "Source", "Waiter"]


BatchKey = tuple[int, int, bytes]
"""A batch's identity: epoch, index, sample positions."""


class ShareCounts:
    """Batches decoded and copied by every group of a server, since it started."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.decoded = 0
        self.copied = 0
        self.read = 0
        """Batches a member read in another member's slot (a loan)."""

    @property
    def shared(self) -> int:
        """Batches a member got from another member's slot, read there or copied."""
        return self.copied + self.read

    def add(self, *, decoded: int = 0, copied: int = 0, read: int = 0) -> None:
        with self._lock:
            self.decoded += decoded
            self.copied += copied
            self.read += read


@dataclass(eq=False)
class Waiter:
    """A member whose slot waits for a batch another member's worker is still writing."""

    member: ShareMember
    task: BatchTask
    future: Future[BatchResult]
    borrow: bool
    """The member's client reads other members' slots: it may get a loan, not a copy."""


@dataclass(eq=False)
class Loan:
    """``member``'s ``slot`` whose batch its client reads in ``source``'s slot."""

    source: Source
    member: ShareMember
    slot: int
    """The borrower's own slot: its client's credit, given back with the lease."""
    sent: bool = False
    """Its notice went out: the client may be reading the source's slot."""
    pinned_at: float | None = None
    """When the source's session was done with the slot (or closed) while this loan was out:
    from then on the loan alone keeps the slot (or the ring), for at most the loan timeout
    (``ShareGroup.reclaim``). None: not yet."""


@dataclass(eq=False)
class Source:
    """A member's slot that holds (or is being filled with) a batch."""

    key: BatchKey
    member: ShareMember
    slot: int
    future: Future[BatchResult]
    waiters: list[Waiter] = field(default_factory=list)
