"""``batchd.Loader``: batches from a batchd server, in place of ``torch.utils.data.DataLoader``.

A Loader is one session on the server (opened in the constructor, so a wrong dataset name
or a too-small ``/dev/shm`` fails at once and ``len()`` works) plus a cursor (epoch, next
batch). Each iteration is one ``StreamBatches`` call that starts at the cursor and moves it
as batches are handed out, so ``state_dict()`` at any moment says where the next iteration
starts, and a fresh Loader given that state yields exactly the rest of the run.
"""

from __future__ import annotations

import logging
import os
import time
import weakref
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import replace
from typing import Any, Final

from batchd._catalog import DEFAULT_TIMEOUT_S
from batchd._channel import ChannelSecurity
from batchd._connection import Connection, SessionHandle, expect_batch, receive_batch
from batchd._device import Batch, resolve_device
from batchd._inline import InlineStream
from batchd._loader_info import LoaderInfo
from batchd._mix import Mix
from batchd._options import MAX_BATCH_SIZE, LoaderOptions
from batchd._proto.batchd.v1 import loader_pb2
from batchd._reconnect import DEFAULT_RECONNECT_TIMEOUT_S, retry_until
from batchd._shm import ShmStream
from batchd._specs import PipelineSpec, check_int
from batchd._state import STATE_FORMAT, Cursor, SavedPosition, check_state
from batchd._stats import LoopClock
from batchd._stream import BatchStream, ReceivedBatch
from batchd._striping import connect
from batchd._version import __version__
from batchd._wire.epoch import rest_of_epoch
from batchd.errors import FailedPrecondition, InvalidArgument, NotFound, Unavailable

__all__ = ["MAX_BATCH_SIZE", "STATE_FORMAT", "Loader"]

logger = logging.getLogger(__name__)

_SUPERSEDED: Final = (
    "this iterator over the Loader was abandoned: a newer iter(loader), set_epoch(), "
    "load_state_dict() or close() took over; iterate the Loader again"
)


