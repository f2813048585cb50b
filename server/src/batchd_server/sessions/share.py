"""Share groups: co-located sessions that read the same batches decode each of them once.

# NOTE [ Share groups ]
A session opened with ``share="<key>"`` joins the group of every open session with the same
key that asks for the same batches: same sources at the same snapshot, pipeline, sampling,
seed, batch size, rank and world size, drop_last, on_error and error fraction
(:func:`group_key`; ``prefetch`` may differ). Sessions with the same key but other
parameters are simply in another group: they share nothing, and nothing fails.

Each member stays a whole session of its own: its own ring, stream, cursor, leases and
resume state, exactly as a lone Loader's. Only where a batch's bytes come from changes.
When a member's stream hands batch ``k`` of an epoch to the workers (``Session._fill``), it
asks its group first (:meth:`ShareGroup.claim`), by the batch's identity: epoch, index and
sample positions (which the plan, a pure function of seed, epoch and world size, decides):

  * no member holds that batch: the member decodes it into its own slot (a worker task, as
    alone) and the group notes that slot as the batch's *source* while it holds the batch;
  * another member's slot holds it, decoded: its bytes are copied into the member's slot
    now (a memcpy, no worker);
  * another member's worker is still writing it: the member waits for that task and gets a
    copy when it is done (its slot stays WORKING meanwhile, as for its own task).

A slot that got a batch as a copy holds it too, and serves later members as the decoding
slot does. A slot is forgotten when it is freed (:meth:`ShareGroup.forget`, called by the
``SlotBook`` under the session's lock, before the slot can be reused): its client acked
or released the batch, or its stream ended. A member that asks once no slot holds the
batch decodes it itself. So no member ever waits for another's client: a member that
stalls simply stops producing, the others decode what they need themselves (the stalled
one is "split off" as soon as it is more than a ring behind them: the rings' windows are
the bound), and a member that falls behind decodes its own batches until it is within the
window of another member, then reads copies again. Every member gets every batch of its
epoch exactly once, in its own plan's order (rotated, for one that joined late): the group
only decides who decodes.

A member that starts an epoch afresh and asks to join (``StreamStart.join_share``; the
client does so at every fresh epoch of a ``share=`` Loader of world size 1 on one server:
the ranks of a larger job are each in their own group, at its own position, and must serve
one order) starts at the
group's position (:meth:`ShareGroup.position`): the first batch ``k`` of the run of
consecutive batches of its plan that members' slots hold (source or copy, decoded or being
decoded) up to the furthest one. Its stream serves the plan's
batches ``k .. n-1`` then ``0 .. k-1`` (``streams.Stream.rotation``), each under its own
batch index, so the first ``n - k`` are the group's batches, claimed as any member's, and
the rest come after the group moved on: decoded for itself (or copied from anyone at them).
That is how it catches up: level with the group from its first batch, the batches it
missed served last. When ``k`` is less than its ring's slots it starts at 0 instead, as a
lone Loader: its prefetch reaches the group's batches anyway, and members started a moment
apart get identical epochs. The client learns ``k`` from the first batch's index and saves
the rotation with its state (``batchd._state``), so resume is exact; an elastic resume of a
rotated epoch deals the rest of the rotated global order (``planning.sampling``).

Why a copy, not one slot that every member's client reads: a copy costs about 1 ms of
server CPU per 9.6 MB batch, about 1% of the decode it replaces (``bench/share_copy.py``),
while a slot read by several clients would need (1) the wire to name another session's
segment in a doorbell notice, and the client to map it and check its token as it does its own
ring at OpenSession (and on CUDA register it too, or copy it through the pinned pool: the
copy would move to the client, not go away); (2) a slot state for "released by its owner,
still read by others", and a session's close that keeps its ring and its share of the shm
budget while another client reads it; (3) a bound on the source's slots a stalled reader
may pin, past which readers decode their own, or the stalled one holds up the source. A
copy needs none of this: the source's slot is read only under the group's lock, within the
claim, and no member ever holds another's slot.

A source whose task was cancelled (its stream ended before a worker took it) hands the
batch to the first member waiting for it, which decodes it into its own slot; a source's
task that failed (a hung batch, a sample under on_error="raise") fails the waiters' copies
the same way, as their own decode of the same batch would have.

Locks: a session's lock, then the group's, never the other way round. Waiters' futures
are resolved outside the group's lock, and outside any session's (their done-callbacks take
their own session's lock): on the worker pool's thread, or one of their own.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import math
import threading
from collections.abc import Callable
from concurrent.futures import CancelledError, Future
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np

from batchd_server import metrics
from batchd_server.logs import session_log_id
from batchd_server.planning.sampling import EpochPlan
from batchd_server.sessions.options import SessionOptions
from batchd_server.workers.task import BatchResult, BatchTask, SlotField

__all__ = ["ShareCounts", "ShareGroup", "ShareGroups", "ShareMember", "group_key"]

logger = logging.getLogger(__name__)


class ShareMember(Protocol):
    """A session, as its group sees it."""

    id: str
    layout: tuple[SlotField, ...]

    def slot_memory(self, slot: int) -> memoryview:
        """The bytes of slot ``slot`` of the session's ring."""
        ...


