"""A session's dispatcher (``sessions/dispatch.py``): a lone session's and a share group's
member's honour one interface and serve a session alike, and the server alone decides which
stream starts at its group's position (NOTE [ Share groups ]).

Sessions here are real ``Session`` objects over a ring in memory; the pool only records
tasks and lets the test decide when each one ends.
"""

from __future__ import annotations

import inspect
import threading
from collections import Counter
from concurrent.futures import Future
from typing import Any

import pytest

from batchd_server.planning.sampling import SamplerOptions
from batchd_server.sessions import Session, SessionOptions, SlotState
from batchd_server.sessions.dispatch import Dispatch, SoloDispatch
from batchd_server.sessions.share_groups import GroupDispatch, ShareGroups
from batchd_server.workers.task import BatchResult, BatchTask

from session_doubles import fake_ring, fake_source, result_of

BATCH_SIZE = 2
SLOTS = 3


class FakePool:
    """Records submitted tasks by (session, batch); the test finishes them."""

    def __init__(self) -> None:
        self.tasks: dict[tuple[str, int], tuple[BatchTask, Future[BatchResult]]] = {}
        self.submitted = threading.Condition()

    def submit(self, task: BatchTask) -> Future[BatchResult]:
        future: Future[BatchResult] = Future()
        with self.submitted:
            self.tasks[(task.spec.session_id, task.batch_index)] = (task, future)
            self.submitted.notify_all()
        return future

    def wait_for(self, session_id: str, batch_index: int) -> bool:
        """Whether the task arrives within 30 s (it may come from another thread)."""
        with self.submitted:
            return self.submitted.wait_for(lambda: (session_id, batch_index) in self.tasks, 30)

    def finish(self, session_id: str, batch_index: int) -> None:
        task, future = self.tasks[(session_id, batch_index)]
        assert future.set_running_or_notify_cancel()
        future.set_result(result_of(task, BATCH_SIZE))


def _options(*, share: str = "", world_size: int = 1) -> SessionOptions:
    sampler = SamplerOptions(batch_size=BATCH_SIZE, shuffle=False, world_size=world_size)
    return SessionOptions(
        dataset="d",
        version=None,
        split="train",
        sampler=sampler,
        pipeline_kind="array",
        pipeline_options={},
        share=share,
    )


def _session(
    session_id: str,
    options: SessionOptions,
    dispatch: Any,
    *,
    batches: int = 32,
) -> Session:
    """A session of ``batches`` batches over a ring of ``SLOTS`` slots; ``dispatch`` builds
    its dispatcher from its ring."""
    ring = fake_ring(session_id, SLOTS, BATCH_SIZE, f"batchd-test-ring-{session_id}")
    catalog = fake_source(batches * BATCH_SIZE * options.sampler.world_size)
    return Session(
        session_id=session_id,
        options=options,
        sources=(catalog,),
        ring=ring,
        dispatch=dispatch(ring),
        record_errors=lambda rows: None,
    )


def test_the_solo_and_group_dispatchers_honour_one_interface() -> None:
    """Both are a ``Dispatch``, and each of its methods takes the same parameters in both."""
    pool = FakePool()
    groups = ShareGroups(pool)
    solo = _session("solo", _options(), lambda _: SoloDispatch(pool)).dispatch
    member = _session(
        "m", _options(share="k"), lambda r: groups.dispatch(r, _options(share="k"), "snap")
    ).dispatch
    assert isinstance(solo, SoloDispatch) and isinstance(member, GroupDispatch)
    methods = [n for n, f in vars(Dispatch).items() if inspect.isfunction(f) and n[0] != "_"]
    assert sorted(methods) == ["forget", "keep", "leave", "lend", "position", "revoked", "submit"]
    for dispatch in (solo, member):
        assert isinstance(dispatch, Dispatch)
        for name in methods:
            ours = inspect.signature(getattr(type(dispatch), name))
            assert ours == inspect.signature(getattr(Dispatch, name)), f"{type(dispatch)}.{name}"


def _run_epoch(session: Session, pool: FakePool) -> list[int]:
    """Stream epoch 0 inline, finishing each task as it is due and acking each batch; the
    batch indices served, once every slot is FREE again."""
    stream = session.start_stream(0, 0)
    served = []
    gen = session.batches(stream, lambda: True)
    session.release([])  # hand the free slots to the pool
    for k in range(session.num_batches):
        pool.finish(session.id, k)
        ready = next(gen)
        served.append(ready.batch_index)
        session.ack(stream, [ready.batch_index])
        session.check_slots()
    assert next(gen, None) is None
    session.end_stream(stream)
    assert Counter(session.slot_states()) == {SlotState.FREE: SLOTS}
    return served


