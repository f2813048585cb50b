"""ShareGroup unit tests with a fake worker pool: who decodes, who copies, and the paths
where a batch's source goes away (NOTE [ Share groups ] in ``sessions/share.py``).

The pool only records tasks and lets the test decide when each one ends, so the orders
the end-to-end tests rarely meet (a source cancelled or closed while another member
waits for it, a waiter whose stream ended first) are reached on purpose.
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import CancelledError, Future
from typing import Any

import numpy as np
import pytest

from batchd._wire.share import LOANS_OUT
from batchd_server.errors import DataLoss, ResourceExhausted
from batchd_server.planning.sampling import EpochPlan
from batchd_server.sessions.dispatch import WAIT
from batchd_server.sessions.ring import RingRef
from batchd_server.sessions.share import ShareGroup
from batchd_server.sessions.share_records import ShareCounts
from batchd_server.workers.task import BatchResult, BatchTask, SlotField

SLOT_BYTES = 8


class FakePool:
    def __init__(self) -> None:
        self.tasks: list[tuple[BatchTask, Future[BatchResult]]] = []

    def submit(self, task: BatchTask) -> Future[BatchResult]:
        future: Future[BatchResult] = Future()
        self.tasks.append((task, future))
        return future

    def finish(self, index: int, member: Member) -> None:
        """The worker writes task ``index``'s batch (its slot filled with its batch index)."""
        task, future = self.tasks[index]
        assert future.set_running_or_notify_cancel()
        member.slot_memory(task.slot)[:] = bytes([task.batch_index + 1]) * SLOT_BYTES
        future.set_result(BatchResult(task.batch_index, task.slot, 2, {"x": (2, 4)}))


LAYOUT: tuple[SlotField, ...] = (SlotField("x", "|u1", (4,), 0, SLOT_BYTES),)
"""One field of two rows of 4 bytes: a whole slot."""


class Member:
    def __init__(self, member_id: str, slots: int = 4) -> None:
        self.id = member_id
        self.layout = LAYOUT
        self.slots = slots
        self.ring = bytearray(slots * SLOT_BYTES)
        self.ring_ref = RingRef(self.id, len(self.ring), SLOT_BYTES, slots, b"token")

    def slot_memory(self, slot: int) -> memoryview:
        return memoryview(self.ring)[slot * SLOT_BYTES : (slot + 1) * SLOT_BYTES]

    def slot(self, slot: int) -> bytes:
        return bytes(self.slot_memory(slot))


def _task(k: int, slot: int) -> BatchTask:
    spec: Any = None  # the group never reads it
    return BatchTask(spec, 0, k, slot, bytes([k]) * 8)


@pytest.fixture
def parts() -> tuple[FakePool, ShareGroup, Member, Member]:
    pool = FakePool()
    group = ShareGroup("key", "sweep", "records", LAYOUT, pool, ShareCounts())
    return pool, group, Member("a"), Member("b")


def test_the_first_member_decodes_and_the_next_copies(parts: Any) -> None:
    pool, group, a, b = parts
    fa = group.claim(a, _task(5, slot=1))
    fb = group.claim(b, _task(5, slot=3))
    assert len(pool.tasks) == 1, "one decode for two members"
    assert not fb.done()
    pool.finish(0, a)
    assert fb.result().slot == 3 and fa.result().slot == 1
    assert b.slot(3) == a.slot(1) == bytes([6]) * SLOT_BYTES
    late = group.claim(Member("c"), _task(5, slot=0))
    assert late.done() and late.result().slot == 0, "a held batch is copied at once"
    assert (group.decoded, group.copied) == (1, 2)


def test_a_freed_source_is_forgotten_and_the_next_member_decodes(parts: Any) -> None:
    pool, group, a, b = parts
    group.claim(a, _task(5, slot=1))
    pool.finish(0, a)
    group.forget(a, 1)  # a's loop is done with it: the slot may be reused
    group.claim(b, _task(5, slot=2))
    assert len(pool.tasks) == 2 and group.sources() == 1


