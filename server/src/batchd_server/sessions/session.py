"""A session: one client's view of its sources, its ring of slots, and the epochs it streams.

A session serves one or more sources, each a split at a snapshot (``sources.py``); one split
is a mix of one (``planning.mixing.Mixing``). Its task positions are global over the sources'
rows concatenated in order. How slots move between states is NOTE [ Slot lifecycle ] in
``slots.py``; how many bad samples it lets through, ``error_budget.py``; who decodes its
batches and who else reads its slots, its dispatcher (``dispatch.py``).
"""

from __future__ import annotations

import functools
import itertools
import logging
import threading
import time
from collections.abc import Callable, Collection, Iterator, Sequence
from concurrent.futures import CancelledError, Future
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Final

import numpy as np

from batchd._wire.ring import HEADER_BYTES
from batchd_server.catalog_cache import CatalogEntry
from batchd_server.errors import DataLoss, InvalidArgument, NotFound
from batchd_server.logs import session_log_id
from batchd_server.metrics import admission, delivery
from batchd_server.metrics.stall import TimingAllowance
from batchd_server.planning.mixing import source_starts
from batchd_server.planning.packing import packed_mixing
from batchd_server.planning.sampling import EpochPlan
from batchd_server.sessions.accounting import MixAccount
from batchd_server.sessions.dispatch import WAIT, Dispatch, Loaned
from batchd_server.sessions.error_budget import ErrorBudget
from batchd_server.sessions.options import SessionOptions
from batchd_server.sessions.ready import Bell, ReadyBatch, field_views
from batchd_server.sessions.ring import SessionRing
from batchd_server.sessions.slots import SlotBook, SlotState
from batchd_server.sessions.streams import EpochPlans, Stream, StreamAt, may_join, stream_plan
from batchd_server.workers.deadline import HungBatch
from batchd_server.workers.task import BatchResult, BatchTask, ReadOptions, SessionSpec, SourceSpec

__all__ = ["Session"]

logger = logging.getLogger(__name__)

_POLL_S: Final = 0.25
"""How often a waiting stream re-checks that its client is still there."""
_MAX_STRIDE: Final = 1 << 16
"""More replicas than any pool has; bounds a hostile StreamStart.stride."""


