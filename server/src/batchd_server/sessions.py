"""Sessions: one client's view of one split, its ring of slots, and the epochs it streams.

# NOTE [ Slot lifecycle ]
A session's ring has ``slots`` slots: ``prefetch`` of them, two for the batches in the
training loop's hands, and a few more when batches are small (see ``ring_slots``); each is
big enough for one full batch. A slot is
  FREE      -- nobody uses it;
  WORKING   -- a worker has been asked to fill it with batch k (the future is pending);
  DELIVERED -- batch k is in it and the client was told so; the client has not acked it.
A stream takes FREE slots for the next batches in order (so at most ``slots`` batches are
ahead of the client: the ack is the flow-control credit), sends batches strictly in order,
and an ack turns the slot FREE again. How a DELIVERED slot is acked depends on the stream:
  inline -- by batch index, on the stream's own call; when the stream ends for any reason
            (epoch done, client gone, session closed), its DELIVERED slots become FREE at
            once (their bytes were copied into messages anyway);
  shm    -- by the lease the batch was announced under, on the session's doorbell. Leases
            belong to the session, not the stream: a client's training loop may keep a
            batch's tensors (which are views of the slot) past the end of the epoch. Each
            StreamStart lists the leases the client still holds; every other DELIVERED slot
            becomes FREE then. Acks of unknown leases (late, repeated) are ignored.
In both cases, queued tasks are cancelled when a stream ends, and a WORKING slot becomes FREE
only when its worker has finished writing it, so a later stream never hands out a slot a
worker is still writing. The ring itself is released when the session closes
(CloseSession, lease expiry, shutdown), after every WORKING slot is done; workers are then
told to drop their mapping.
"""

from __future__ import annotations

import functools
import itertools
import logging
import os
import secrets
import threading
import time
from collections import deque
from collections.abc import Callable, Collection, Iterator
from concurrent.futures import CancelledError, Future
from concurrent.futures import TimeoutError as FutureTimeout
from concurrent.futures import wait as wait_futures
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from batchd_server import metrics
from batchd_server.catalog_cache import CatalogCache, CatalogEntry
from batchd_server.errors import (
    DataLoss,
    FailedPrecondition,
    InvalidArgument,
    NotFound,
    ResourceExhausted,
)
from batchd_server.pipelines.base import FieldSpec
from batchd_server.pipelines.registry import build_pipeline
from batchd_server.sampling import EpochPlan, SamplerOptions, plan_epoch
from batchd_server.shm.segments import Segment, ShmRegistry, format_bytes
from batchd_server.workers.pool import WorkerPool
from batchd_server.workers.task import BatchResult, BatchTask, SessionSpec, SlotField

if TYPE_CHECKING:
    from batchd_server.doorbell import ServerBell

__all__ = [
    "Delivered",
    "FieldView",
    "Session",
    "SessionManager",
    "SessionOptions",
    "Stream",
    "slot_layout",
]

logger = logging.getLogger(__name__)

HEADER_BYTES = 4096
"""The ring's first page holds the token a client checks to know it maps our segment."""
MAX_PREFETCH = 64
MAX_SLOT_BYTES = 4 << 30
_FIELD_ALIGN = 64
_SLOT_ALIGN = 4096  # page-aligned slots: cudaHostRegister and huge copies like it
_POLL_S = 0.25
"""How often a waiting stream re-checks that its client is still there."""
_MAX_PLANS = 2
_LOOP_SLOTS = 2
_EXTRA_SLOTS_MAX = 12
_EXTRA_SLOTS_BYTES = 8 << 20
_CLOSE_WAIT_S = 60.0