class SubmitsTasks(Protocol):
    def submit(self, task: BatchTask) -> Future[BatchResult]: ...


BatchKey = tuple[int, int, bytes]
"""A batch's identity: epoch, index, sample positions."""


def group_key(options: SessionOptions, snapshot: str) -> str:
    """What a session's group is named by: its share key and everything that decides its
    batches (``snapshot``: the token that pins every source, as OpenSession answers it)."""
    # The snapshot token names every source's version and rows: a version asked for by name
    # and the newest one resolved to it are the same batches.
    batches = dataclasses.replace(options, prefetch=1, snapshot=None, version=None)
    return f"{options.share}\x00{snapshot}\x00{batches!r}"


class ShareCounts:
    """Batches decoded and copied by every group of a server, since it started."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.decoded = 0
        self.copied = 0

    def add(self, *, decoded: int = 0, copied: int = 0) -> None:
        with self._lock:
            self.decoded += decoded
            self.copied += copied


@dataclass(eq=False)
class _Waiter:
    member: ShareMember
    task: BatchTask
    future: Future[BatchResult]


@dataclass(eq=False)
class _Source:
    """A member's slot that holds (or is being filled with) a batch."""

    key: BatchKey
    member: ShareMember
    slot: int
    future: Future[BatchResult]
    waiters: list[_Waiter] = field(default_factory=list)