class Session:
    """An open session. Thread-safe; see NOTE [ Slot lifecycle ]."""

    def __init__(
        self,
        *,
        session_id: str,
        options: SessionOptions,
        sources: tuple[CatalogEntry, ...],
        ring: SessionRing,
        dispatch: Dispatch,
        record_errors: Callable[[list[tuple[int, str, str]]], object],
        roots: Sequence[str] | None = None,
        read: ReadOptions | None = None,
    ) -> None:
        """``sources``: the catalog entry of each of ``options.mixing.sources``, in order;
        ``dispatch``: who decodes its batches, built around ``ring`` (``dispatch.py``);
        ``roots``: the directory the workers read each one's files from, as the manager
        checked it (symlinks resolved; default: the catalog's roots as they are)."""
        assert ring.id == session_id, "the session's own ring"
        self.id = session_id
        self.options = options
        self._mixing = packed_mixing(
            options.mixing,
            options.pack,
            (options.pipeline_kind, options.pipeline_options),
            [entry.arrays for entry in sources],
        )
        self.catalogs = sources
        """Every entry the session holds (the manager releases them all)."""
        assert len(sources) == len(self._mixing.sources), "one entry per source"
        if roots is None:
            roots = [entry.arrays.dataset.root for entry in sources]
        assert len(roots) == len(sources), "one root per source"
        self.source_rows = tuple(len(entry.arrays) for entry in sources)
        """Rows of each source in its snapshot."""
        self.source_samples = self._mixing.counts(self.source_rows)
        """Samples of each source in one epoch (all ranks): a split's rows, a mix's counts."""
        self.num_rows = sum(self.source_samples)
        """Samples of one epoch (all ranks, before padding or dropping): the split's rows in
        the catalog snapshot, or a mix's samples per epoch."""
        sampler = options.sampler
        splits = [entry.arrays for entry in sources]
        self._plans = EpochPlans(
            functools.partial(self._mixing.plan, splits, sampler), sampler.world_size
        )
        probe = self.plan(0)
        self.num_batches = probe.num_batches
        self.num_samples = len(probe.positions)
        self._account = (
            None if options.mix is None else MixAccount(options.mix, sampler, self.num_rows)
        )
        self.ring = ring
        self.layout, self.token = ring.layout, ring.token
        self.slots = ring.slots
        self.ring_ref = ring.ring_ref
        """The ring as a client maps it: its own (OpenSession) or another member's (a loan)."""
        self.dispatch = dispatch
        self.client = ring.client
        """Who opened the session (the identity its quotas count against)."""
        self.timings = TimingAllowance()
        """The batch timings its client may still report: one per batch delivered."""
        self._errors = ErrorBudget(
            session_id=session_id,
            dataset=options.dataset,
            max_error_fraction=options.max_error_fraction,
            epoch_samples=self.num_samples,
            record_errors=record_errors,
        )
        self.spec = SessionSpec(
            session_id=session_id,
            pipeline_kind=options.pipeline_kind,
            pipeline_options=options.pipeline_options,
            ring_segment=ring.segment.name,
            header_bytes=HEADER_BYTES,
            slot_bytes=ring.slot_bytes,
            fields=ring.layout,
            batch_size=sampler.batch_size,
            seed=sampler.seed,
            on_error=options.on_error,
            sources=tuple(
                SourceSpec(
                    entry.segment.name,
                    root,
                    int(start),
                    source.pipeline_kind or "",
                    source.pipeline_options,
                    entry.arrays.dataset.parquet_payload,
                    entry.arrays.dataset,
                )
                for entry, root, start, source in zip(
                    sources,
                    roots,
                    source_starts(self.source_rows),
                    self._mixing.sources,
                    strict=True,
                )
            ),
            shm_dir=str(ring.segment.path.parent),
            dataset=options.dataset,
            client=ring.client,
            read=read or ReadOptions(),
            pack=options.pack,
        )
        self._cond = threading.Condition()
        self._book = SlotBook(self.slots)
        self._leases: dict[int, int] = {}
        """Lease -> LEASED slot of every shm batch sent and not yet given back."""
        self._finishing: set[int] = set()
        """WORKING slots of ended streams, FREE once their workers are done."""
        self._lease_ids = itertools.count(1)
        self.bell: Bell | None = None
        """The client's doorbell connection, once it said hello (shm sessions)."""
        self._stream: Stream | None = None
        self.closed = False
        self.last_used = time.monotonic()
        self.opened_at = self.last_used
        self._delivered_any = False

    def plan(
        self, epoch: int, start: int = 0, order_world_size: int = 0, rotation: int = 0
    ) -> EpochPlan:
        """This rank's plan of ``epoch`` from global entry ``start`` on (an elastic resume;
        see ``planning.sampling``), the order built for ``order_world_size`` (0: the
        session's) and rotated to begin at its entry ``rotation``."""
        return self._plans(epoch, start, order_world_size, rotation)

    @property
    def streaming(self) -> bool:
        return self._stream is not None

    def position(self) -> tuple[Stream, int] | None:
        """The live stream and its first batch not yet delivered (being read, or the next to
        hand out); None without a stream. The node cache prefetches and evicts by it."""
        with self._cond:
            stream = self._stream
            if stream is None or stream.closed:
                return None
            due = stream.first_due()
            return stream, stream.index(due) if due < stream.plan.num_batches else due

    def slot_memory(self, slot: int) -> memoryview:
        return self.ring.slot_memory(slot)

    def slot_states(self) -> list[SlotState]:
        """Every slot's state, in slot order."""
        with self._cond:
            return [self._book.state(s) for s in range(self.slots)]

    def check_slots(self) -> None:
        """Assert that every slot is in exactly one state, and is where that state says:
        FREE on the free list, WORKING with a task of the stream (or finishing), DELIVERED
        awaiting an inline ack, LEASED under one lease. Tests call this after each step."""
        with self._cond:
            stream = self._stream
            places: list[tuple[int, SlotState]] = [
                *((s, SlotState.WORKING) for s in self._finishing),
                *((s, SlotState.LEASED) for s in self._leases.values()),
            ]
            if stream is not None:
                places += [(s, SlotState.WORKING) for s, _ in stream.working.values()]
                places += [(s, SlotState.DELIVERED) for s in stream.delivered.values()]
            places += [
                (s, self._book.state(s))
                for s in range(self.slots)
                if self._book.state(s) in (SlotState.FREE, SlotState.LENT)
            ]
            self._book.check(places)

    # -- streams --------------------------------------------------------------------------

    def attach_bell(self, bell: Bell) -> None:
        """``bell`` is now the client's doorbell; a previous connection is closed."""
        with self._cond:
            if self.closed:
                raise NotFound(f"session {self.id} is closed; open a new one")
            previous, self.bell = self.bell, bell
        if previous is not None:
            previous.close()

    def detach_bell(self, bell: Bell) -> None:
        with self._cond:
            if self.bell is bell:
                self.bell = None
            self._cond.notify_all()

    def start_stream(
        self,
        epoch: int,
        start_batch: int,
        *,
        start_sample: int = 0,
        order_world_size: int = 0,
        held_leases: Collection[int] | None = None,
        stride: int = 1,
        rotation: int = 0,
        join_share: bool = False,
        read_shared: bool = False,
    ) -> Stream:
        """Start streaming ``epoch`` at ``start_batch``, ending any previous stream.

        Args:
            start_sample: The epoch's plan starts at this entry of the global order (an
                elastic resume: what all ranks of the saving job consumed); ``start_batch``
                counts from there.
            order_world_size: The world size the epoch's order was built for; 0 means the
                session's.
            held_leases: For an shm stream, the leases the client still holds; every other
                delivered slot becomes free. None for an inline stream.
            stride: Serve batches ``start_batch``, ``start_batch + stride``, ... only (a
                client striping one session's batches over replicas); 0 means 1.
            rotation: A rotated epoch: its global order from this entry on, then its first
                entries (``StreamStart.rotation``).
            join_share: The client asks to start at its share group's position (a rotation
                by whole batches; ``StreamStart.join_share``), which the stream does only
                where ``streams.may_join`` says it may.
            read_shared: The (shm) client reads other sessions' rings: the share group may
                lend it another member's slot (``StreamStart.read_shared``).
        """
        if epoch < 0:
            raise InvalidArgument(f"epoch={epoch} must be >= 0")
        if not 0 <= stride <= _MAX_STRIDE:
            raise InvalidArgument(f"stride={stride} must be between 0 and {_MAX_STRIDE}")
        at = StreamAt(epoch, start_sample, order_world_size, rotation)
        joins = join_share and may_join(
            at, self.options.sampler, start_batch=start_batch, stride=stride
        )
        plan, batch_rotation = stream_plan(
            self.plan,
            self.options.sampler,
            at,
            join=self.dispatch.position if joins else None,
            slots=self.slots,
        )
        if not 0 <= start_batch <= plan.num_batches:
            raise InvalidArgument(
                f"start_batch={start_batch} must be between 0 and num_batches={plan.num_batches}"
            )
        with self._cond:
            if self.closed:
                raise NotFound(f"session {self.id} is closed; open a new one")
            previous = self._stream
        if previous is not None:
            # A session has one reader: its client. A new stream means that client gave up
            # on the old one (a break out of the loop, a retry after a network blip) and the
            # old call may not have ended on our side yet; it ends now.
            logger.debug(
                "session %s: a new stream replaces the one of epoch %d",
                session_log_id(self.id),
                previous.epoch,
            )
            self.end_stream(previous)
        with self._cond:
            if self.closed:  # closed (or expired) while the previous stream was ending
                raise NotFound(f"session {self.id} is closed; open a new one")
            raced = self._stream
            if raced is not None:
                # Another start (an inline call racing a doorbell START) set its stream while
                # ours ended the previous one: the last to get here is the client's one
                # stream, so that one ends too (the lock is reentrant).
                self.end_stream(raced)
            if held_leases is not None:
                still_held = set(held_leases)
                for lease in [x for x in self._leases if x not in still_held]:
                    self._give_back(self._leases.pop(lease), SlotState.LEASED)
            stream = Stream(
                epoch,
                start_batch,
                plan,
                start_batch,
                leased=held_leases is not None,
                read_shared=read_shared and held_leases is not None,
                stride=max(stride, 1),
                start_sample=start_sample,
                order_world_size=order_world_size,
                rotation=batch_rotation,
            )
            self._stream = stream
            self.last_used = time.monotonic()
        admission.STREAMS.inc()
        return stream

    def ack(self, stream: Stream, batch_indices: list[int]) -> None:
        """Inline: the client received these batches of ``stream``."""
        with self._cond:
            for k in batch_indices:
                slot = stream.delivered.pop(k, None)
                if slot is None:
                    continue  # a duplicate ack, or one for a stream that ended: harmless
                self._give_back(slot, SlotState.DELIVERED)
            # The freed slot goes to a worker now, not when the stream next looks: it may be
            # waiting for a batch that takes a while, and an idle worker is lost throughput.
            self._fill(stream)
            self._cond.notify_all()

    def release(self, leases: list[int]) -> None:
        """shm: the client is done with the slots of these leases (from any stream)."""
        with self._cond:
            for lease in leases:
                slot = self._leases.pop(lease, None)
                if slot is not None:  # else late or repeated: harmless
                    self._give_back(slot, SlotState.LEASED)
            if self._stream is not None:
                self._fill(self._stream)
            self._cond.notify_all()

    def end_stream(self, stream: Stream) -> None:
        """Finish ``stream`` (idempotent); its slots come back as NOTE [ Slot lifecycle ] says."""
        with self._cond:
            if stream.closed:
                return
            stream.closed = True
            for slot in stream.delivered.values():
                self._give_back(slot, SlotState.DELIVERED)
            stream.delivered.clear()
            working = list(stream.working.values())
            stream.working.clear()
            for slot, future in working:
                if future.cancel():
                    self._give_back(slot, SlotState.WORKING)
                else:
                    self._finishing.add(slot)
                    future.add_done_callback(functools.partial(self._slot_done, slot))
            if self._stream is stream:
                self._stream = None
            self.last_used = time.monotonic()
            self._cond.notify_all()
        admission.STREAMS.dec()

    def _slot_done(self, slot: int, _future: Future[BatchResult]) -> None:
        with self._cond:
            self._finishing.discard(slot)
            self._give_back(slot, SlotState.WORKING)
            self._cond.notify_all()

    def batches(self, stream: Stream, client_active: Callable[[], bool]) -> Iterator[ReadyBatch]:
        """The stream's batches in order; returns early when the client or the session goes.

        Raises:
            DataLoss: a sample failed under on_error="raise", the epoch's errors passed
                max_error_fraction, or a batch kept killing workers.
        """
        for i in range(stream.start, stream.plan.num_batches, stream.stride):
            k = stream.index(i)
            with self._cond:
                while True:
                    if stream.closed or self.closed or not client_active():
                        return
                    if (revoked := self.dispatch.revoked()) is not None:
                        raise revoked
                    self._fill(stream)
                    if k in stream.working:
                        break
                    self._cond.wait(_POLL_S)
                slot, future = stream.working[k]
            result = self._result(stream, future, client_active)
            if result is None:
                return
            with self._cond:
                while (loan := self.dispatch.lend(slot)) is WAIT:
                    # Its client holds its share of another member's slots already; it gives
                    # one back as its loop moves on (release() wakes this).
                    if stream.closed or self.closed or not client_active():
                        return
                    if (revoked := self.dispatch.revoked()) is not None:
                        raise revoked
                    self._cond.wait(_POLL_S)
                if stream.closed:
                    return
                del stream.working[k]
                self._book.sent(slot, leased=stream.leased)
                lease = 0
                if stream.leased:
                    lease = next(self._lease_ids)
                    self._leases[lease] = slot
                else:
                    stream.delivered[k] = slot
            self.timings.delivered()
            yield self._ready(stream, result, lease, loan)

    def _fill(self, stream: Stream) -> None:
        """Hand the stream's next batches to the workers while slots are free (under the lock)."""
        while (
            not stream.closed
            and stream.next_submit < stream.plan.num_batches
            and self._book.has_free()
        ):
            k, slot = stream.index(stream.next_submit), self._book.take()
            task = BatchTask(self.spec, stream.epoch, k, slot, stream.plan.batch(k).tobytes())
            try:
                future = self.dispatch.submit(task, borrow=stream.read_shared)
            except BaseException:  # the pool refused (shutting down, workers crash-looping)
                self._give_back(slot, SlotState.WORKING)
                raise
            stream.working[k] = (slot, future)
            stream.next_submit += stream.stride

    def _give_back(self, slot: int, was: SlotState) -> None:
        """The session is done with ``slot`` (in state ``was``; under the lock): LENT while
        other sessions' clients still read it, as its dispatcher says, else FREE."""
        if self.dispatch.keep(slot, functools.partial(self._repaid, slot)):
            self._book.lend(slot, was)
        else:
            self._free(slot, was)

    def _free(self, slot: int, was: SlotState) -> None:
        self._book.free(slot, was)
        self.dispatch.forget(slot)  # before the slot can be taken again: the lock is held

    def _repaid(self, slot: int) -> None:
        """The last session reading the LENT ``slot`` gave it back: FREE, and to work."""
        with self._cond:
            if self._book.state(slot) is not SlotState.LENT:
                return
            self._free(slot, SlotState.LENT)
            if self._stream is not None:
                self._fill(self._stream)
            self._cond.notify_all()

    def _result(
        self, stream: Stream, future: Future[BatchResult], client_active: Callable[[], bool]
    ) -> BatchResult | None:
        while True:
            try:
                return future.result(timeout=_POLL_S)
            except FutureTimeout:
                if stream.closed or self.closed or not client_active():
                    return None
            except CancelledError:  # the stream ended meanwhile and cancelled the task
                return None
            except HungBatch as e:
                named = "; ".join(self._describe_position(p) for p in e.positions)
                raise DataLoss(f"{e}. Samples it hung on: {named or 'none known'}") from e

    def _describe_position(self, position: int) -> str:
        """``sample <id> (<path>)`` of a task position (global over the sources in order)."""
        starts = source_starts(self.source_rows)
        index = int(np.searchsorted(starts, position, side="right")) - 1
        arrays = self.catalogs[index].arrays
        local = position - int(starts[index])
        return f"sample {arrays.ids[local]} ({arrays.path(local)})"

    def _ready(
        self,
        stream: Stream,
        result: BatchResult,
        lease: int,
        loan: Loaned | None,
    ) -> ReadyBatch:
        failures = result.failures
        if failures:
            self._errors.account(stream.epoch, result, stream.stride)
        views = field_views(self.layout, result.shapes)
        first, self._delivered_any = not self._delivered_any, True
        since_open_s = time.monotonic() - self.opened_at if first else None
        delivery.record_delivery(self.options.dataset, result.rows, since_open_s=since_open_s)
        if self._account is not None:
            memory = self.slot_memory(result.slot) if loan is None else loan[0].slot_memory(loan[1])
            self._account.record(memory, views, result.rows, stream, result.batch_index)
        return ReadyBatch(
            result.batch_index,
            result.slot if loan is None else loan[1],
            result.rows,
            views,
            [x.sample_id for x in failures],
            lease,
            None if loan is None else loan[0].ring_ref,
        )

    # -- closing --------------------------------------------------------------------------

    def expire(self, idle_s: float) -> bool:
        """Mark the session closed if it has had no stream for more than ``idle_s`` seconds;
        whether it did. Checked and marked under the session's lock, which starting a stream
        takes too: a stream that starts at the same moment either keeps the session open or
        is refused with NotFound, never ended by a close that did not see it."""
        with self._cond:
            if self.closed or self._stream is not None:
                return False
            if time.monotonic() - self.last_used <= idle_s:
                return False
            self.closed = True
            self._cond.notify_all()
            return True

    def close(self) -> list[Future[BatchResult]]:
        """Mark closed and end any stream; returns the tasks still writing into the ring."""
        with self._cond:
            self.closed = True
            stream = self._stream
            busy = [f for _, f in stream.working.values()] if stream is not None else []
            bell, self.bell = self.bell, None
        if bell is not None:
            bell.close()
        if stream is not None:
            self.end_stream(stream)
        return [f for f in busy if not f.done()]
