"""Share groups: co-located sessions that read the same batches decode each of them once.

# NOTE [ Share groups ]
A session opened with ``share="<key>"`` joins the group of every open session with the same
key that asks for the same batches: same sources at the same snapshot, pipeline, sampling,
seed, batch size, rank and world size, drop_last, on_error and error fraction
(``share_groups.group_key``; ``prefetch`` may differ). Sessions with the same key but other
parameters are simply in another group: they share nothing, and nothing fails.

Each member stays a whole session of its own: its own ring, stream, cursor, leases and
resume state, exactly as a lone Loader's. Only where a batch's bytes come from changes: a
member's dispatcher (``dispatch.py``) is its group's (``share_groups.GroupDispatch``). When a
member's stream hands batch ``k`` of an epoch on (``Session._fill``), it takes a slot of its
own ring as always (the slot is its client's credit: the ring still bounds how far it runs
ahead) and submits it to its dispatcher, which asks the group (:meth:`ShareGroup.claim`), by
the batch's identity: epoch, index and sample positions (which the plan, a pure function of
seed, epoch and world size, decides):

  * no member holds that batch: the member decodes it into its own slot (a worker task, as
    alone) and the group notes that slot as the batch's *source* while it holds the batch;
  * another member's slot holds it, decoded, and the member's client reads shared slots
    (an shm stream started with ``StreamStart.read_shared``): the member *borrows* that
    slot, a loan. Its notice names the other member's ring and slot
    (``StreamBatchesResponse.ring``), its client maps that ring once and reads the batch in
    place, and the lease it gives back frees its own credit slot and repays the loan. The
    batch was written once and every reader reads that one copy;
  * the same, for a client that cannot read another ring (inline, an older client, a CUDA
    client that registered its own ring), or past the bounds below: its bytes are copied
    into the member's slot now (a memcpy, no worker);
  * another member's worker is still writing it: the member waits for that task and gets a
    loan or a copy when it is done (its slot stays WORKING meanwhile, as for its own task).

A slot that got a batch as a copy holds it too, and serves later members as the decoding
slot does. As a session gives a slot back (its client acked or released the batch, or its
stream ended), it asks its dispatcher first whether others still read it
(:meth:`ShareGroup.keep`), then tells its ``SlotBook``: LENT (``slots.py``) while the slot is
out on loan, until the last borrower's lease comes back (nobody borrows it again meanwhile),
else FREE, and the group forgets the slot (:meth:`ShareGroup.forget`, under the session's
lock, before the slot can be reused). A release flows one way: session, then dispatcher and
group, then book. A member that closes with slots out on loan keeps its ring, and its share
of the shm budget, until they are repaid (:meth:`ShareGroup.leave`); a borrower that closes
repays its loans then.

Bounds, so that no member waits for another's client: a stalled member simply stops
producing, the others decode what they need themselves (the stalled one is "split off" as
soon as it is more than a ring behind them: the rings' windows are the bound), and a member
that falls behind decodes its own batches until it is within the window of another member,
then shares again. What a *reader* holds of another member's ring is bounded too, since a
sent notice cannot be taken back: (1) its client holds at most ``LOANS_OUT`` notices of one
member's slots at once (``batchd._wire.share``; its loop holds at most ``BORROWED_HELD`` of
them as tensors and copies further ones out), and its stream sends the next loan only once
it gave one back (:meth:`ShareGroup.lend_out` answers WAIT; the reader waits for its own
client only); a share group's rings have ``LOANS_OUT`` slots more than a lone session's for
this (``share_groups.lent_slots``), so a stalled reader pins none of the owner's own window;
(2) other members' clients hold at most half a member's slots (:func:`lend_limit`); past
that a reader gets a copy; (3) a loan whose notice has not gone out when the owner's client
gives the slot back becomes a copy then (:meth:`ShareGroup.keep`), so a LENT slot waits only
for clients that have it; (4) once its own session is done with a slot (LENT, or its member
left), a loan keeps it for at most ``--share-loan-timeout-s``: then :meth:`ShareGroup.reclaim`
ends it, and the borrower's stream ends with an error saying why (``Dispatch.revoked``); (5)
a ring a left member's loans keep counts against the quota of each client still reading it
(:meth:`ShareGroup.kept_bytes`), and its clients map other members' rings read-only.

Every member gets every batch of its epoch exactly once, in its own plan's order (rotated,
for one that joined late): the group only decides who decodes, and where a batch is read.

A member's stream that asks to join (``StreamStart.join_share``: a ``share=`` Loader asks
at every epoch) and may, which the server alone decides (``streams.may_join``: a fresh epoch,
served whole by one stream, of a job of one rank; the ranks of a larger job are each in their
own group, at its own position, and must serve one order) starts at the group's position
(:meth:`ShareGroup.position`): the first batch ``k`` of the run of consecutive batches of its
plan that members' slots hold (source or copy, decoded or being decoded) up to the furthest
one. Its stream serves the plan's batches ``k .. n-1`` then ``0 .. k-1``
(``streams.Stream.rotation``), each under its own batch index, so the first ``n - k`` are the
group's batches, claimed as any member's, and the rest come after the group moved on: decoded
for itself (or shared from anyone at them). That is how it catches up: level with the group
from its first batch, the batches it missed served last. When ``k`` is less than its ring's
slots it starts at 0 instead, as a lone Loader: its prefetch reaches the group's batches
anyway, and members started a moment apart get identical epochs. The client learns whether
and where it joined from the first batch's index, and saves the rotation with its state
(``batchd._state``), so resume is exact; an elastic resume of a rotated epoch deals the rest
of the rotated global order (``planning.sampling``).

Why the copy stays beside the loan: it costs about 1 ms of server CPU per 9.6 MB batch,
about 1% of the decode it replaces (``bench/share_copy.py``), and it serves the readers a
loan cannot (an inline stream copies the slot into messages anyway) and bounds what a slow
reader may hold of another member's ring.

A source whose task was cancelled (its stream ended before a worker took it) hands the
batch to the first member waiting for it, which decodes it into its own slot; a source's
task that failed (a hung batch, a sample under on_error="raise") fails the waiters' copies
the same way, as their own decode of the same batch would have.

Locks: a session's lock, then the group's, never the other way round. Waiters' futures
are resolved outside the group's lock, and outside any session's (their done-callbacks take
their own session's lock): on the worker pool's thread, or one of their own. So is a LENT
slot's release when its last loan is repaid (it takes its owner's lock).
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import math
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future

import numpy as np

from batchd._wire.share import LOANS_OUT
from batchd_server.errors import BatchdError, ResourceExhausted
from batchd_server.logs import session_log_id
from batchd_server.metrics.delivery import record_shared_batch
from batchd_server.planning.sampling import EpochPlan
from batchd_server.sessions.dispatch import WAIT, Loaned, Wait
from batchd_server.sessions.ready import SubmitsTasks
from batchd_server.sessions.ring import ShareMember
from batchd_server.sessions.share_futures import chain, later, when_done
from batchd_server.sessions.share_records import BatchKey, Loan, ShareCounts, Source, Waiter
from batchd_server.workers.task import BatchResult, BatchTask, SlotField

__all__ = ["DEFAULT_LOAN_TIMEOUT_S", "ShareGroup", "lend_limit"]

logger = logging.getLogger(__name__)

DEFAULT_LOAN_TIMEOUT_S = 300.0
"""``--share-loan-timeout-s``'s default (``service_settings.SessionSettings``)."""