def test_a_copy_serves_a_later_member_once_the_decoding_slot_is_freed(parts: Any) -> None:
    pool, group, a, b = parts
    group.claim(a, _task(5, slot=1))
    group.claim(b, _task(5, slot=2))
    pool.finish(0, a)
    group.forget(a, 1)  # a's loop is done with batch 5; b's copy still holds it
    c = Member("c")
    late = group.claim(c, _task(5, slot=3))
    assert late.done() and c.slot(3) == b.slot(2) == bytes([6]) * SLOT_BYTES
    assert len(pool.tasks) == 1 and (group.decoded, group.copied) == (1, 2)
    group.forget(b, 2)
    group.forget(c, 3)
    assert group.sources() == 0


def test_a_source_cancelled_before_a_worker_took_it_passes_to_a_waiter(parts: Any) -> None:
    pool, group, a, b = parts
    fa = group.claim(a, _task(5, slot=1))
    fb = group.claim(b, _task(5, slot=2))
    assert fa.cancel()  # a's stream ended while the task was queued
    assert len(pool.tasks) == 2, "b decodes the batch itself"
    task, _ = pool.tasks[1]
    assert task.slot == 2
    pool.finish(1, b)
    assert fb.result().slot == 2 and b.slot(2) == bytes([6]) * SLOT_BYTES


def test_a_member_that_closes_hands_its_waiters_copies_or_their_own_decode(parts: Any) -> None:
    pool, group, a, b = parts
    group.claim(a, _task(1, slot=0))
    group.claim(a, _task(2, slot=1))
    pool.finish(0, a)  # batch 1 decoded; batch 2 still being written when a closes
    f1 = group.claim(b, _task(1, slot=0))
    f2 = group.claim(b, _task(2, slot=1))
    group.leave(a)
    assert f1.result().slot == 0 and b.slot(0) == bytes([2]) * SLOT_BYTES
    assert not f2.done() and pool.tasks[-1][0].slot == 1, "b decodes batch 2 itself"
    pool.finish(len(pool.tasks) - 1, b)
    assert f2.result().slot == 1
    assert group.sources() == 2, "b's slots hold both batches now"


def test_a_waiter_whose_stream_ended_gets_nothing_written(parts: Any) -> None:
    pool, group, a, b = parts
    group.claim(a, _task(5, slot=1))
    fb = group.claim(b, _task(5, slot=2))
    assert fb.cancel()  # b's stream ended; its slot is FREE and may hold another batch
    b.slot_memory(2)[:] = b"x" * SLOT_BYTES
    pool.finish(0, a)
    assert b.slot(2) == b"x" * SLOT_BYTES
    assert group.copied == 0


def test_a_failed_decode_fails_every_waiter_alike(parts: Any) -> None:
    pool, group, a, b = parts
    fa = group.claim(a, _task(5, slot=1))
    fb = group.claim(b, _task(5, slot=2))
    assert pool.tasks[0][1].set_running_or_notify_cancel()
    pool.tasks[0][1].set_exception(DataLoss("sample 7 failed"))
    with pytest.raises(DataLoss):
        fa.result()
    with pytest.raises(DataLoss):
        fb.result()
    fc = group.claim(Member("c"), _task(5, slot=0))
    assert len(pool.tasks) == 2, "a later member decodes a batch that failed afresh"
    assert fc is pool.tasks[1][1]


def test_a_cancelled_own_decode_reads_as_cancelled_to_the_waiter(parts: Any) -> None:
    pool, group, a, b = parts
    fa = group.claim(a, _task(5, slot=1))
    fb = group.claim(b, _task(5, slot=2))
    fa.cancel()
    pool.tasks[1][1].cancel()  # the pool dropped b's own task (shutting down)
    with pytest.raises(CancelledError):
        fb.result(timeout=30)