def test_a_lone_group_member_serves_its_epoch_as_a_lone_session() -> None:
    """A group of one decodes every batch itself, in the same order as a session alone."""
    pool = FakePool()
    groups = ShareGroups(pool)
    options = _options(share="k")
    solo = _session("solo", _options(), lambda _: SoloDispatch(pool), batches=8)
    member = _session("m", options, lambda r: groups.dispatch(r, options, "snap"), batches=8)
    assert _run_epoch(solo, pool) == _run_epoch(member, pool) == list(range(8))
    assert sorted(k for s, k in pool.tasks if s == "m") == list(range(8))
    assert groups.counts.shared == 0
    released: list[str] = []
    member.dispatch.leave(lambda: released.append("m"))
    solo.dispatch.leave(lambda: released.append("solo"))
    assert released == ["m", "solo"] and len(groups) == 0


@pytest.fixture
def group_at_10() -> tuple[ShareGroups, Any]:
    """A group whose first member streams from batch 10 on (a resume): its slots hold
    batches 10 to 12, so the group's position in epoch 0 is 10. Returns the registry and a
    function that adds a member of the same group."""
    pool = FakePool()
    groups = ShareGroups(pool)

    def member(session_id: str, world_size: int = 1) -> Session:
        options = _options(share="k", world_size=world_size)
        return _session(session_id, options, lambda r: groups.dispatch(r, options, "snap"))

    lead = member("lead")
    lead.start_stream(0, 10)
    lead.release([])
    assert sorted(k for _, k in pool.tasks) == [10, 11, 12]
    return groups, member


def test_a_fresh_stream_that_asks_starts_at_its_groups_position(group_at_10: Any) -> None:
    _, member = group_at_10
    stream = member("b").start_stream(0, 0, join_share=True)
    assert stream.rotation == 10 and stream.index(0) == 10


@pytest.mark.parametrize(
    "start",
    [
        pytest.param({"join_share": False}, id="not-asked"),
        pytest.param({"stride": 2}, id="striped-over-replicas"),
        pytest.param({"start_batch": 1}, id="resumed-part-way"),
        pytest.param({"start_sample": 4}, id="elastic-resume"),
        pytest.param({"rotation": 2 * BATCH_SIZE}, id="rotated-by-the-client"),
    ],
)
def test_the_server_refuses_a_join_to_a_stream_that_may_not(
    group_at_10: Any, start: dict[str, Any]
) -> None:
    """Whatever the client asks, only a fresh epoch served whole by one stream joins: any
    other stream starts where it asked, in its own plan's order."""
    _, member = group_at_10
    session = member("b")
    asked = {"join_share": True, **start}
    start_batch = asked.pop("start_batch", 0)
    stream = session.start_stream(0, start_batch, **asked)
    assert stream.start == start_batch
    rotated = asked.get("rotation", 0) // BATCH_SIZE
    assert stream.rotation == rotated, "the server did not start it at the group's position"


def test_the_server_refuses_a_join_to_a_rank_of_a_larger_job() -> None:
    """Each rank of a job of two is in its own group and must serve one order: rank 0 asks
    to join a group at batch 10, and starts at the epoch's first batch."""
    pool = FakePool()
    groups = ShareGroups(pool)
    options = _options(share="k", world_size=2)
    lead = _session("lead", options, lambda r: groups.dispatch(r, options, "snap"))
    lead.start_stream(0, 10)
    lead.release([])
    b = _session("b", options, lambda r: groups.dispatch(r, options, "snap"))
    assert b.dispatch.position(0, b.plan(0)) == 10, "the group is at batch 10"
    assert b.start_stream(0, 0, join_share=True).rotation == 0


def test_a_lone_session_that_asks_to_join_starts_at_the_epochs_start() -> None:
    pool = FakePool()
    solo = _session("solo", _options(), lambda _: SoloDispatch(pool))
    assert solo.start_stream(0, 0, join_share=True).rotation == 0


def test_a_borrowed_slot_stays_lent_until_its_reader_gives_it_back() -> None:
    """A release flows one way: the owner's client gives back a slot another member's client
    still reads; its session asks its dispatcher, which keeps it LENT, and frees it once the
    reader's lease comes back."""
    pool = FakePool()
    groups = ShareGroups(pool)
    options = _options(share="k")
    a = _session("a", options, lambda r: groups.dispatch(r, options, "snap"), batches=4)
    b = _session("b", options, lambda r: groups.dispatch(r, options, "snap"), batches=4)
    a_stream = a.start_stream(0, 0, held_leases=[])
    a_gen = a.batches(a_stream, lambda: True)
    a.release([])
    pool.finish("a", 0)
    a_first = next(a_gen)
    b_stream = b.start_stream(0, 0, held_leases=[], read_shared=True)
    b_gen = b.batches(b_stream, lambda: True)
    b.release([])
    b_first = next(b_gen)
    assert b_first.ring == a.ring_ref and b_first.slot == a_first.slot, "b reads a's slot"
    a.release([a_first.lease])
    assert a.slot_states()[a_first.slot] is SlotState.LENT
    a.check_slots()
    b.release([b_first.lease])
    # Repaid: the slot is FREE and goes to a's next batch at once (on the thread that
    # repaid the loan, outside b's lock).
    assert pool.wait_for("a", SLOTS), "a's slot was never freed"
    assert a.slot_states()[a_first.slot] is SlotState.WORKING
    a.check_slots()
    b.check_slots()
    for session, stream in ((a, a_stream), (b, b_stream)):
        session.end_stream(stream)