@dataclass(frozen=True, kw_only=True)
class SessionOptions:
    dataset: str
    version: str | None
    split: str
    sampler: SamplerOptions
    pipeline_kind: str
    pipeline_options: dict[str, Any]
    prefetch: int = 4
    snapshot: str | None = None
    on_error: str = "skip"
    max_error_fraction: float = 0.01

    def __post_init__(self) -> None:
        if not self.dataset:
            raise InvalidArgument("OpenSession needs a dataset name; got an empty one")
        if not 1 <= self.prefetch <= MAX_PREFETCH:
            raise InvalidArgument(f"prefetch={self.prefetch} must be between 1 and {MAX_PREFETCH}")
        if self.on_error not in ("skip", "raise", "replace"):
            raise InvalidArgument(
                f"on_error={self.on_error!r} must be 'skip', 'raise' or 'replace'"
            )
        if not 0.0 <= self.max_error_fraction <= 1.0:
            raise InvalidArgument(
                f"max_error_fraction={self.max_error_fraction} must be between 0 and 1"
            )


@dataclass(frozen=True)
class FieldView:
    name: str
    dtype: str
    shape: tuple[int, ...]
    offset: int
    nbytes: int


@dataclass(frozen=True)
class Delivered:
    """Batch ``batch_index`` is in ``slot``; ``fields`` are at offsets from the slot's start."""

    batch_index: int
    slot: int
    rows: int
    fields: list[FieldView]
    failed_sample_ids: list[int]
    lease: int = 0
    """shm streams: what the client acks to give the slot back (NOTE [ Slot lifecycle ])."""