class FastPool(FakePool):
    """A worker so fast that a task is done before ``submit`` returns."""

    def __init__(self, member: Member) -> None:
        super().__init__()
        self.member = member

    def submit(self, task: BatchTask) -> Future[BatchResult]:
        future = super().submit(task)
        self.finish(len(self.tasks) - 1, self.member)
        return future


def test_a_task_done_before_submit_returns_does_not_deadlock_the_group() -> None:
    """The group's done-callback of such a task runs on a thread of its own, not inside the
    claim that holds the group's lock (where it would wait for that lock forever)."""
    a, b = Member("a"), Member("b")
    group = ShareGroup("key", "sweep", "records", LAYOUT, FastPool(a), ShareCounts())
    assert group.claim(a, _task(5, slot=1)).result(timeout=30).slot == 1
    assert group.claim(b, _task(5, slot=2)).result(timeout=30).slot == 2
    assert b.slot(2) == a.slot(1) and (group.decoded, group.copied) == (1, 1)


def _planned(k: int, slot: int, *, epoch: int = 0, sample: int | None = None) -> BatchTask:
    """Batch ``k`` of ``_PLAN`` (8 times sample ``k``, or ``sample``: another plan's)."""
    spec: Any = None
    positions = np.full(8, k if sample is None else sample, dtype=np.int64).tobytes()
    return BatchTask(spec, epoch, k, slot, positions)


_PLAN = EpochPlan(np.repeat(np.arange(32, dtype=np.int64), 8), 8, 32)


def test_a_joiner_starts_at_the_run_of_batches_the_group_holds(parts: Any) -> None:
    """The group's position is the first batch of the run of consecutive batches held up to
    the furthest one: a stray early batch a loop keeps does not pull a joiner back, another
    epoch's batches and batches of another plan do not count."""
    _, group, a, b = parts
    assert group.position(0, _PLAN) == 0, "nothing held: the epoch's start"
    for slot, k in enumerate([3, 20, 21, 23]):
        group.claim(a, _planned(k, slot))
    group.claim(b, _planned(22, 0))
    group.claim(b, _planned(25, 1, epoch=1))
    group.claim(b, _planned(24, 2, sample=99))
    assert group.position(0, _PLAN) == 20
    group.forget(a, 1)  # batch 20 released
    assert group.position(0, _PLAN) == 21
    group.forget(b, 0)  # batch 22: the run is 23 alone now
    assert group.position(0, _PLAN) == 23


# -- loans: a member whose client reads other rings reads the source's slot itself --------


def _freed() -> tuple[threading.Event, Any]:
    """An event set when the returned callable (a LENT slot's release) is called."""
    event = threading.Event()
    return event, event.set


def test_a_borrower_reads_the_source_slot_and_nothing_is_copied(parts: Any) -> None:
    pool, group, a, b = parts
    group.claim(a, _task(5, slot=1))
    pool.finish(0, a)
    fb = group.claim(b, _task(5, slot=3), borrow=True)
    assert fb.done() and fb.result().slot == 3, "its own slot stays its credit"
    assert group.loan(b, 3) == (a, 1)
    assert group.lend_out(b, 3) == (a, 1), "its notice names a's slot"
    assert b.slot(3) == bytes(SLOT_BYTES), "nothing was copied into the borrower's slot"
    assert (group.decoded, group.copied, group.read) == (1, 0, 1)
    assert group.lend_out(a, 1) is None, "the source reads its own slot"


