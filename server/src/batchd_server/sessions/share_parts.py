"""The parts of a share group (``share.py``, NOTE [ Share groups ]): what it knows of its
members, the batches their slots hold or lend, its counts and bounds, and how it resolves
waiters' futures outside every lock."""

from __future__ import annotations

import enum
import functools
import threading
from collections.abc import Callable
from concurrent.futures import CancelledError, Future
from dataclasses import dataclass, field
from typing import Final, Protocol

from batchd_server.workers.task import BatchResult, BatchTask, SlotField

__all__ = [
    "WAIT",
    "BatchKey",
    "Loan",
    "RingRef",
    "ShareCounts",
    "ShareMember",
    "Source",
    "SubmitsTasks",
    "Wait",
    "Waiter",
    "chain",
    "later",
    "lend_limit",
    "when_done",
]


@dataclass(frozen=True)
class RingRef:
    """Another session's ring, as a client maps it (``StreamBatchesResponse.ring``)."""

    name: str
    segment_bytes: int
    slot_bytes: int
    slots: int
    token: bytes


class ShareMember(Protocol):
    """A session, as its group sees it."""

    id: str
    layout: tuple[SlotField, ...]
    slots: int
    """Slots in the member's ring."""

    def slot_memory(self, slot: int) -> memoryview:
        """The bytes of slot ``slot`` of the session's ring."""
        ...

    ring_ref: RingRef
    """The session's ring, as a client maps it."""


class SubmitsTasks(Protocol):
    def submit(self, task: BatchTask) -> Future[BatchResult]: ...


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


@dataclass(eq=False)
class Source:
    """A member's slot that holds (or is being filled with) a batch."""

    key: BatchKey
    member: ShareMember
    slot: int
    future: Future[BatchResult]
    waiters: list[Waiter] = field(default_factory=list)


def lend_limit(slots: int) -> int:
    """How many of its ring's ``slots`` a member lets readers' clients hold at once: half,
    so that however slow its readers, it keeps the other half for its own batches."""
    return max(1, slots // 2)


class Wait(enum.Enum):
    WAIT = "wait"


WAIT: Final = Wait.WAIT
""":meth:`ShareGroup.lend_out`: not yet; ask again once the member's client gave a batch back."""


def later(actions: list[Callable[[], object]]) -> None:
    """Run ``actions`` (resolving waiters' futures) on a thread of their own: the caller
    holds its session's lock, and a waiter's done-callbacks take the waiter's session's."""
    if actions:
        threading.Thread(
            target=lambda: [a() for a in actions], name="batchd-share-settle", daemon=True
        ).start()


def when_done(future: Future[BatchResult], fn: Callable[[Future[BatchResult]], object]) -> None:
    """Call ``fn(future)`` once ``future`` is done: on the thread that finishes it, or, when it
    is done already (a fast worker), on a thread of its own, never inside this call, whose
    caller holds the group's lock and a session's."""
    registered = False

    def done(f: Future[BatchResult]) -> None:
        if registered:
            fn(f)
        else:
            later([functools.partial(fn, f)])

    future.add_done_callback(done)
    registered = True


def chain(waiter: Future[BatchResult], own: Future[BatchResult]) -> None:
    """Resolve ``waiter`` (set running) as ``own`` resolved."""
    if own.cancelled():
        waiter.set_exception(CancelledError())
    elif (error := own.exception()) is not None:
        waiter.set_exception(error)
    else:
        waiter.set_result(own.result())