class ShareGroup:
    """The members of one group and the batches their slots hold; thread-safe."""

    def __init__(
        self,
        key: str,
        share: str,
        dataset: str,
        layout: tuple[SlotField, ...],
        pool: SubmitsTasks,
        totals: ShareCounts,
    ) -> None:
        self.key = key
        self.layout = layout
        """Where each field lies in every member's slots (the same options, the same layout)."""
        self.share = share
        self.dataset = dataset
        self._pool = pool
        self._lock = threading.Lock()
        self.members: set[str] = set()
        """Ids of the open sessions in the group (the registry's to change)."""
        self._sources: dict[BatchKey, _Source] = {}
        self._copies: dict[BatchKey, dict[tuple[str, int], _Source]] = {}
        """Slots that got a batch as a copy, by batch and (member id, slot): they hold it
        too, so a member that asks after the decoding slot was freed copies from one."""
        self._held: dict[tuple[str, int], BatchKey] = {}
        """(member id, slot) -> the batch that slot holds (decoded into it, or copied)."""
        self.decoded = 0
        """Batches a member's worker task decoded."""
        self.copied = 0
        """Batches a member got as a copy of another's slot."""
        self._totals = totals

    def position(self, epoch: int, plan: EpochPlan) -> int:
        """Where a member that starts ``epoch`` afresh (its whole ``plan``) would join the
        group: the first batch of the run of consecutive batches that members' slots hold
        (decoded, being decoded, or copied) up to the furthest one held; 0 when none is.

        A run, not simply the first batch held: a batch a member's loop keeps long after
        (or whose release is still on its way) must not pull a joiner back to it."""
        with self._lock:
            keys = [
                (index, positions)
                for (e, index, positions) in self._sources.keys() | self._copies.keys()
                if e == epoch and index < plan.num_batches
            ]
        # Members of one group plan the same batches; an elastic resume's are others.
        held = {index for index, positions in keys if plan.batch(index).tobytes() == positions}
        if not held:
            return 0
        first = max(held)
        while first - 1 in held:
            first -= 1
        return first

    def claim(self, member: ShareMember, task: BatchTask) -> Future[BatchResult]:
        """The future of ``task`` (batch ``task.batch_index`` into ``member``'s slot
        ``task.slot``, a WORKING slot): decoded by a worker, or copied from another member.

        Raises:
            Unavailable: the pool refused the task (as ``WorkerPool.submit``).
        """
        key: BatchKey = (task.epoch, task.batch_index, task.positions)
        with self._lock:
            source = self._sources.get(key)
            if source is None or source.future.cancelled():
                copies = self._copies.get(key)
                if not copies:
                    return self._decode(member, key, task)
                source = next(iter(copies.values()))
            if not source.future.done():
                waiter = _Waiter(member, task, Future())
                source.waiters.append(waiter)
                return waiter.future
            if source.future.exception() is not None:
                return self._decode(member, key, task)
            done = self._copy(source, member, task.slot)
        ready: Future[BatchResult] = Future()
        ready.set_result(done)
        return ready

    def _decode(self, member: ShareMember, key: BatchKey, task: BatchTask) -> Future[BatchResult]:
        """Hand ``task`` to the workers; its slot is the batch's source from now on (caller
        holds the lock)."""
        future = self._pool.submit(task)
        source = _Source(key, member, task.slot, future)
        old = self._sources.get(key)
        if old is not None:  # cancelled or failed, and its waiters not served yet: now they
            self._held.pop((old.member.id, old.slot), None)  # wait for this decode
            source.waiters, old.waiters = old.waiters, []
        self._sources[key] = source
        self._held[(member.id, task.slot)] = key
        self.decoded += 1
        self._totals.add(decoded=1)
        _when_done(future, functools.partial(self._decoded, key))
        return future

    def _copy(self, source: _Source, member: ShareMember, slot: int) -> BatchResult:
        """Copy the batch of ``source`` (done) into ``member``'s ``slot`` (caller holds the
        lock, so the source's slot cannot be freed and reused meanwhile)."""
        result = source.future.result()
        into, out = member.slot_memory(slot), source.member.slot_memory(source.slot)
        for f in self.layout:  # what the batch fills of each field, not the whole slot
            shape = result.shapes.get(f.name)
            nbytes = (
                f.capacity_bytes if shape is None else math.prod(shape) * np.dtype(f.dtype).itemsize
            )
            into[f.offset : f.offset + nbytes] = out[f.offset : f.offset + nbytes]
        self.copied += 1
        self._totals.add(copied=1)
        metrics.record_shared_batch(self.dataset)
        copy = dataclasses.replace(result, slot=slot)
        held: Future[BatchResult] = Future()
        held.set_result(copy)
        self._copies.setdefault(source.key, {})[(member.id, slot)] = _Source(
            source.key, member, slot, held
        )
        self._held[(member.id, slot)] = source.key
        return copy

    def _decoded(self, key: BatchKey, future: Future[BatchResult]) -> None:
        """A source's task is done (or cancelled): serve whoever waits for it. A cancel runs
        this under the cancelling session's lock, a failure may run it under the pool's:
        then it runs on a thread of its own, since it takes the group's lock."""
        if future.cancelled() or future.exception() is not None:
            _later([functools.partial(self._serve, key, future)])
        else:
            self._serve(key, future)

    def _serve(self, key: BatchKey, future: Future[BatchResult]) -> None:
        with self._lock:
            source = self._sources.get(key)
            if source is None or source.future is not future:
                return  # forgotten or replaced first: its waiters were handed on then
            if future.cancelled():
                self._drop(source)
            settle = self._settle(source)
        for action in settle:
            action()

    def _settle(self, source: _Source) -> list[Callable[[], object]]:
        """Serve the waiters of ``source`` (caller holds the lock): copies of its batch when
        it was decoded, its error when it failed; when it never will be (cancelled, or its
        session closed first), the first live waiter decodes the batch itself and the others
        wait for that. Returns what to do once the lock is released."""
        waiters, source.waiters = source.waiters, []
        future = source.future
        actions: list[Callable[[], object]] = []
        if future.done() and not future.cancelled():
            error = future.exception()
            for w in waiters:
                if not w.future.set_running_or_notify_cancel():
                    continue  # its stream ended and freed its slot: write nothing
                if error is not None:
                    actions.append(functools.partial(w.future.set_exception, error))
                else:
                    copy = self._copy(source, w.member, w.task.slot)
                    actions.append(functools.partial(w.future.set_result, copy))
            return actions
        live = [w for w in waiters if not w.future.cancelled()]
        while live:
            first = live.pop(0)
            if first.future.set_running_or_notify_cancel():
                break
        else:
            return actions
        try:
            own = self._decode(first.member, source.key, first.task)
        except BaseException as e:  # the pool refused the task: it refuses theirs too
            for w in [first, *(w for w in live if w.future.set_running_or_notify_cancel())]:
                actions.append(functools.partial(w.future.set_exception, e))
            return actions
        _when_done(own, functools.partial(_chain, first.future))
        self._sources[source.key].waiters.extend(live)
        return actions

    def _drop(self, source: _Source) -> None:
        """``source`` holds its batch no more (caller holds the lock)."""
        self._held.pop((source.member.id, source.slot), None)
        if self._sources.get(source.key) is source:
            del self._sources[source.key]

    def forget(self, member: ShareMember, slot: int) -> None:
        """``member``'s ``slot`` is free: it is no batch's source any more (called under the
        member's lock, before the slot can be reused). Members still waiting for it get
        their copy now."""
        with self._lock:
            settle = self._forget(member.id, slot)
        _later(settle)

    def _forget(self, member_id: str, slot: int) -> list[Callable[[], object]]:
        key = self._held.get((member_id, slot))
        source = None if key is None else self._sources.get(key)
        if source is None or source.member.id != member_id or source.slot != slot:
            self._held.pop((member_id, slot), None)
            if key is not None and (copies := self._copies.get(key)) is not None:
                copies.pop((member_id, slot), None)
                if not copies:
                    del self._copies[key]
            return []
        self._drop(source)
        return self._settle(source)

    def leave(self, member: ShareMember) -> None:
        """``member`` closed (its ring is still mapped): none of its slots is a source any
        more; members waiting on one get their copy, or decode the batch themselves."""
        settle: list[Callable[[], object]] = []
        with self._lock:
            for member_id, slot in [k for k in self._held if k[0] == member.id]:
                settle += self._forget(member_id, slot)
        for action in settle:
            action()

    def sources(self) -> int:
        """Batches the group's slots hold now."""
        with self._lock:
            return len(self._sources.keys() | self._copies.keys())