class Loader(LoaderInfo):
    """Batches of one split of a dataset, decoded by a batchd server.

    Args:
        target: The server, ``unix:///path/grpc.sock`` or ``host:port``; default
            ``$BATCHD_TARGET``; a list, or a ``dns:///`` name, stripes over replicas.
        dataset: The dataset's name in the server's catalog.
        sources: Instead of ``dataset``: a :class:`batchd.Mix` of several splits, each batch
            drawn by weight; batches then have a ``source`` field indexing
            :attr:`sources` (see the README's "Mixing datasets").
        split: The split to read.
        batch_size: Samples per batch, 1 to 65536.
        shuffle: A new order each epoch, from (seed, epoch); else id order.
        seed: Seeds the order and the augmentations, ``0 <= seed < 2**64``.
        rank: This process's rank; default from ``torch.distributed`` when initialised,
            else ``$RANK``, else 0.
        world_size: Number of ranks; default likewise from ``$WORLD_SIZE``, else 1. Ranks
            get disjoint samples and equal batch counts, as with ``DistributedSampler``.
        drop_last: Drop the tail that does not fill whole batches on every rank, instead of
            padding it by wrapping around to the epoch's start.
        pipeline: What a sample decodes to: :class:`batchd.Image` (default, 224 px),
            :class:`batchd.Array`, :class:`batchd.Tokens` or :class:`batchd.Custom`.
        device: ``"cpu"`` or ``"cuda[:N]"``; default CUDA when available, else the CPU.
        prefetch: Batches the server may have ready ahead of the training loop.
        transport: ``"shm"`` (map the server's shared memory; same host), ``"inline"``
            (bytes inside the gRPC stream) or ``"auto"`` (shm when the server's segment can
            be opened here, else inline).
        snapshot: A catalog snapshot from another Loader's :attr:`snapshot`, to pin all
            ranks of a job to the same rows.
        sampling: ``"uniform"``, ``"weighted"`` (weight column, with replacement),
            ``"class_balanced"`` or ``"bucketed"`` (batches of similar length).
        on_error: A bad sample is ``"skip"``-ped (the batch has fewer rows; see
            :attr:`last_failed_sample_ids`), ``"replace"``-d by a deterministic substitute,
            or ``"raise"``-s :class:`batchd.errors.DataLoss`.
        version: The dataset version; default the newest.
        zero_copy: On the CPU, yield views of the server's shared memory that are valid only
            until the next batch is requested (or the iteration ends); ``.clone()`` what
            must live longer. By default (shm) a batch's tensors own its slot instead: it
            stays theirs for as long as any of them lives, and goes back to the server when
            the last one dies; batches beyond the first few the loop keeps are copied. No
            effect on CUDA.
        max_error_fraction: The session fails once more than this fraction of an epoch's
            samples went bad, ``0 < f <= 1`` (for zero tolerance use ``on_error="raise"``).
        timeout_s: Deadline of OpenSession and other unary calls, in seconds.
        reconnect_timeout_s: When the server goes away mid-epoch (killed, restarted,
            rescheduled), how long to keep reconnecting, in seconds; the epoch then goes on
            at its next batch on the same catalog snapshot, every sample exactly once and in
            the same order. 0 turns reconnecting off.
        auth_token: The server's bearer token; default ``$BATCHD_AUTH_TOKEN``.
        tls_ca: PEM file of the CA that signed the server's TLS certificate (TCP targets);
            default ``$BATCHD_TLS_CA``; None and unset: plaintext. For mutual TLS, the
            client's certificate and key come from ``$BATCHD_TLS_CLIENT_CERT`` and
            ``$BATCHD_TLS_CLIENT_KEY``.

    Raises:
        InvalidArgument: a bad argument, named with its valid range.
        NotFound: no such dataset, version or split.
        ResourceExhausted: the server's ``/dev/shm`` or shm budget cannot hold the session.
        Unavailable: the server cannot be reached (while iterating: not within
            ``reconnect_timeout_s``), or speaks TLS and ``tls_ca`` is not set.
        Unauthenticated: the server wants a token and ``auth_token`` is missing or wrong.

    Iterating yields one ``dict`` per batch, ``field name → tensor`` (NumPy arrays when torch
    is not installed): every field of the pipeline plus ``sample_id`` and ``label`` (int64),
    and ``source`` (int64, an index into :attr:`sources`) over a mix, first dimension the
    batch's rows. Epochs: :meth:`set_epoch` as with
    ``DistributedSampler``; if it is never called, each new iteration after a finished one
    moves to the next epoch by itself, so a forgotten ``set_epoch`` cannot repeat the order.
    Iterating again after stopping early (``break``) continues the epoch where it stopped.
    Only one iteration is live at a time: a new ``iter()`` abandons the previous one.
    Use as a context manager, or call :meth:`close`.
    """

    _h2d: str = "auto"
    """The CUDA host-to-device path (see ``batchd._device.H2D_STRATEGIES``); benchmarks and
    tests set it on the class to compare the paths."""

    def __init__(
        self,
        target: str | Sequence[str] | None = None,
        *,
        dataset: str | None = None,
        sources: Mix | None = None,
        split: str = "train",
        batch_size: int,
        shuffle: bool = True,
        seed: int = 0,
        rank: int | None = None,
        world_size: int | None = None,
        drop_last: bool = False,
        pipeline: PipelineSpec | None = None,
        device: Any = None,
        prefetch: int = 4,
        transport: str = "auto",
        snapshot: str | None = None,
        sampling: str = "uniform",
        on_error: str = "skip",
        version: str | None = None,
        zero_copy: bool = False,
        max_error_fraction: float = 0.01,
        timeout_s: float = DEFAULT_TIMEOUT_S,
        reconnect_timeout_s: float = DEFAULT_RECONNECT_TIMEOUT_S,
        auth_token: str | None = None,
        tls_ca: str | os.PathLike[str] | None = None,
    ) -> None:
        self._options = LoaderOptions(
            dataset=dataset,
            split=split,
            batch_size=batch_size,
            shuffle=shuffle,
            seed=seed,
            rank=rank,
            world_size=world_size,
            drop_last=drop_last,
            pipeline=pipeline,
            prefetch=prefetch,
            transport=transport,
            snapshot=snapshot,
            sampling=sampling,
            on_error=on_error,
            version=version,
            zero_copy=zero_copy,
            max_error_fraction=max_error_fraction,
            timeout_s=timeout_s,
            reconnect_timeout_s=reconnect_timeout_s,
            sources=sources,
        )
        self._device = resolve_device(device)
        self._conn, self._stripes = connect(target, ChannelSecurity.resolve(auth_token, tls_ca))
        self._finalizer = weakref.finalize(self, (self._stripes or self._conn).close)
        self._closed = False
        self._iteration: object | None = None
        self._lost: SessionHandle | None = None
        """The session the server lost, while reconnecting has not replaced it."""
        self._epoch = 0
        self._next_batch = 0
        # After an elastic resume, the epoch's plan is the rest of the epoch after this many
        # entries of its global order, built for this world size (see batchd._state).
        self._epoch_start = 0
        self._order_world_size = 0
        self._clock = LoopClock()
        self.last_failed_sample_ids: tuple[int, ...] = ()
        """Sample ids of the latest batch that failed to decode: left out (``on_error="skip"``)
        or replaced (``"replace"``)."""
        try:
            if self._stripes is None:
                self._conn.replace_session(self._open_session())
            else:
                self._stripes.open(self)
        except BaseException:
            self._finalizer()
            raise

    # -- session ---------------------------------------------------------------------------

    def _open_session(
        self,
        version: str | None = None,
        snapshot: str | None = None,
        *,
        conn: Connection | None = None,
        wait_for_ready: bool = False,
        timeout_s: float | None = None,
    ) -> SessionHandle:
        options = self._options
        return (conn or self._conn).open_session(
            options.to_request(version=version, snapshot=snapshot),
            transport=options.transport,
            timeout_s=options.timeout_s if timeout_s is None else timeout_s,
            wait_for_ready=wait_for_ready,
            delivery_options={
                "device": self._device,
                "zero_copy": options.zero_copy,
                "h2d": self._h2d,
            },
        )

    def _session(self) -> SessionHandle:
        if self._closed:
            raise FailedPrecondition(
                f"this Loader for dataset {self._options.dataset!r} is closed; create a new one"
            )
        if self._conn.session is None:
            # A reconnect gave up (Unavailable was raised); try once more now.
            assert self._lost is not None, "a Loader that is not closed has a session"
            reply = self._lost.reply
            session = self._open_session(reply.version, reply.snapshot)
            self._conn.replace_session(session)
            self._lost = None
            return session
        return self._conn.session

    def _abandon(self) -> None:
        self._iteration = None
        (self._stripes or self._conn).abandon_stream()

    # -- iteration -------------------------------------------------------------------------

    def __len__(self) -> int:
        """Batches per epoch on this rank (the same on every rank)."""
        return self._session().num_batches

    def _epoch_batches(self) -> int:
        """Batches of the current epoch's plan on this rank: ``len(self)``, or fewer for the
        rest of an epoch after an elastic resume."""
        session = self._session()
        if self._epoch_start == 0:
            return session.num_batches
        options = self._options
        assert options.world_size is not None  # set in LoaderOptions
        return rest_of_epoch(
            int(session.reply.num_rows),
            self._epoch_start,
            batch_size=options.batch_size,
            world_size=options.world_size,
            drop_last=options.drop_last,
        )[1]

    def _position(self) -> Cursor:
        """Where the next iteration starts."""
        n = self._epoch_batches()
        if self._next_batch >= n and (n > 0 or self._epoch_start > 0):
            return Cursor(self._epoch + 1)
        return Cursor(self._epoch, self._next_batch, self._epoch_start, self._order_world_size)

    def _move_to(self, cursor: Cursor) -> None:
        self._epoch, self._next_batch = cursor.epoch, cursor.next_batch
        self._epoch_start, self._order_world_size = cursor.start, cursor.order_world_size

    def set_epoch(self, epoch: int) -> None:
        """Serve ``epoch``'s order from the next iteration on.

        Setting the epoch the Loader is in the middle of keeps its place (so a resumed job
        that calls ``set_epoch`` in its loop does not restart the epoch); any other epoch
        starts at its first batch and abandons a live iteration.
        """
        epoch = check_int("epoch", epoch, 0, (1 << 63) - 1)
        started = self._next_batch > 0 or self._epoch_start > 0
        if epoch == self._epoch and started and self._next_batch < self._epoch_batches():
            return
        if self._iteration is not None:
            self._abandon()
        self._move_to(Cursor(epoch))

    def __iter__(self) -> Iterator[Batch]:
        self._session()
        self._abandon()
        token = object()
        self._iteration = token
        many = self._stripes  # the replicas to stripe over (batchd._striping), or None
        return self._iterate(token) if many is None else many.iterate(self, token, _SUPERSEDED)

    def _iterate(self, token: object) -> Iterator[Batch]:
        if self._iteration is not token:
            raise FailedPrecondition(_SUPERSEDED)
        session = self._session()
        cursor = self._position()
        self._move_to(cursor)
        epoch, start = cursor.epoch, cursor.next_batch
        num_batches = self._epoch_batches()
        if start >= num_batches:  # an epoch without batches (drop_last, tiny split)
            self._move_to(Cursor(epoch + 1))
            return
        clock = self._clock
        clock.iteration_started()
        try:
            stream, batch = self._open_stream(session, cursor)
        except (NotFound, Unavailable) as e:
            # The server forgot the session: it sat idle past the lease (a long evaluation
            # between epochs) or the server restarted. Sampling is a pure function of the
            # options and the snapshot, so a new session on the same snapshot serves exactly
            # the batches the old one would have.
            logger.info("batchd: session %s is gone (%s); reopening", session.reply.session_id, e)
            stream, batch = self._resume(cursor, e, time.monotonic())
        lost_at: float | None = None
        """When the server went away, until a batch arrives again."""
        finished = False
        try:
            index = start
            while index < num_batches:
                session = self._session()
                delivery = session.delivery
                plan = (self._conn.target, index, num_batches, epoch)
                try:
                    if batch is None:
                        batch = receive_batch(stream, session, clock.take_pending, plan)
                except (NotFound, Unavailable) as e:
                    # The server went away mid-epoch (killed, restarted, shutting down):
                    # reopen at the first batch the loop has not seen.
                    if lost_at is None:
                        lost_at = time.monotonic()
                    stream, batch = self._resume(replace(cursor, next_batch=index), e, lost_at)
                    continue
                expect_batch(batch, plan)
                out, acks = delivery.deliver(batch)
                clock.handed(batch.rows)
                failed, batch, lost_at = batch.failed_sample_ids, None, None
                stream.ack(acks, clock.take_pending())
                self._next_batch = index + 1
                self.last_failed_sample_ids = failed
                index += 1
                yield out
                if self._iteration is not token:
                    raise FailedPrecondition(_SUPERSEDED)
                clock.asked()
            delivery = self._session().delivery
            try:
                stream.ack(delivery.drain(), ())
                stream.finish(clock.take_pending())
            except Unavailable as e:
                # Every batch of the epoch arrived; only the goodbye was lost.
                logger.info("batchd: the server went away after the epoch's last batch: %s", e)
            finished = True
            self._move_to(Cursor(epoch + 1))
        finally:
            if self._conn.stream is stream:
                self._conn.stream = None
                if not finished:
                    if self._conn.session is not None:
                        self._conn.session.delivery.drain()
                    stream.cancel()
            elif not finished:
                stream.cancel()
            if self._iteration is token:
                self._iteration = None

    def _resume(
        self, cursor: Cursor, cause: BaseException, lost_at: float
    ) -> tuple[BatchStream, ReceivedBatch | None]:
        """After the server went away (at ``lost_at``, monotonic): a new session on the same
        snapshot and a stream from ``cursor`` (the first batch the loop has not seen),
        retried with backoff until ``reconnect_timeout_s`` after ``lost_at`` while the server
        is away or refuses the session (see :func:`batchd._reconnect.retry_until`).

        Raises:
            Unavailable: the server did not come back in time (names the target).
            ResourceExhausted: it came back but still refused the session at the deadline.
            NotFound, SnapshotMismatch, ...: the server came back and refused the session.
        """
        old = self._session()
        self._conn.abandon_stream()
        self._conn.session, self._lost = None, old
        old.close(self._conn.stub, self._conn.target, quiet=True)
        version, snapshot = old.reply.version, old.reply.snapshot
        options = self._options

        def attempt(left_s: float) -> tuple[BatchStream, ReceivedBatch | None]:
            session = self._open_session(
                version,
                snapshot,
                wait_for_ready=left_s > 0,
                timeout_s=min(left_s, options.timeout_s) if left_s > 0 else None,
            )
            if session.num_batches != old.num_batches:
                session.close(self._conn.stub, self._conn.target)
                raise FailedPrecondition(
                    f"the restarted server at {self._conn.target!r} plans "
                    f"{session.num_batches} batches per epoch on snapshot {snapshot}, this "
                    f"Loader had {old.num_batches}; create a new Loader"
                )
            self._conn.replace_session(session)
            self._lost = None
            try:
                return self._open_stream(session, cursor)
            except NotFound as e:  # gone again already: another restart
                raise Unavailable(str(e)) from e

        return retry_until(
            attempt,
            target=self._conn.target,
            timeout_s=options.reconnect_timeout_s,
            lost_at=lost_at,
            cause=cause,
        )

    def _open_stream(
        self, session: SessionHandle, cursor: Cursor
    ) -> tuple[BatchStream, ReceivedBatch | None]:
        """Start the epoch's stream at ``cursor`` and take its first batch.

        A stream this Loader cancelled moments ago may not have ended on the server yet; the
        server ends it when this one starts (one stream per session).
        """
        session.streams_started += 1
        start = loader_pb2.StreamStart(
            session_id=session.reply.session_id,
            epoch=cursor.epoch,
            start_batch=cursor.next_batch,
            start_sample=cursor.start,
            order_world_size=cursor.order_world_size,
            transport=session.transport,
        )
        stream: BatchStream
        if session.ring is not None:
            start.seq = session.streams_started
            start.held_leases.extend(session.delivery.lent())
            stream = ShmStream(start, ring=session.ring, accept_timeout_s=self._options.timeout_s)
        else:
            stream = InlineStream(
                self._conn.stub,
                start,
                target=self._conn.target,
                timeout_s=self._options.timeout_s,
            )
        self._conn.stream = stream
        try:
            return stream, stream.receive()
        except BaseException:
            self._conn.stream = None
            stream.cancel()
            raise

    # -- state -----------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """Where the next iteration starts, and what must match to resume there.

        ``consumed`` counts the entries of ``epoch``'s global order that all ranks served
        together (the same on every rank, so any rank's state resumes every rank, at this or
        another world size); ``next_batch`` is this rank's batches of the epoch, for
        reading. Plain values only (JSON- and ``torch.save``-friendly).
        """
        session = self._session()
        cursor = self._position()
        options = self._options
        assert options.world_size is not None  # set in LoaderOptions
        global_batch = options.batch_size * options.world_size
        return {
            "format": STATE_FORMAT,
            "batchd_version": __version__,
            "dataset": options.dataset,
            "version": session.reply.version or options.version or "",
            "split": session.reply.split or options.split,
            "batch_size": options.batch_size,
            "rank": options.rank,
            "world_size": options.world_size,
            "seed": options.seed,
            "shuffle": options.shuffle,
            "drop_last": options.drop_last,
            "sampling": options.sampling,
            "mix": options.mix_state(),
            "epoch": cursor.epoch,
            "consumed": cursor.start + cursor.next_batch * global_batch,
            "order_world_size": cursor.order_world_size or options.world_size,
            "next_batch": cursor.next_batch,
            "num_batches": session.num_batches,
            "rows": int(session.reply.num_rows),
            "snapshot": session.reply.snapshot,
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Make the next iteration start exactly where ``state`` (from :meth:`state_dict`) was.

        The state may come from any rank, and from a job with another world size (an
        elastic resume): the rest of the saved epoch is then dealt to this job's ranks, each
        sample once (``len()`` is still a whole epoch's batches; the resumed epoch has
        fewer). The session is reopened on the state's snapshot (and version) when they
        differ from this Loader's, so the rows are the ones the saved run served.

        Raises:
            InvalidArgument: ``state`` is not such a dict, of a format this batchd cannot
                read, or was saved by a Loader with different options (the message names the
                key).
            SnapshotMismatch: the catalog no longer has the snapshot's rows.
        """
        session = self._session()
        mine = self.state_dict()
        saved = check_state(state, mine, pinned_version=self._options.version)
        self._abandon()
        candidate = session
        if state["snapshot"] != mine["snapshot"] or state["version"] != mine["version"]:
            candidate = self._open_session(state["version"] or None, state["snapshot"] or None)
        try:
            cursor = self._cursor_for(saved, candidate)
        except BaseException:
            if candidate is not session:
                candidate.close(self._conn.stub, self._conn.target)
            raise
        self._conn.replace_session(candidate)
        self._move_to(cursor)

    def _cursor_for(self, saved: SavedPosition, session: SessionHandle) -> Cursor:
        """The cursor that continues ``saved`` on ``session``."""
        options = self._options
        assert options.world_size is not None  # set in LoaderOptions
        rows, num_batches = int(session.reply.num_rows), session.num_batches
        global_batch = options.batch_size * options.world_size
        if (saved.rows is not None and rows and saved.rows != rows) or (
            saved.num_batches is not None
            and saved.world_size == options.world_size
            and saved.num_batches != num_batches
        ):
            raise InvalidArgument(
                f"the state's split had rows={saved.rows}, num_batches={saved.num_batches}; "
                f"this session has {rows} rows, {num_batches} batches per epoch: the state is "
                "from another plan"
            )
        if saved.order_world_size == options.world_size and saved.consumed % global_batch == 0:
            next_batch = saved.consumed // global_batch
            if next_batch > num_batches:
                raise InvalidArgument(
                    f"state consumed={saved.consumed} is past this session's epoch of "
                    f"{num_batches} batches of {global_batch}; the state is from another plan"
                )
            return Cursor(saved.epoch, next_batch)
        if not rows:
            raise FailedPrecondition(
                f"the server at {self._conn.target!r} cannot resume a state saved at "
                f"world_size={saved.world_size} on world_size={options.world_size} (it does "
                "not report the split's rows); upgrade batchd-server, or resume with "
                f"world_size={saved.world_size}"
            )
        return Cursor(saved.epoch, 0, saved.consumed, saved.order_world_size)

    # -- lifetime --------------------------------------------------------------------------

    def close(self) -> None:
        """Abandon a live iteration, close the session on the server, unmap, disconnect.

        Idempotent; after it, iterating raises FailedPrecondition.
        """
        self._closed = True
        self._iteration = None
        self._finalizer()

    def __getstate__(self) -> Any:
        raise InvalidArgument(
            "a batchd.Loader cannot be pickled or sent to another process (it holds a gRPC "
            "channel and shared memory); create it in the process that iterates, and use "
            "DataLoader(batchd.IterableDataset(loader), batch_size=None, num_workers=0)"
        )

    def __repr__(self) -> str:
        state = "closed" if self._closed else f"epoch {self._epoch}, batch {self._next_batch}"
        return (
            f"Loader(target={self._conn.target!r}, dataset={self._options.dataset!r}, "
            f"split={self._options.split!r}, batch_size={self._options.batch_size}) [{state}]"
        )
