"""Session unit tests with a fake worker pool: the slot lifecycle of NOTE [ Slot lifecycle ].

The pool here only records tasks and lets the test decide when each one starts and ends, so
every state a slot can be in (FREE, WORKING, DELIVERED, LEASED) is reached on purpose and
``Session.check_slots`` is asserted after every step.
"""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Iterator
from concurrent.futures import Future

import pytest

from batchd_server.planning.sampling import SamplerOptions
from batchd_server.sessions import (
    ReadyBatch,
    Session,
    SessionOptions,
    SlotBook,
    SlotState,
    Stream,
)
from batchd_server.sessions.dispatch import SoloDispatch
from batchd_server.workers.task import BatchResult, BatchTask

from session_doubles import fake_ring, fake_source, result_of

FREE, WORKING, DELIVERED, LEASED = (
    SlotState.FREE,
    SlotState.WORKING,
    SlotState.DELIVERED,
    SlotState.LEASED,
)
BATCH_SIZE = 2


class FakePool:
    """Records submitted tasks; the test starts and finishes them."""

    def __init__(self) -> None:
        self.tasks: dict[int, tuple[BatchTask, Future[BatchResult]]] = {}

    def submit(self, task: BatchTask) -> Future[BatchResult]:
        future: Future[BatchResult] = Future()
        self.tasks[task.batch_index] = (task, future)
        return future

    def start(self, batch_index: int) -> None:
        """A worker took the task: it can no longer be cancelled."""
        assert self.tasks[batch_index][1].set_running_or_notify_cancel()

    def finish(self, batch_index: int) -> None:
        task, future = self.tasks[batch_index]
        if not future.running():
            self.start(batch_index)
        future.set_result(result_of(task, BATCH_SIZE))


def make_session(pool: FakePool, *, samples: int, slots: int) -> Session:
    """A session over ``samples`` rows whose ring has exactly ``slots`` slots."""
    options = SessionOptions(
        dataset="d",
        version=None,
        split="train",
        sampler=SamplerOptions(batch_size=BATCH_SIZE, shuffle=False),
        pipeline_kind="array",
        pipeline_options={},
    )
    return Session(
        session_id="s",
        options=options,
        sources=(fake_source(samples),),
        ring=fake_ring("s", slots, BATCH_SIZE, "batchd-test-ring"),
        dispatch=SoloDispatch(pool),
        record_errors=lambda rows: None,
    )


def states(session: Session) -> Counter[SlotState]:
    session.check_slots()
    return Counter(session.slot_states())


def fill(session: Session) -> None:
    """Hand free slots to the pool now (an empty release does that, as a real one does)."""
    session.release([])


@pytest.fixture
def pool() -> FakePool:
    return FakePool()


def batches(session: Session, stream: Stream) -> Iterator[ReadyBatch]:
    return session.batches(stream, lambda: True)


def test_an_inline_slot_goes_free_working_delivered_and_free_again(pool: FakePool) -> None:
    """Inline: FREE -> WORKING when handed to a worker, DELIVERED when sent, FREE when acked."""
    session = make_session(pool, samples=4 * BATCH_SIZE, slots=2)
    assert states(session) == {FREE: 2}
    stream = session.start_stream(0, 0)
    gen = batches(session, stream)
    fill(session)
    assert states(session) == {WORKING: 2} and sorted(pool.tasks) == [0, 1]
    pool.finish(0)
    ready = next(gen)
    assert ready.batch_index == 0 and ready.lease == 0
    assert session.slot_states()[ready.slot] is DELIVERED
    assert states(session) == {DELIVERED: 1, WORKING: 1}
    session.ack(stream, [0])
    # The freed slot goes straight to the next batch's worker.
    assert states(session) == {WORKING: 2} and sorted(pool.tasks) == [0, 1, 2]
    session.end_stream(stream)


def test_an_shm_slot_is_leased_until_its_lease_comes_back(pool: FakePool) -> None:
    """shm: a sent batch's slot is LEASED, and only releasing that lease frees it."""
    session = make_session(pool, samples=2 * BATCH_SIZE, slots=2)
    stream = session.start_stream(0, 0, held_leases=[])
    gen = batches(session, stream)
    fill(session)
    pool.finish(0)
    pool.finish(1)
    first, second = next(gen), next(gen)
    assert first.lease and second.lease and first.lease != second.lease
    assert states(session) == {LEASED: 2}
    session.ack(stream, [0, 1])  # inline acks mean nothing to an shm stream
    assert states(session) == {LEASED: 2}
    session.release([second.lease])
    assert states(session) == {LEASED: 1, FREE: 1}
    assert session.slot_states()[second.slot] is FREE
    session.release([first.lease])
    assert states(session) == {FREE: 2}
    assert next(gen, None) is None
    session.end_stream(stream)