def _later(actions: list[Callable[[], object]]) -> None:
    """Run ``actions`` (resolving waiters' futures) on a thread of their own: the caller
    holds its session's lock, and a waiter's done-callbacks take the waiter's session's."""
    if actions:
        threading.Thread(
            target=lambda: [a() for a in actions], name="batchd-share-settle", daemon=True
        ).start()


def _when_done(future: Future[BatchResult], fn: Callable[[Future[BatchResult]], object]) -> None:
    """Call ``fn(future)`` once ``future`` is done: on the thread that finishes it, or, when it
    is done already (a fast worker), on a thread of its own, never inside this call, whose
    caller holds the group's lock and a session's."""
    registered = False

    def done(f: Future[BatchResult]) -> None:
        if registered:
            fn(f)
        else:
            _later([functools.partial(fn, f)])

    future.add_done_callback(done)
    registered = True


def _chain(waiter: Future[BatchResult], own: Future[BatchResult]) -> None:
    """Resolve ``waiter`` (set running) as ``own`` resolved."""
    if own.cancelled():
        waiter.set_exception(CancelledError())
    elif (error := own.exception()) is not None:
        waiter.set_exception(error)
    else:
        waiter.set_result(own.result())


class ShareGroups:
    """The server's share groups, by :func:`group_key`; a group lives while it has members."""

    def __init__(self, pool: SubmitsTasks) -> None:
        self._pool = pool
        self._lock = threading.Lock()
        self._groups: dict[str, ShareGroup] = {}
        self.counts = ShareCounts()

    def join(self, member: ShareMember, options: SessionOptions, snapshot: str) -> ShareGroup:
        """The group ``member`` (a session opened with ``options.share``) is in now."""
        key = group_key(options, snapshot)
        with self._lock:
            group = self._groups.get(key)
            if group is None:
                group = ShareGroup(
                    key, options.share, options.dataset, member.layout, self._pool, self.counts
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

    def leave(self, member: ShareMember, group: ShareGroup) -> None:
        """``member`` closed; call before its ring is released."""
        group.leave(member)
        with self._lock:
            group.members.discard(member.id)
            if not group.members and self._groups.get(group.key) is group:
                del self._groups[group.key]

    def __len__(self) -> int:
        with self._lock:
            return len(self._groups)
