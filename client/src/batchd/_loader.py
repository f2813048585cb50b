"""``batchd.Loader``: batches from a batchd server, in place of ``torch.utils.data.DataLoader``.

A Loader is a session on the server, or one on each replica it stripes over (opened in the
constructor, so a wrong dataset name or a too-small ``/dev/shm`` fails at once and ``len()``
works), plus a position (epoch, next batch; ``batchd._state``). Each iteration streams the
epoch from the position, one stream per replica (``batchd._replicas``), and moves it as batches
are handed out, so ``state_dict()`` at any moment says where the next iteration starts, and
a fresh Loader given that state yields exactly the rest of the run.
"""

from __future__ import annotations

import os
import time
import weakref
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import replace
from typing import Any, Final

from batchd._accounting import SourceAccount
from batchd._catalog import DEFAULT_TIMEOUT_S
from batchd._channel import ChannelSecurity
from batchd._connection import Connection, SessionHandle, expect_batch, receive_batch
from batchd._device import Batch, resolve_device
from batchd._fields import AnyPipeline
from batchd._options import LoaderOptions
from batchd._packing import Pack
from batchd._pipelines import check_int
from batchd._proto.batchd.v1 import loader_pb2
from batchd._reconnect import DEFAULT_RECONNECT_TIMEOUT_S
from batchd._replicas import open_replicas
from batchd._server_wait import ServerWait
from batchd._sources import Mix
from batchd._state import Cursor, Position
from batchd._stats import LoaderStats, LoopClock
from batchd._transport.stream import BatchStream
from batchd._wire.lifetime import Closeable
from batchd._wire.schedule import global_step
from batchd.errors import FailedPrecondition, InvalidArgument, NotFound, Unavailable

__all__ = ["Loader"]

_SUPERSEDED: Final = (
    "this iterator over the Loader was abandoned: a newer iter(loader), set_epoch(), "
    "load_state_dict() or close() took over; iterate the Loader again"
)