def test_late_duplicate_and_out_of_order_acks_are_harmless(pool: FakePool) -> None:
    """Acks out of order free the right slots; repeated, late or unknown ones change nothing."""
    session = make_session(pool, samples=2 * BATCH_SIZE, slots=2)
    stream = session.start_stream(0, 0)
    gen = batches(session, stream)
    fill(session)
    pool.finish(0)
    pool.finish(1)
    first, second = next(gen), next(gen)
    session.ack(stream, [1])
    assert session.slot_states()[second.slot] is FREE
    assert session.slot_states()[first.slot] is DELIVERED
    session.ack(stream, [1, 1, 99])
    session.release([12345])
    assert states(session) == {FREE: 1, DELIVERED: 1}
    session.ack(stream, [0])
    assert states(session) == {FREE: 2}
    session.end_stream(stream)
    session.ack(stream, [0, 1])  # after the stream ended
    assert states(session) == {FREE: 2}


def test_a_slot_whose_worker_is_writing_stays_working_after_its_stream_ends(
    pool: FakePool,
) -> None:
    """Ending a stream frees queued tasks' slots at once, a written-to slot only when done."""
    session = make_session(pool, samples=8 * BATCH_SIZE, slots=3)
    stream = session.start_stream(0, 0)
    fill(session)
    pool.start(0)  # a worker is writing batch 0; batches 1 and 2 are still queued
    session.end_stream(stream)
    assert pool.tasks[1][1].cancelled() and pool.tasks[2][1].cancelled()
    busy_slot = pool.tasks[0][0].slot
    assert session.slot_states()[busy_slot] is WORKING
    assert states(session) == {WORKING: 1, FREE: 2}
    # A new stream must not get that slot while the worker writes.
    pool.tasks.clear()
    stream = session.start_stream(1, 0)
    fill(session)
    assert busy_slot not in {task.slot for task, _ in pool.tasks.values()}
    assert states(session) == {WORKING: 3}
    session.end_stream(stream)


def test_a_new_shm_stream_frees_every_lease_the_client_no_longer_holds(pool: FakePool) -> None:
    """StreamStart.held_leases keeps those slots LEASED and frees the other LEASED ones."""
    session = make_session(pool, samples=2 * BATCH_SIZE, slots=3)
    stream = session.start_stream(0, 0, held_leases=[])
    gen = batches(session, stream)
    fill(session)
    pool.finish(0)
    pool.finish(1)
    kept, dropped = next(gen), next(gen)
    assert next(gen, None) is None
    session.end_stream(stream)
    assert states(session) == {LEASED: 2, FREE: 1}
    session.start_stream(1, 0, held_leases=[kept.lease])
    assert session.slot_states()[kept.slot] is LEASED
    assert session.slot_states()[dropped.slot] is FREE
    session.release([dropped.lease])  # late: already freed by the start
    # That release also handed the two free slots to the new stream's first batches.
    assert states(session) == {LEASED: 1, WORKING: 2}
    assert session.slot_states()[kept.slot] is LEASED


def test_two_streams_started_at_once_leave_one_live_stream(
    pool: FakePool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two starts racing (an inline call and a doorbell START of one session): while the
    first ends the old stream, the second starts; whichever sets itself last is the one live
    stream, and the other is ended, never left streaming into the same ring."""
    session = make_session(pool, samples=8 * BATCH_SIZE, slots=3)
    old = session.start_stream(0, 0)
    end_stream = session.end_stream
    raced: list[Stream] = []
    racing = threading.Event()

    def end_while_another_starts(stream: Stream) -> None:
        if not racing.is_set():  # the second start runs between the first's two steps
            racing.set()
            raced.append(session.start_stream(0, 1))
        end_stream(stream)

    monkeypatch.setattr(session, "end_stream", end_while_another_starts)
    first = session.start_stream(0, 2)
    (second,) = raced
    assert old.closed
    assert [s.closed for s in (first, second)].count(False) == 1, "one live stream"
    assert not first.closed  # it set itself last
    session.end_stream(first)


def test_closing_a_session_returns_only_the_tasks_still_writing(pool: FakePool) -> None:
    """close() ends the stream and hands back the futures the ring must outlive."""
    session = make_session(pool, samples=8 * BATCH_SIZE, slots=3)
    session.start_stream(0, 0)
    fill(session)
    pool.start(1)
    busy = session.close()
    assert busy == [pool.tasks[1][1]]
    assert session.closed
    pool.finish(1)
    assert states(session) == {FREE: 3}


def test_the_slot_book_refuses_a_transition_from_the_wrong_state() -> None:
    """A slot cannot be freed from a state it is not in, nor taken when it is not free."""
    book = SlotBook(2)
    slot = book.take()
    with pytest.raises(AssertionError, match=r"not SlotState\.LEASED"):
        book.free(slot, SlotState.LEASED)
    book.sent(slot, leased=True)
    with pytest.raises(AssertionError):
        book.sent(slot, leased=False)
    book.free(slot, SlotState.LEASED)
    book.check()
    assert book.counts() == {FREE: 2}