def test_a_lent_slot_is_kept_until_the_last_borrower_gives_it_back(parts: Any) -> None:
    pool, group, a, b = parts
    c, d = Member("c"), Member("d")
    group.claim(a, _task(5, slot=1))
    pool.finish(0, a)
    for member, slot in ((b, 3), (c, 0), (d, 2)):
        group.claim(member, _task(5, slot=slot), borrow=True)
    assert group.lend_out(b, 3) == group.lend_out(c, 0) == (a, 1)  # d's is not out yet
    freed, free = _freed()
    assert group.keep(a, 1, free), "a's client is done with it, b's and c's are not"
    assert group.lend_out(d, 2) is None and d.slot(2) == a.slot(1), (
        "a loan not sent yet became a copy: it would have kept a's slot longer"
    )
    e = Member("e")
    group.claim(e, _task(5, slot=1), borrow=True)
    assert group.loan(e, 1) is None and e.slot(1) == a.slot(1), "a kept slot lends no more"
    group.forget(b, 3)
    assert not freed.is_set() and group.loans() == 1
    group.forget(c, 0)
    assert freed.wait(5), "the last loan repaid frees the kept slot"
    assert not group.keep(a, 1, free), "no loan is out any more"


def test_a_reader_holds_at_most_loans_out_notices_of_a_ring_then_waits(parts: Any) -> None:
    pool, group, _, _ = parts
    a, b = Member("a", slots=12), Member("b", slots=LOANS_OUT + 1)
    for k in range(LOANS_OUT + 1):
        group.claim(a, _task(k, slot=k))
        pool.finish(k, a)
    for k in range(LOANS_OUT + 1):
        group.claim(b, _task(k, slot=k), borrow=True)
    sent = [group.lend_out(b, k) for k in range(LOANS_OUT)]
    assert sent == [(a, k) for k in range(LOANS_OUT)]
    assert group.lend_out(b, LOANS_OUT) is WAIT, "b's client holds its share of a's ring"
    group.forget(b, 0)  # its loop gave one back
    assert group.lend_out(b, LOANS_OUT) == (a, LOANS_OUT)
    assert group.copied == 0


def test_a_source_lets_readers_hold_at_most_half_its_ring(parts: Any) -> None:
    pool, group, a, b = parts  # a has 4 slots: at most 2 of them in other clients' hands
    c = Member("c")
    for k in range(3):
        group.claim(a, _task(k, slot=k))
        pool.finish(k, a)
    for k in range(2):
        group.claim(b, _task(k, slot=k), borrow=True)
        assert group.lend_out(b, k) == (a, k)
    group.claim(c, _task(2, slot=0), borrow=True)
    assert group.lend_out(c, 0) is None and c.slot(0) == a.slot(2), "a copy, not a loan"
    assert (group.read, group.copied) == (2, 1)
    group.forget(b, 0)  # a loan repaid: a lends again
    group.claim(c, _task(0, slot=1), borrow=True)
    assert group.lend_out(c, 1) == (a, 0)


def test_a_waiter_that_borrows_gets_a_loan_when_the_decode_is_done(parts: Any) -> None:
    pool, group, a, b = parts
    group.claim(a, _task(5, slot=1))
    fb = group.claim(b, _task(5, slot=2), borrow=True)
    assert not fb.done()
    pool.finish(0, a)
    assert fb.result(timeout=5).slot == 2
    assert group.lend_out(b, 2) == (a, 1) and b.slot(2) == bytes(SLOT_BYTES)


def test_a_member_that_leaves_with_slots_on_loan_keeps_its_ring_until_repaid(parts: Any) -> None:
    pool, group, a, b = parts
    c = Member("c")
    group.claim(a, _task(5, slot=1))
    pool.finish(0, a)
    group.claim(b, _task(5, slot=3), borrow=True)
    group.claim(c, _task(5, slot=2), borrow=True)
    assert group.lend_out(b, 3) == (a, 1)
    released: list[str] = []
    group.leave(a, lambda: released.append("a"))
    assert released == [], "b's client may be reading a's slot"
    assert group.lend_out(c, 2) is None and c.slot(2) == a.slot(1), "c's loan became a copy"
    group.claim(Member("d"), _task(5, slot=0), borrow=True)
    assert len(pool.tasks) == 1, "d copies c's slot"
    group.forget(b, 3)
    assert released == ["a"], "the last loan repaid releases a's ring at once"
    group.leave(b, lambda: released.append("b"))
    assert released == ["a", "b"]