def ring_slots(prefetch: int, slot_bytes: int) -> int:
    """Slots for a ring: ``prefetch``, 2 for the training loop, and up to 12 more in 8 MiB.

    ``prefetch`` batches are ahead of the loop; the loop itself holds one or two more (a
    client's default CPU tensors are views of their slot, and the batch just used is still
    referenced while the next is handed over), which must not come out of the prefetch.
    A batch's round trip (ack, dispatch, decode, notice) also caps a stream at roughly
    ``slots`` batches per round trip, whatever the batch costs to decode; small batches
    (records, tokens) hit that cap long before the CPUs are busy, and a deeper ring of them
    costs a few MiB.
    """
    return prefetch + _LOOP_SLOTS + min(_EXTRA_SLOTS_MAX, _EXTRA_SLOTS_BYTES // slot_bytes)


def slot_layout(fields: list[FieldSpec], batch_size: int) -> tuple[tuple[SlotField, ...], int]:
    """Place every field (plus ``sample_id`` and ``label``) in a slot; return the slot's size."""
    every = [
        *fields,
        FieldSpec("sample_id", np.dtype("<i8"), ()),
        FieldSpec("label", np.dtype("<i8"), ()),
    ]
    names = [f.name for f in every]
    if len(set(names)) != len(names):
        raise InvalidArgument(f"the pipeline's fields {names[:-2]} clash with sample_id or label")
    placed: list[SlotField] = []
    offset = 0
    for f in every:
        capacity = batch_size * f.sample_bytes()
        placed.append(SlotField(f.name, f.dtype.newbyteorder("<").str, f.shape, offset, capacity))
        offset += -(-capacity // _FIELD_ALIGN) * _FIELD_ALIGN
    slot_bytes = max(_SLOT_ALIGN, -(-offset // _SLOT_ALIGN) * _SLOT_ALIGN)
    return tuple(placed), slot_bytes


@dataclass(eq=False)
class Stream:
    """One StreamBatches call: an epoch from ``start`` to the session's last batch."""

    epoch: int
    start: int
    plan: EpochPlan
    next_submit: int
    """The next batch to hand to a worker once a slot is free."""
    leased: bool = False
    """An shm stream: delivered slots go out under session leases, not per batch index."""
    working: dict[int, tuple[int, Future[BatchResult]]] = field(default_factory=dict)
    delivered: dict[int, int] = field(default_factory=dict)
    """Inline streams: batch index -> slot, until acked."""
    closed: bool = False


class Session:
    """An open session. Thread-safe; see NOTE [ Slot lifecycle ]."""

    def __init__(
        self,
        *,
        session_id: str,
        options: SessionOptions,
        catalog: CatalogEntry,
        ring: Segment,
        layout: tuple[SlotField, ...],
        slot_bytes: int,
        token: bytes,
        pool: WorkerPool,
        record_errors: Callable[[list[tuple[int, str, str]]], object],
    ) -> None:
        self.id = session_id
        self.options = options
        self.catalog = catalog
        self.ring = ring
        self.layout = layout
        self.slot_bytes = slot_bytes
        self.token = token
        self._pool = pool
        self._record_errors = record_errors
        arrays = catalog.arrays
        self.n = len(arrays)
        sampler = options.sampler
        probe = plan_epoch(self.n, sampler, 0, **self._sampling_columns())
        self.num_batches = probe.num_batches
        self.num_samples = len(probe.positions)
        self._plans: dict[int, EpochPlan] = {0: probe}
        self.spec = SessionSpec(
            session_id=session_id,
            root=arrays.dataset.root,
            pipeline_kind=options.pipeline_kind,
            pipeline_options=options.pipeline_options,
            catalog_segment=catalog.segment.name,
            ring_segment=ring.name,
            header_bytes=HEADER_BYTES,
            slot_bytes=slot_bytes,
            fields=layout,
            batch_size=sampler.batch_size,
            seed=sampler.seed,
            on_error=options.on_error,
            shm_dir=str(ring.path.parent),
            dataset=options.dataset,
        )
        self._cond = threading.Condition()
        self.slots = (ring.nbytes - HEADER_BYTES) // slot_bytes
        """Slots in the ring (``ring_slots`` decided how many when it was reserved)."""
        self._free: deque[int] = deque(range(self.slots))
        self._leases: dict[int, int] = {}
        """Lease -> slot of every shm batch delivered and not yet given back."""
        self._lease_ids = itertools.count(1)
        self.bell: ServerBell | None = None
        """The client's doorbell connection, once it said hello (shm sessions)."""
        self._stream: Stream | None = None
        self._errors_by_epoch: dict[int, int] = {}
        self.closed = False
        self.last_used = time.monotonic()
        self.opened_at = self.last_used
        self._delivered_any = False

    def _sampling_columns(self) -> dict[str, Any]:
        mode = self.options.sampler.mode
        arrays = self.catalog.arrays
        return {
            "weights": arrays.weights if mode == "weighted" else None,
            "labels": arrays.labels if mode == "class_balanced" else None,
            "lengths": arrays.lengths if mode == "bucketed" else None,
        }

    def plan(self, epoch: int) -> EpochPlan:
        with self._cond:
            plan = self._plans.get(epoch)
        if plan is None:
            plan = plan_epoch(self.n, self.options.sampler, epoch, **self._sampling_columns())
            with self._cond:
                while len(self._plans) >= _MAX_PLANS:
                    self._plans.pop(next(iter(self._plans)))
                self._plans[epoch] = plan
        return plan

    @property
    def streaming(self) -> bool:
        return self._stream is not None

    def slot_memory(self, slot: int) -> memoryview:
        start = HEADER_BYTES + slot * self.slot_bytes
        return memoryview(self.ring.buf)[start : start + self.slot_bytes]

    # -- streams --------------------------------------------------------------------------

    def attach_bell(self, bell: ServerBell) -> None:
        """``bell`` is now the client's doorbell; a previous connection is closed."""
        with self._cond:
            if self.closed:
                raise NotFound(f"session {self.id} is closed; open a new one")
            previous, self.bell = self.bell, bell
        if previous is not None:
            previous.close()

    def detach_bell(self, bell: ServerBell) -> None:
        with self._cond:
            if self.bell is bell:
                self.bell = None
            self._cond.notify_all()

    def start_stream(
        self, epoch: int, start_batch: int, *, held_leases: Collection[int] | None = None
    ) -> Stream:
        """Start streaming ``epoch`` at ``start_batch``, ending any previous stream.

        Args:
            held_leases: For an shm stream, the leases the client still holds; every other
                delivered slot becomes free. None for an inline stream.
        """
        if epoch < 0:
            raise InvalidArgument(f"epoch={epoch} must be >= 0")
        if not 0 <= start_batch <= self.num_batches:
            raise InvalidArgument(
                f"start_batch={start_batch} must be between 0 and num_batches={self.num_batches}"
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
                "session %s: a new stream replaces the one of epoch %d", self.id, previous.epoch
            )
            self.end_stream(previous)
        plan = self.plan(epoch)
        with self._cond:
            if held_leases is not None:
                held = set(held_leases)
                for lease in [x for x in self._leases if x not in held]:
                    self._free.append(self._leases.pop(lease))
            stream = Stream(epoch, start_batch, plan, start_batch, leased=held_leases is not None)
            self._stream = stream
            self.last_used = time.monotonic()
        metrics.STREAMS.inc()
        return stream

    def ack(self, stream: Stream, batch_indices: list[int]) -> None:
        """Inline: the client received these batches of ``stream``."""
        with self._cond:
            for k in batch_indices:
                slot = stream.delivered.pop(k, None)
                if slot is None:
                    continue  # a duplicate ack, or one for a stream that ended: harmless
                self._free.append(slot)
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
                    self._free.append(slot)
            if self._stream is not None:
                self._fill(self._stream)
            self._cond.notify_all()

    def end_stream(self, stream: Stream) -> None:
        """Finish ``stream`` (idempotent); its slots come back as NOTE [ Slot lifecycle ] says."""
        with self._cond:
            if stream.closed:
                return
            stream.closed = True
            self._free.extend(stream.delivered.values())
            stream.delivered.clear()
            for slot, future in stream.working.values():
                if future.cancel():
                    self._free.append(slot)
                else:
                    future.add_done_callback(functools.partial(self._slot_done, slot))
            if self._stream is stream:
                self._stream = None
            self.last_used = time.monotonic()
            self._cond.notify_all()
        metrics.STREAMS.dec()

    def _slot_done(self, slot: int, _future: Future[BatchResult]) -> None:
        with self._cond:
            self._free.append(slot)
            self._cond.notify_all()

    def batches(self, stream: Stream, client_active: Callable[[], bool]) -> Iterator[Delivered]:
        """The stream's batches in order; returns early when the client or the session goes.

        Raises:
            DataLoss: a sample failed under on_error="raise", the epoch's errors passed
                max_error_fraction, or a batch kept killing workers.
        """
        for k in range(stream.start, self.num_batches):
            with self._cond:
                while True:
                    if stream.closed or self.closed or not client_active():
                        return
                    self._fill(stream)
                    if k in stream.working:
                        break
                    self._cond.wait(_POLL_S)
                slot, future = stream.working[k]
            result = self._result(stream, future, client_active)
            if result is None:
                return
            with self._cond:
                if stream.closed:
                    return
                del stream.working[k]
                lease = 0
                if stream.leased:
                    lease = next(self._lease_ids)
                    self._leases[lease] = slot
                else:
                    stream.delivered[k] = slot
            yield self._deliver(stream, result, lease)

    def _fill(self, stream: Stream) -> None:
        """Hand the stream's next batches to the workers while slots are free (under the lock)."""
        while not stream.closed and stream.next_submit < self.num_batches and self._free:
            k, slot = stream.next_submit, self._free.popleft()
            task = BatchTask(self.spec, stream.epoch, k, slot, stream.plan.batch(k).tobytes())
            stream.working[k] = (slot, self._pool.submit(task))
            stream.next_submit += 1

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

    def _deliver(self, stream: Stream, result: BatchResult, lease: int) -> Delivered:
        failures = result.failures
        if failures:
            self._account_errors(stream.epoch, result)
        views = []
        for f in self.layout:
            shape = result.shapes[f.name]
            nbytes = int(np.prod(shape, dtype=np.int64)) * np.dtype(f.dtype).itemsize
            views.append(FieldView(f.name, f.dtype, tuple(shape), f.offset, nbytes))
        first, self._delivered_any = not self._delivered_any, True
        since_open_s = time.monotonic() - self.opened_at if first else None
        metrics.record_delivery(self.options.dataset, result.rows, since_open_s=since_open_s)
        return Delivered(
            result.batch_index,
            result.slot,
            result.rows,
            views,
            [x.sample_id for x in failures],
            lease,
        )

    def _account_errors(self, epoch: int, result: BatchResult) -> None:
        for failure in result.failures:
            metrics.SAMPLE_ERRORS.labels(dataset=self.options.dataset, kind=failure.kind).inc()
            logger.warning(
                "session %s: sample %d (%s) failed: %s: %s%s",
                self.id,
                failure.sample_id,
                failure.path,
                failure.kind,
                failure.message,
                "" if failure.replaced_by is None else f"; replaced by {failure.replaced_by}",
            )
        try:
            self._record_errors([(x.sample_id, x.kind, x.message) for x in result.failures])
        except Exception:  # the catalog being down must not stop training
            logger.exception("could not record sample errors in the catalog")
        first = result.failures[0]
        if result.fatal:
            raise DataLoss(
                f"sample {first.sample_id} ({first.path}) failed: {first.kind}: "
                f"{first.message} (on_error='raise'; use 'skip' or 'replace' to go on past "
                "bad samples)"
            )
        with self._cond:
            count = self._errors_by_epoch.get(epoch, 0) + len(result.failures)
            self._errors_by_epoch[epoch] = count
        limit = self.options.max_error_fraction * self.num_samples
        if count > limit:
            raise DataLoss(
                f"{count} samples of epoch {epoch} failed, more than max_error_fraction="
                f"{self.options.max_error_fraction:g} of its {self.num_samples}; latest: "
                f"sample {first.sample_id} ({first.path}): {first.kind}: {first.message}. "
                "Fix or un-verify the bad samples (the catalog's sample_errors table lists "
                "them), or raise max_error_fraction"
            )

    # -- closing --------------------------------------------------------------------------

    def close(self) -> list[Future[BatchResult]]:
        """Mark closed and end any stream; returns the tasks still writing into the ring."""
        with self._cond:
            self.closed = True
            stream = self._stream
            bell, self.bell = self.bell, None
        if bell is not None:
            bell.close()
        if stream is not None:
            self.end_stream(stream)
        return [f for _, f in stream.working.values()] if stream is not None else []


class SessionManager:
    """Opens, finds, closes and expires sessions; owns their rings through ``registry``."""

    def __init__(
        self,
        *,
        catalog: CatalogCache,
        pool: WorkerPool,
        registry: ShmRegistry,
        lease_timeout_s: float,
        max_sessions: int,
        record_errors: Callable[[list[tuple[int, str, str]]], object],
        doorbell: str = "",
    ) -> None:
        self._catalog = catalog
        self._pool = pool
        self._registry = registry
        self.lease_timeout_s = lease_timeout_s
        self._max_sessions = max_sessions
        self._record_errors = record_errors
        self._sessions: dict[str, Session] = {}
        self.doorbell = doorbell
        """The doorbell socket's name in the shm directory (``RingLayout.doorbell``)."""
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._reaper = threading.Thread(target=self._reap, name="batchd-lease", daemon=True)
        self._reaper.start()

    def __len__(self) -> int:
        return len(self._sessions)

    def open(self, options: SessionOptions) -> Session:
        """Open a session.

        Raises:
            InvalidArgument, NotFound, FailedPrecondition, SnapshotMismatch,
            ResourceExhausted: as the message says.
        """
        with self._lock:
            if len(self._sessions) >= self._max_sessions:
                raise ResourceExhausted(
                    f"the server has {len(self._sessions)} open sessions, its limit "
                    "(BATCHD_MAX_SESSIONS); close loaders you no longer use"
                )
        pipeline = build_pipeline(options.pipeline_kind, options.pipeline_options)
        layout, slot_bytes = slot_layout(pipeline.fields(), options.sampler.batch_size)
        if slot_bytes > MAX_SLOT_BYTES:
            raise InvalidArgument(
                f"one batch would take {format_bytes(slot_bytes)}, more than the "
                f"{format_bytes(MAX_SLOT_BYTES)} a slot may hold; lower batch_size"
            )
        entry = self._catalog.acquire(
            options.dataset, options.version, options.split, options.snapshot
        )
        try:
            root = entry.arrays.dataset.root
            if not os.path.isdir(root):
                raise FailedPrecondition(
                    f"dataset {options.dataset!r} has root {root!r}, which is not a directory "
                    "on the server; mount the data there or re-ingest with the right --root"
                )
            slots = ring_slots(options.prefetch, slot_bytes)
            ring_bytes = HEADER_BYTES + slots * slot_bytes
            purpose = (
                f"{slots} slots of {format_bytes(slot_bytes)} for batch_size="
                f"{options.sampler.batch_size} of {options.dataset!r}"
            )
            ring = self._catalog.create_segment("ring", ring_bytes, purpose=purpose)
        except BaseException:
            self._catalog.release(entry)
            raise
        token = secrets.token_bytes(16)
        ring.buf[: len(token)] = token
        session_id = secrets.token_hex(16)
        try:
            session = Session(
                session_id=session_id,
                options=options,
                catalog=entry,
                ring=ring,
                layout=layout,
                slot_bytes=slot_bytes,
                token=token,
                pool=self._pool,
                record_errors=self._record_errors,
            )
            if session.num_batches == 0:
                raise FailedPrecondition(
                    f"drop_last=True leaves no batch: {session.n} samples over "
                    f"{options.sampler.world_size} rank(s) do not fill one batch of "
                    f"{options.sampler.batch_size}; lower batch_size or set drop_last=False"
                )
        except BaseException:
            self._registry.release(ring)
            self._catalog.release(entry)
            raise
        with self._lock:
            self._sessions[session_id] = session
            metrics.SESSIONS.set(len(self._sessions))
        logger.info(
            "session %s opened: %s/%s split %s, %d batches of %d on rank %d/%d, ring %s",
            session_id,
            options.dataset,
            entry.arrays.dataset.version,
            options.split,
            session.num_batches,
            options.sampler.batch_size,
            options.sampler.rank,
            options.sampler.world_size,
            format_bytes(ring.nbytes),
        )
        return session

    def get(self, session_id: str) -> Session:
        with self._lock:
            session = self._sessions.get(session_id)
        if session is None:
            raise NotFound(
                f"no open session {session_id!r}: it was closed, or expired after "
                f"{self.lease_timeout_s:g} s without a stream, or the server restarted; "
                "open a new one"
            )
        return session

    def close(self, session_id: str, *, reason: str = "closed by the client") -> bool:
        """Close a session and free its ring; False when there was no such session."""
        with self._lock:
            session = self._sessions.pop(session_id, None)
            metrics.SESSIONS.set(len(self._sessions))
        if session is None:
            return False
        busy = session.close()
        if busy:
            wait_futures(busy, timeout=_CLOSE_WAIT_S)
        self._pool.forget_session(session_id)
        self._registry.release(session.ring)
        self._catalog.release(session.catalog)
        logger.info("session %s %s; its ring is freed", session_id, reason)
        return True

    def _reap(self) -> None:
        interval = min(1.0, self.lease_timeout_s / 4)
        while not self._stop.wait(interval):
            now = time.monotonic()
            with self._lock:
                expired = [
                    s.id
                    for s in self._sessions.values()
                    if not s.streaming and now - s.last_used > self.lease_timeout_s
                ]
            for session_id in expired:
                self.close(
                    session_id,
                    reason=f"expired after {self.lease_timeout_s:g} s without a stream",
                )

    def close_all(self, timeout_s: float = _CLOSE_WAIT_S) -> None:
        """Close every session (server shutdown): all their streams end at once, then the
        workers still writing into any ring get ``timeout_s`` seconds in all, together."""
        self._stop.set()
        with self._lock:
            sessions = list(self._sessions.values())
            self._sessions.clear()
            metrics.SESSIONS.set(0)
        busy = [future for session in sessions for future in session.close()]
        if busy:
            wait_futures(busy, timeout=timeout_s)
        for session in sessions:
            self._pool.forget_session(session.id)
            self._registry.release(session.ring)
            self._catalog.release(session.catalog)
        if sessions:
            logger.info("closed %d session(s) at server shutdown", len(sessions))
        self._reaper.join(min(5.0, timeout_s))