def lend_limit(slots: int) -> int:
    """How many of its ring's ``slots`` a member lets readers' clients hold at once: half,
    so that however slow its readers, it keeps the other half for its own batches."""
    return max(1, slots // 2)


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
        loan_timeout_s: float = DEFAULT_LOAN_TIMEOUT_S,
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
        self._sources: dict[BatchKey, Source] = {}
        self._copies: dict[BatchKey, dict[tuple[str, int], Source]] = {}
        """Slots that got a batch as a copy, by batch and (member id, slot): they hold it
        too, so a member that asks after the decoding slot was freed copies from one."""
        self._held: dict[tuple[str, int], BatchKey] = {}
        """(member id, slot) -> the batch that slot holds (decoded into it, or copied)."""
        self.decoded = 0
        """Batches a member's worker task decoded."""
        self.copied = 0
        """Batches a member got as a copy of another's slot."""
        self.read = 0
        """Batches a member read in another's slot (loans)."""
        self._loans: dict[tuple[str, int], Loan] = {}
        """(member id, its slot) -> the loan it reads its batch by."""
        self._lent: dict[tuple[str, int], set[tuple[str, int]]] = {}
        """(member id, slot) -> the (member id, slot) of each loan of it (none: no key)."""
        self._kept: dict[tuple[str, int], Callable[[], object]] = {}
        """Slots out on loan whose own session is done with them (LENT): what frees each
        once its last loan is repaid."""
        self._closing: dict[str, Callable[[], object]] = {}
        """Members that left with slots out on loan: what releases each one's ring once
        they are all repaid."""
        self._released: list[Callable[[], object]] = []
        """Ring releases due, run by whoever repaid the last loan once it lets go of the
        lock (on its own thread: a release takes no session's lock)."""
        self._totals = totals
        self.loan_timeout_s = loan_timeout_s
        """How long a loan may keep a slot (or a ring) that its own session is done with."""
        self._revoked: dict[str, BatchdError] = {}
        """Borrowers whose loans were reclaimed (:meth:`reclaim`), by member id: the error
        their stream ends with (:meth:`revoked`)."""

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

    def claim(
        self, member: ShareMember, task: BatchTask, *, borrow: bool = False
    ) -> Future[BatchResult]:
        """The future of ``task`` (batch ``task.batch_index`` into ``member``'s slot
        ``task.slot``, a WORKING slot): decoded by a worker, or shared from another member:
        borrowed (when ``borrow``: the member's client reads other members' rings; see
        :meth:`loan`) or copied.

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
                waiter = Waiter(member, task, Future(), borrow)
                source.waiters.append(waiter)
                return waiter.future
            if source.future.exception() is not None:
                return self._decode(member, key, task)
            done = self._share(source, member, task.slot, borrow=borrow)
        ready: Future[BatchResult] = Future()
        ready.set_result(done)
        return ready

    def _decode(self, member: ShareMember, key: BatchKey, task: BatchTask) -> Future[BatchResult]:
        """Hand ``task`` to the workers; its slot is the batch's source from now on (caller
        holds the lock)."""
        future = self._pool.submit(task)
        source = Source(key, member, task.slot, future)
        old = self._sources.get(key)
        if old is not None:  # cancelled or failed, and its waiters not served yet: now they
            self._held.pop((old.member.id, old.slot), None)  # wait for this decode
            source.waiters, old.waiters = old.waiters, []
        self._sources[key] = source
        self._held[(member.id, task.slot)] = key
        self.decoded += 1
        self._totals.add(decoded=1)
        when_done(future, functools.partial(self._decoded, key))
        return future

    def _share(
        self, source: Source, member: ShareMember, slot: int, *, borrow: bool
    ) -> BatchResult:
        """The batch of ``source`` (done) for ``member``'s ``slot``: a loan of the source's
        slot when the member may borrow and the source may lend, else a copy (caller holds
        the lock)."""
        if borrow and self._lendable(source):
            return self._lend(source, member, slot)
        return self._copy(source, member, slot)

    def _lendable(self, source: Source) -> bool:
        # A slot its own session is done with lends no more: new loans would pin it longer.
        return (source.member.id, source.slot) not in self._kept

    def _lend(self, source: Source, member: ShareMember, slot: int) -> BatchResult:
        """Lend the slot of ``source`` (done) to ``member``'s ``slot`` (caller holds the
        lock): the member's client will read the batch there (:meth:`lend_out`)."""
        loan = Loan(source, member, slot)
        self._loans[(member.id, slot)] = loan
        self._lent.setdefault((source.member.id, source.slot), set()).add((member.id, slot))
        return dataclasses.replace(source.future.result(), slot=slot)

    def lend_out(self, member: ShareMember, slot: int) -> Loaned | Wait | None:
        """``member``'s batch in ``slot`` is to go out now: the (member, slot) its client
        reads it in, when it is a loan; None when it is in ``slot`` itself (a copy is made
        now when other readers' clients hold half the source's slots already); WAIT while the
        member's client holds LOANS_OUT notices of the source's slots (it gives one back as
        its loop moves on). Called under the member's lock."""
        with self._lock:
            loan = self._loans.get((member.id, slot))
            if loan is None:
                return None
            owner, at = loan.source.member, loan.source.slot
            if loan.sent:
                return owner, at
            mine = 0
            others: set[int] = set()
            for x in self._loans.values():
                if x.sent and x.source.member.id == owner.id:
                    if x.member.id == member.id:
                        mine += 1
                    else:
                        others.add(x.source.slot)
            if mine >= LOANS_OUT:
                return WAIT
            if at not in others and len(others) >= lend_limit(owner.slots):
                settle = self._unlend(loan)
                assert not settle, "a slot with no loan out is kept by nobody"
                return None
            loan.sent = True
            self.read += 1
            self._totals.add(read=1)
            record_shared_batch(self.dataset, how="read")
            return owner, at

    def _unlend(self, loan: Loan) -> list[Callable[[], object]]:
        """Copy a loan not sent yet into the borrower's own slot, and forget it (caller holds
        the lock; the source's slot still holds the batch)."""
        self._copy(loan.source, loan.member, loan.slot)
        del self._loans[(loan.member.id, loan.slot)]
        return self._repay(loan)

    def _repay(self, loan: Loan) -> list[Callable[[], object]]:
        """``loan`` is over (taken off ``_loans`` already; caller holds the lock). Returns
        what to run once the lock is released: the slot's release, when it was the last loan
        and its session is done with it. The owner's ring's release, when the owner left and
        this was the last loan of its slots, goes to ``_released``."""
        owner = loan.source.member
        at = (owner.id, loan.source.slot)
        borrowers = self._lent[at]
        borrowers.discard((loan.member.id, loan.slot))
        if borrowers:
            return []
        del self._lent[at]
        actions = []
        if (kept := self._kept.pop(at, None)) is not None:
            actions.append(kept)
        if owner.id in self._closing and not any(m == owner.id for m, _ in self._lent):
            self._released.append(self._closing.pop(owner.id))
        return actions

    def loan(self, member: ShareMember, slot: int) -> Loaned | None:
        """The (member, slot) whose batch ``member``'s ``slot`` borrows, if it does."""
        with self._lock:
            loan = self._loans.get((member.id, slot))
            return None if loan is None else (loan.source.member, loan.source.slot)

    def keep(self, member: ShareMember, slot: int, free: Callable[[], object]) -> bool:
        """``member``'s session is done with ``slot``: True when other members' clients
        still read it (it stays LENT, and ``free()`` is called once the last gives it back),
        else False. Loans of it not sent yet become copies now. Called under the member's
        lock, as its book frees the slot."""
        with self._lock:
            at = (member.id, slot)
            for borrower in list(self._lent.get(at, ())):
                loan = self._loans[borrower]
                if not loan.sent:
                    settle = self._unlend(loan)
                    assert not settle, "the slot is not kept yet"
            if at not in self._lent:
                return False
            self._kept[at] = free
            self._pin(at)
            return True

    def _pin(self, at: tuple[str, int]) -> None:
        """The loans of slot ``at`` alone keep it from now on (caller holds the lock)."""
        now = time.monotonic()
        for borrower in self._lent.get(at, ()):
            loan = self._loans[borrower]
            if loan.pinned_at is None:
                loan.pinned_at = now

    def _copy(self, source: Source, member: ShareMember, slot: int) -> BatchResult:
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
        record_shared_batch(self.dataset, how="copied")
        copy = dataclasses.replace(result, slot=slot)
        held: Future[BatchResult] = Future()
        held.set_result(copy)
        self._copies.setdefault(source.key, {})[(member.id, slot)] = Source(
            source.key, member, slot, held
        )
        self._held[(member.id, slot)] = source.key
        return copy

    def _decoded(self, key: BatchKey, future: Future[BatchResult]) -> None:
        """A source's task is done (or cancelled): serve whoever waits for it. A cancel runs
        this under the cancelling session's lock, a failure may run it under the pool's:
        then it runs on a thread of its own, since it takes the group's lock."""
        if future.cancelled() or future.exception() is not None:
            later([functools.partial(self._serve, key, future)])
        else:
            self._serve(key, future)

    def _serve(self, key: BatchKey, future: Future[BatchResult]) -> None:
        with self._lock:
            source = self._sources.get(key)
            if source is None or source.future is not future:
                return  # forgotten or replaced first: its waiters were handed on then
            if future.cancelled():
                self._drop(source)
            settle = self._settle(source, lend=True)
        for action in settle:
            action()

    def _settle(self, source: Source, *, lend: bool) -> list[Callable[[], object]]:
        """Serve the waiters of ``source`` (caller holds the lock): its batch when it was
        decoded (a loan where ``lend`` and the waiter borrows, else a copy: ``lend`` is
        False when the source's slot is being freed), its error when it failed; when it
        never will be (cancelled, or its session closed first), the first live waiter
        decodes the batch itself and the others wait for that. Returns what to do once the
        lock is released."""
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
                    done = self._share(source, w.member, w.task.slot, borrow=lend and w.borrow)
                    actions.append(functools.partial(w.future.set_result, done))
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
        when_done(own, functools.partial(chain, first.future))
        self._sources[source.key].waiters.extend(live)
        return actions

    def _drop(self, source: Source) -> None:
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
            released, self._released = self._released, []
        for release in released:
            release()
        later(settle)

    def _forget(self, member_id: str, slot: int) -> list[Callable[[], object]]:
        if (loan := self._loans.pop((member_id, slot), None)) is not None:
            return self._repay(loan)
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
        return self._settle(source, lend=False)

    def leave(self, member: ShareMember, release: Callable[[], object] | None = None) -> None:
        """``member`` closed (its ring is still mapped): none of its slots is a source any
        more; members waiting on one get their copy, or decode the batch themselves; its
        own loans are repaid. ``release()`` (freeing its ring) is called now, or once the
        last loan of its slots is repaid: a borrower's client may be reading one."""
        settle: list[Callable[[], object]] = []
        with self._lock:
            for member_id, slot in [k for k in self._held if k[0] == member.id]:
                settle += self._forget(member_id, slot)
            for loan in [x for x in self._loans.values() if x.source.member.id == member.id]:
                if not loan.sent:  # its ring is still mapped: a copy now, not a loan later
                    settle += self._unlend(loan)
            for at in [k for k in self._loans if k[0] == member.id]:
                settle += self._repay(self._loans.pop(at))
            for at in [k for k in self._kept if k[0] == member.id]:
                del self._kept[at]  # its ring is released as a whole
            for at in [k for k in self._lent if k[0] == member.id]:
                self._pin(at)  # its loans alone keep its ring now, charged to their clients
            self._revoked.pop(member.id, None)
            if release is not None:
                if any(m == member.id for m, _ in self._lent):
                    self._closing[member.id] = release
                else:
                    settle.append(release)
            settle += self._released
            self._released = []
        for action in settle:
            action()

    def sources(self) -> int:
        """Batches the group's slots hold now."""
        with self._lock:
            return len(self._sources.keys() | self._copies.keys())

    def loans(self) -> int:
        """Loans not repaid yet."""
        with self._lock:
            return len(self._loans)

    def kept_bytes(self, client: str) -> int:
        """The bytes of the rings of members that closed and that only loans to ``client``'s
        sessions keep (with others'): each such ring counts whole against ``client``'s
        quota, since any one borrower keeps all of it."""
        with self._lock:
            rings = {
                loan.source.member.id: loan.source.member.ring_ref.segment_bytes
                for loan in self._loans.values()
                if loan.member.client == client and loan.source.member.id in self._closing
            }
        return sum(rings.values())

    def reclaim(self, now: float | None = None) -> int:
        """End every loan that kept a slot (or a closed member's ring) its session was done
        with for ``loan_timeout_s`` or more (``now``: ``time.monotonic()``'s clock): the
        slot is freed, the ring released once no loan keeps it, and the borrower's stream
        ends with an error saying why (:meth:`revoked`). How many loans it ended."""
        now = time.monotonic() if now is None else now
        settle: list[Callable[[], object]] = []
        with self._lock:
            expired = [
                (at, loan)
                for at, loan in self._loans.items()
                if loan.pinned_at is not None and now - loan.pinned_at >= self.loan_timeout_s
            ]
            for at, loan in expired:
                del self._loans[at]
                settle += self._repay(loan)
                self._revoked[loan.member.id] = ResourceExhausted(
                    f"this loader kept a batch it read in another share-group member's ring "
                    f"for {self.loan_timeout_s:g} s after that member was done with it "
                    "(--share-loan-timeout-s, BATCHD_SHARE_LOAN_TIMEOUT_S); the loan was "
                    "reclaimed and the batch's memory may be reused: do not keep batches "
                    "across steps (copy what you keep), or raise the timeout; then start the "
                    "epoch again from the loader's state"
                )
            settle += self._released
            self._released = []
        for action in settle:
            action()
        for _, loan in expired:
            logger.warning(
                "share group %r of %s: session %s kept a batch in session %s's slot %d for "
                "%g s after it was done with it; the loan is reclaimed and its stream ends",
                self.share,
                self.dataset,
                session_log_id(loan.member.id),
                session_log_id(loan.source.member.id),
                loan.source.slot,
                self.loan_timeout_s,
            )
        return len(expired)

    def revoked(self, member: ShareMember) -> BatchdError | None:
        """Why ``member``'s stream must end now: a loan of its was reclaimed (once: a
        stream started afterwards runs)."""
        if not self._revoked:  # the common case, on the stream's path: no lock
            return None
        with self._lock:
            return self._revoked.pop(member.id, None)