def test_a_borrower_that_leaves_repays_its_loans(parts: Any) -> None:
    pool, group, a, b = parts
    group.claim(a, _task(5, slot=1))
    pool.finish(0, a)
    group.claim(b, _task(5, slot=3), borrow=True)
    assert group.lend_out(b, 3) == (a, 1)
    freed, free = _freed()
    assert group.keep(a, 1, free)
    group.leave(b)
    assert freed.wait(5) and group.loans() == 0


class Client(Member):
    """A member whose session ``client`` opened."""

    def __init__(self, member_id: str, client: str) -> None:
        super().__init__(member_id)
        self.client = client


def test_a_left_members_kept_ring_is_charged_to_the_clients_reading_it() -> None:
    """a (client A) leaves while b (client B) reads a slot of it: a's ring counts against B
    (not A, nor C, whose member c reads nothing of it) until b repays the loan."""
    pool = FakePool()
    group = ShareGroup("key", "sweep", "records", LAYOUT, pool, ShareCounts())
    a, b, c = Client("a", "A"), Client("b", "B"), Client("c", "C")
    group.claim(a, _task(5, slot=1))
    pool.finish(0, a)
    group.claim(b, _task(5, slot=3), borrow=True)
    assert group.lend_out(b, 3) == (a, 1)
    group.claim(c, _task(6, slot=0), borrow=True)  # c decodes its own batch
    assert group.kept_bytes("B") == 0, "a is open: its ring is a's client's"
    group.leave(a, lambda: None)
    assert group.kept_bytes("B") == len(a.ring) == 4 * SLOT_BYTES
    assert group.kept_bytes("A") == group.kept_bytes("C") == 0
    group.forget(b, 3)
    assert group.kept_bytes("B") == 0


def test_a_loan_kept_past_the_timeout_is_reclaimed_and_its_reader_told(parts: Any) -> None:
    """b reads a's slot 1; a's own loop is done with it (LENT) at t: at t + timeout the loan
    is reclaimed, the slot freed, and b's stream is told why, once."""
    pool, _, a, b = parts
    group = ShareGroup("key", "sweep", "records", LAYOUT, pool, ShareCounts(), loan_timeout_s=60)
    group.claim(a, _task(5, slot=1))
    pool.finish(0, a)
    group.claim(b, _task(5, slot=3), borrow=True)
    assert group.lend_out(b, 3) == (a, 1)
    assert group.reclaim(now=10**9) == 0, "a's own loop still holds the slot: nothing pinned"
    freed, free = _freed()
    assert group.keep(a, 1, free)
    pinned = time.monotonic()
    assert group.reclaim(now=pinned + 59) == 0 and group.revoked(b) is None
    assert group.reclaim(now=pinned + 61) == 1
    assert freed.is_set() and group.loans() == 0
    error = group.revoked(b)
    assert isinstance(error, ResourceExhausted) and "--share-loan-timeout-s" in str(error)
    assert group.revoked(b) is None, "told once: its next stream runs"
    group.forget(b, 3)  # its client gives the lease back later: harmless


def test_a_reclaimed_loan_releases_a_left_members_ring(parts: Any) -> None:
    pool, _, a, b = parts
    group = ShareGroup("key", "sweep", "records", LAYOUT, pool, ShareCounts(), loan_timeout_s=5)
    group.claim(a, _task(5, slot=1))
    pool.finish(0, a)
    group.claim(b, _task(5, slot=3), borrow=True)
    assert group.lend_out(b, 3) == (a, 1)
    released: list[str] = []
    group.leave(a, lambda: released.append("a"))
    assert released == [] and group.reclaim(now=time.monotonic() + 6) == 1
    assert released == ["a"] and isinstance(group.revoked(b), ResourceExhausted)