class Loader(Closeable):
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
        decode_cache: False: the server decodes every sample afresh, even where it keeps a
            decode cache (its rows are the same either way); for a benchmark of cold decoding.
        pack: A :class:`batchd.Pack` (with a :class:`batchd.Tokens` pipeline): serve the
            documents packed into rows of ``seq_len`` tokens, ``batch_size`` rows a batch
            (see docs/client/packing.md).
        share: A group name (e.g. ``"sweep-7"``): Loaders on one server that name the
            same group and ask for the same batches (dataset, snapshot, pipeline, sampling,
            seed, batch size, rank and world size, on_error) get a batch decoded once and
            copied to each, instead of decoding it once per Loader. Each still gets its
            epoch exactly once; one that starts an epoch while its group is more than a ring
            into it serves that epoch from the group's position, then wraps around to the
            batches before it (its ``state_dict`` records that order); see the docs'
            "Sharing batches between jobs". None: share nothing.

    Raises:
        InvalidArgument: a bad argument, named with its valid range.
        NotFound: no such dataset, version or split.
        ResourceExhausted: the server's ``/dev/shm`` or shm budget cannot hold the session.
        Unavailable: the server cannot be reached (within ``wait_for_server_s``; while
            iterating: within ``reconnect_timeout_s``), or speaks TLS and ``tls_ca`` is not
            set.
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
        pipeline: AnyPipeline | None = None,
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
        wait_for_server_s: float | None = None,
        auth_token: str | None = None,
        tls_ca: str | os.PathLike[str] | None = None,
        decode_cache: bool = True,
        pack: Pack | None = None,
        share: str | None = None,
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
            wait_for_server_s=wait_for_server_s,
            sources=sources,
            decode_cache=decode_cache,
            pack=pack,
            share=share,
        )
        self._device = resolve_device(device)
        self._server_wait = ServerWait()
        self._replicas = open_replicas(
            target,
            ChannelSecurity.resolve(auth_token, tls_ca),
            self._options,
            {"device": self._device, "zero_copy": self._options.zero_copy, "h2d": self._h2d},
            self._server_wait,
        )
        self._finalizer = weakref.finalize(self, self._replicas.close)
        self._closed = False
        self._iteration: object | None = None
        self._position = Position(self._options)
        self._clock = LoopClock()
        self._account = _account_of(self._options.sources)
        self.last_failed_sample_ids: tuple[int, ...] = ()
        """Sample ids of the latest batch that failed to decode: left out (``on_error="skip"``)
        or replaced (``"replace"``)."""

    def _session(self) -> SessionHandle:
        """The session that answers for the Loader (on a striped Loader, the primary's)."""
        if self._closed:
            raise FailedPrecondition(
                f"this Loader for dataset {self._options.dataset!r} is closed; create a new one"
            )
        return self._replicas.session()

    def _abandon(self) -> None:
        self._iteration = None
        self._replicas.abandon_streams()

    # -- iteration -------------------------------------------------------------------------

    def __len__(self) -> int:
        """Batches per epoch on this rank (the same on every rank)."""
        return self._session().num_batches

    def set_epoch(self, epoch: int) -> None:
        """Serve ``epoch``'s order from the next iteration on.

        Setting the epoch the Loader is in the middle of keeps its place (so a resumed job
        that calls ``set_epoch`` in its loop does not restart the epoch); any other epoch
        starts at its first batch and abandons a live iteration.
        """
        epoch = check_int("epoch", epoch, 0, (1 << 63) - 1)
        position = self._position
        started = position.next_batch > 0 or position.start > 0
        # Short-circuits: a Loader that has not started the epoch needs no session here.
        if (
            epoch == position.epoch
            and started
            and position.next_batch < position.epoch_batches(self._session().reply)
        ):
            return
        if self._iteration is not None:
            self._abandon()
        position.move_to(Cursor(epoch))

    def __iter__(self) -> Iterator[Batch]:
        self._session()
        self._abandon()
        token = object()
        self._iteration = token
        return self._iterate(token)

    def _iterate(self, token: object) -> Iterator[Batch]:
        """The one epoch loop: batches in order from the replicas, each serving every R-th
        (one replica, every batch); see NOTE [ A replica that fails ] in ``batchd._replicas``."""
        if self._iteration is not token:
            raise FailedPrecondition(_SUPERSEDED)
        replicas, position, clock = self._replicas, self._position, self._clock
        reply = replicas.refresh().reply
        cursor = position.cursor(reply)
        position.move_to(cursor)
        epoch, num_batches = cursor.epoch, position.epoch_batches(reply)
        if cursor.next_batch >= num_batches:  # an epoch without batches (drop_last, tiny split)
            position.move_to(Cursor(epoch + 1))
            return
        clock.iteration_started()
        # A share group's member asks to start at its group's position; its server decides
        # whether the stream may, and the first batch's index says where it started (see
        # NOTE [ Share groups ] on the server).
        join = self._options.share is not None
        conns = replicas.stripe(cursor, num_batches, join_share=join)
        mine = _streams(conns)
        """This iteration's streams: only those are its to cancel."""
        first, stride = cursor.next_batch, len(conns)
        lost_at: float | None = None
        """When a server went away, until a batch arrives again."""
        previous: Connection | None = None
        finished = False
        try:
            index = first
            while index < num_batches:
                conn = conns[(index - first) % stride]
                session, stream = conn.session, conn.stream
                assert session is not None and stream is not None, "a live replica has a stream"
                plan = (conn.target, position.plan_index(index, reply), num_batches, epoch)
                try:
                    if previous is not conn and previous is not None:
                        # Zero-copy slots of the batch the loop just let go of go back now.
                        previous.ack_ready()
                    batch = receive_batch(stream, session, clock.take_pending, plan)
                except (NotFound, Unavailable) as e:
                    # The server went away or forgot the session: continue at the first
                    # batch the loop has not seen.
                    lost_at = time.monotonic() if lost_at is None else lost_at
                    at = replace(cursor, next_batch=index)
                    conns = replicas.lost(conn, e, at, num_batches, lost_at)
                    mine, first, stride, previous = _streams(conns), index, len(conns), None
                    join = False
                    continue
                if join:
                    join = False
                    if cursor == Cursor(epoch) and 0 < batch.index < num_batches:  # joined there
                        position.joined(batch.index)
                        cursor = position.cursor(reply)
                        plan = (conn.target, position.plan_index(index, reply), num_batches, epoch)
                expect_batch(batch, plan)
                self._count(batch.arrays, reply, cursor, plan[1])
                out, acks = session.delivery.deliver(batch)
                clock.handed(batch.rows)
                stream.ack(acks, clock.take_pending())
                position.next_batch = index + 1
                self.last_failed_sample_ids = batch.failed_sample_ids
                # Only the tensors may keep the slot: it goes back when the training loop drops
                # them (see NOTE [ Slot lifecycle on the client ] in batchd._device).
                del batch
                index, previous, lost_at = index + 1, conn, None
                yield out
                if self._iteration is not token:
                    raise FailedPrecondition(_SUPERSEDED)
                clock.asked()
            for conn in conns:
                conn.finish_stream(clock.take_pending)
            finished = True
            position.move_to(Cursor(epoch + 1))
        finally:
            if not finished:
                replicas.abandon(mine)
            if self._iteration is token:
                self._iteration = None

    def _count(
        self,
        arrays: Mapping[str, Any],
        reply: loader_pb2.OpenSessionResponse,
        at: Cursor,
        index: int,
    ) -> None:
        """Count a mix's batch per source (``batchd._accounting``), at its global step."""
        if self._account is None:
            return
        options = self._options
        assert options.world_size is not None  # set in LoaderOptions
        step = global_step(
            at.epoch,
            index,
            rows=int(reply.num_rows),
            batch_size=options.batch_size,
            world_size=options.world_size,
            drop_last=options.drop_last,
            start=at.start,
            order_world_size=at.order_world_size,
        )
        self._account.record(arrays, step)

    # -- state -----------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """Where the next iteration starts, and what must match to resume there.

        ``consumed`` counts the entries of ``epoch``'s global order that all ranks served
        together (the same on every rank, so any rank's state resumes every rank, at this or
        another world size); ``next_batch`` is this rank's batches of the epoch, for
        reading. Plain values only (JSON- and ``torch.save``-friendly).
        """
        return self._position.get_state(self._session().reply)

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
        saved = self._position.read_state(state, session.reply)
        self._abandon()
        replicas = self._replicas
        candidate = session
        if saved.reopen_on is not None:
            version, snapshot = saved.reopen_on
            candidate = replicas.open_session(version or None, snapshot or None)
        try:
            self._position.reset(saved, candidate.reply, target=replicas.primary.target)
        except BaseException:
            if candidate is not session:
                candidate.close(replicas.primary.stub, replicas.primary.target)
            raise
        replicas.adopt(candidate)

    # -- what the loop waited for ----------------------------------------------------------

    def stats(self) -> LoaderStats:
        """The training loop's view of its data so far: batches and samples handed out, how
        long ``next()`` waited and the steps in between took (totals and percentiles), the
        stall ratio ``wait / (wait + step)``, and the time to the first batch. The server
        exports the same per-batch numbers as ``batchd_client_wait_seconds``,
        ``batchd_client_step_seconds`` and ``batchd_data_stall_ratio``. Over a mix,
        ``sources`` has each source's samples and tokens served against the samples its
        weights (and schedule) expected. ``server_wait_s`` is how long the Loader waited for
        its server to answer at all (``wait_for_server_s``)."""
        stats = replace(self._clock.stats(), server_wait_s=self._server_wait.waited_s)
        if self._account is None:
            return stats
        return replace(stats, sources=self._account.stats())

    @property
    def wait_s(self) -> float:
        """Seconds the training loop spent blocked in ``next()``, in total."""
        return self._clock.wait_s

    @property
    def batches_served(self) -> int:
        """Batches handed to the training loop, in total."""
        return self._clock.batches

    # -- what the session is ---------------------------------------------------------------

    @property
    def target(self) -> str:
        """The server answering for the Loader (striped: the primary replica)."""
        return self._replicas.primary.target

    @property
    def epoch(self) -> int:
        """The epoch the next iteration serves."""
        return self._position.cursor(self._session().reply).epoch

    @property
    def snapshot(self) -> str:
        """The catalog snapshot served; pass it as ``snapshot=`` to pin other ranks."""
        return self._session().reply.snapshot

    @property
    def version(self) -> str:
        """The dataset version served ("" for a mix: see :attr:`mix_sources`)."""
        return self._session().reply.version

    @property
    def sources(self) -> tuple[str, ...]:
        """A mix's source names in order, as the batches' ``source`` field numbers them
        (``loader.sources[batch["source"][i]]``); ``()`` without a mix."""
        mix = self._options.sources
        return () if mix is None else mix.names

    @property
    def mix_sources(self) -> list[dict[str, Any]]:
        """A mix's sources as the server resolved them, in order: ``dataset``, ``version``,
        ``split``, ``weight``, ``rows`` (in the snapshot served) and ``epoch_samples`` (in one
        epoch, all ranks together); ``[]`` without a mix."""
        return [
            {
                "dataset": s.dataset,
                "version": s.version,
                "split": s.split,
                "weight": s.weight,
                "rows": int(s.rows),
                "epoch_samples": int(s.epoch_samples),
            }
            for s in self._session().reply.sources
        ]

    @property
    def num_samples(self) -> int:
        """Samples per epoch on this rank, padding included."""
        return int(self._session().reply.num_samples)

    @property
    def transport(self) -> str:
        """``"shm"`` or ``"inline"``: what this session uses."""
        return self._session().transport.name

    @property
    def device(self) -> Any:
        """``"cpu"`` or the ``torch.device`` batches are delivered to."""
        return self._device

    @property
    def fields(self) -> dict[str, tuple[str, tuple[int, ...]]]:
        """Field name → (dtype, one sample's largest shape), in slot order."""
        reply = self._session().reply
        return {f.name: (f.dtype, tuple(f.shape)) for f in reply.fields}

    # -- lifetime --------------------------------------------------------------------------

    def close(self) -> None:
        """Abandon a live iteration, close the sessions on the server, unmap, disconnect.

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
        position = self._position
        state = "closed" if self._closed else f"epoch {position.epoch}, batch {position.next_batch}"
        return (
            f"Loader(target={self.target!r}, dataset={self._options.dataset!r}, "
            f"split={self._options.split!r}, batch_size={self._options.batch_size}) [{state}]"
        )


def _account_of(mix: Mix | None) -> SourceAccount | None:
    """The per-source counts of a Loader over ``mix``; None without one."""
    if mix is None:
        return None
    if mix.schedule is not None:
        return SourceAccount(mix.names, mix.schedule.shares_at)
    total = sum(mix.weights)
    shares = tuple(w / total for w in mix.weights)
    return SourceAccount(mix.names, lambda _step: shares)


def _streams(conns: Sequence[Connection]) -> list[BatchStream]:
    return [conn.stream for conn in conns if conn.stream is not None]
