"""What a Loader holds outside Python on each server: a channel, a session, a live stream.

A Loader has one :class:`Connection` per replica it draws from (one on one server; see
``batchd._replicas``). They are closed by the Loader's ``weakref.finalize``, never by the
Loader itself, so a Loader that is garbage-collected without ``close()`` still frees its
ring mappings, its doorbells and its sessions on the servers.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Final

import grpc

from batchd._channel import ChannelSecurity, explain_unreachable, open_channel
from batchd._device import Delivery, make_delivery
from batchd._proto.batchd.v1 import loader_pb2, loader_pb2_grpc
from batchd._rpc_errors import error_from_rpc
from batchd._state import Cursor
from batchd._stats import BatchTiming
from batchd._transport.select import Transport, select_transport
from batchd._transport.stream import BatchStream, ReceivedBatch
from batchd._wire.status import disagreement
from batchd.errors import FailedPrecondition, Unavailable

__all__ = ["MAX_MESSAGE_BYTES", "Connection", "SessionHandle", "check_schedule_applied"]

logger = logging.getLogger(__name__)

MAX_MESSAGE_BYTES: Final = 64 << 20
"""gRPC message limit each way; inline chunks are a few MiB, far below it."""
_CLOSE_TIMEOUT_S: Final = 5.0
_CHANNEL_OPTIONS: Final = [
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    # A server whose machine vanished (no FIN, no RST) fails the stream within about a
    # minute instead of blocking the training loop forever. The server permits pings this
    # often (grpc.http2.min_ping_interval_without_data_ms).
    ("grpc.keepalive_time_ms", 30_000),
    ("grpc.keepalive_timeout_ms", 20_000),
    # After the server went away, redial at least every 2 s (gRPC's default backoff grows
    # to 2 minutes), so a Loader reconnecting to a restarted server finds it promptly.
    ("grpc.initial_reconnect_backoff_ms", 200),
    ("grpc.max_reconnect_backoff_ms", 2_000),
]


@dataclass
class SessionHandle:
    """One OpenSession: the server's answer and what the client mapped and set up for it."""

    reply: loader_pb2.OpenSessionResponse
    transport: Transport
    """How its batches travel (``batchd._transport.select``); it starts each stream."""
    delivery: Delivery

    @property
    def prefetch(self) -> int:
        return max(self.reply.prefetch, 1)

    @property
    def num_batches(self) -> int:
        return int(self.reply.num_batches)

    def close(self, stub: loader_pb2_grpc.LoaderStub, target: str, *, quiet: bool = False) -> None:
        """Free the client side, then tell the server. Never raises for a gone server.

        ``quiet``: the server is known to be gone or restarted (a reconnect); a failed
        CloseSession is logged at debug level only.
        """
        try:
            self.delivery.close()
        finally:
            self.transport.close()
        try:
            request = loader_pb2.CloseSessionRequest(session_id=self.reply.session_id)
            stub.CloseSession(request, timeout=_CLOSE_TIMEOUT_S)
        except grpc.RpcError as e:
            error = error_from_rpc(
                e, target=target, method="CloseSession", timeout_s=_CLOSE_TIMEOUT_S
            )
            logger.log(
                logging.DEBUG if quiet else logging.WARNING,
                "batchd: closing session %s failed (%s); the server reclaims it after its "
                "lease timeout (%.0f s)",
                self.reply.session_id,
                error,
                self.reply.lease_timeout_s,
            )


def check_schedule_applied(
    request: loader_pb2.OpenSessionRequest, reply: loader_pb2.OpenSessionResponse, target: str
) -> None:
    """Refuse a session on a mix with a schedule from a server that does not apply it (one
    from before schedules ignores the field and would serve the base weights throughout).

    Raises:
        FailedPrecondition: the reply does not confirm every point of the schedule.
    """
    wanted = len(request.mix.schedule)
    if wanted and reply.schedule_points != wanted:
        raise FailedPrecondition(
            f"the server at {target!r} does not apply mix schedules (it confirmed "
            f"{reply.schedule_points} of the {wanted} points); upgrade batchd-server, or "
            "leave schedule out of the Mix"
        )


class Connection:
    """A Loader's channel to the server at ``target``, its session there and its live
    stream."""

    def __init__(
        self,
        target: str,
        security: ChannelSecurity | None = None,
        channel_options: Sequence[tuple[str, Any]] = (),
    ) -> None:
        self.target = target
        self.security = security or ChannelSecurity()
        self.channel = open_channel(target, self.security, [*_CHANNEL_OPTIONS, *channel_options])
        self.stub = loader_pb2_grpc.LoaderStub(self.channel)
        self.session: SessionHandle | None = None
        self.stream: BatchStream | None = None

    def open_session(
        self,
        request: loader_pb2.OpenSessionRequest,
        *,
        transport: str,
        timeout_s: float,
        delivery_options: dict[str, Any],
        wait_for_ready: bool = False,
    ) -> SessionHandle:
        """Open a session and set up its transport and delivery (not yet this connection's
        :attr:`session`: the caller decides when it replaces the current one).

        ``wait_for_ready``: wait (up to ``timeout_s``) for the server to be reachable instead
        of failing at once while it is down (a reconnect).

        Raises:
            BatchdError: the server refused (mapped from its status), or the transport or
                the delivery path cannot be set up (the session is closed again then).
        """
        try:
            reply = self.stub.OpenSession(request, timeout=timeout_s, wait_for_ready=wait_for_ready)
        except grpc.RpcError as e:
            error = error_from_rpc(e, target=self.target, method="OpenSession", timeout_s=timeout_s)
            raise explain_unreachable(error, self.target, self.security) from e
        chosen: Transport | None = None
        try:
            check_schedule_applied(request, reply, self.target)
            chosen = select_transport(transport, reply, stub=self.stub, target=self.target)
            delivery = make_delivery(
                ring=chosen.ring, prefetch=max(reply.prefetch, 1), **delivery_options
            )
        except BaseException:
            if chosen is not None:
                chosen.close()
            # Best effort: the error that got us here is the one to report; an unclosed
            # session is reclaimed after the server's lease timeout anyway.
            with contextlib.suppress(grpc.RpcError):
                self.stub.CloseSession(
                    loader_pb2.CloseSessionRequest(session_id=reply.session_id),
                    timeout=_CLOSE_TIMEOUT_S,
                )
            raise
        logger.debug("batchd: session %s uses %s", reply.session_id, chosen.reason)
        return SessionHandle(reply, chosen, delivery)

    def replace_session(self, session: SessionHandle) -> None:
        """Make ``session`` the current one and close the previous one (if another)."""
        previous, self.session = self.session, session
        if previous is not None and previous is not session:
            previous.close(self.stub, self.target)

    def start_stream(
        self, cursor: Cursor, *, stride: int, timeout_s: float, join_share: bool = False
    ) -> BatchStream:
        """Start the session's stream of every ``stride``-th batch of ``cursor``'s epoch from
        its ``next_batch`` on (stride 1: every batch), without waiting for a batch (the
        replicas a Loader stripes over start decoding together); it becomes :attr:`stream`.

        A stream cancelled moments ago may not have ended on the server yet; the server ends
        it when this one starts (one stream per session). ``join_share``: a fresh epoch of a
        session in a share group starts at the group's position (``StreamStart.join_share``).

        Raises:
            NotFound: the server forgot the session (shm says so here; inline at the first
                receive).
            BatchdError: the server refused the stream, or (shm) did not accept it within
                ``timeout_s``.
        """
        session = self.session
        assert session is not None, "a stream starts on a session"
        start = loader_pb2.StreamStart(
            session_id=session.reply.session_id,
            epoch=cursor.epoch,
            start_batch=cursor.next_batch,
            start_sample=cursor.start,
            order_world_size=cursor.order_world_size,
            transport=session.transport.kind,
            stride=stride,
            rotation=cursor.rotation,
            join_share=join_share,
        )
        stream = session.transport.open_stream(start, held=session.delivery, timeout_s=timeout_s)
        self.stream = stream
        return stream

    def ack_ready(self) -> None:
        """Ack what the delivery can give back without waiting (zero-copy slots of a batch
        the loop has let go of, finished device copies)."""
        session, stream = self.session, self.stream
        if session is not None and stream is not None:
            stream.ack(session.delivery.advance(wait=False), ())

    def finish_stream(self, take_pending: Callable[[], Sequence[BatchTiming]]) -> None:
        """After the last batch this stream had to serve: give back every slot, report the
        pending timings and wait for the server's end of the stream.

        Raises:
            DataLoss: the server sent more batches than the epoch has.
            BatchdError: the stream ended with an error (not Unavailable: every batch
                arrived, only the goodbye was lost).
        """
        stream, session = self.stream, self.session
        if stream is None or session is None:
            return
        self.stream = None
        try:
            stream.ack(session.delivery.drain(), ())
            stream.finish(take_pending())
        except Unavailable as e:
            logger.info(
                "batchd: the server at %r went away after its last batch: %s", self.target, e
            )

    def abandon_stream(self) -> None:
        """Cancel the live stream, after device copies still reading its slots finish."""
        stream, self.stream = self.stream, None
        if stream is not None:
            if self.session is not None:
                self.session.delivery.drain()
            stream.cancel()

    def close(self) -> None:
        try:
            self.abandon_stream()
            session, self.session = self.session, None
            if session is not None:
                session.close(self.stub, self.target)
        finally:
            self.channel.close()


def receive_batch(
    stream: BatchStream,
    session: SessionHandle,
    take_pending: Callable[[], Sequence[BatchTiming]],
    plan: tuple[str, int, int, int],
) -> ReceivedBatch:
    """The next batch of ``stream``, in the Loader's epoch loop.

    The held batches' acks go out before blocking: they are the credits the server may need
    to produce the batch awaited. ``plan`` is (target, index due, batches, epoch), for errors.

    Raises:
        NotFound, Unavailable: the server went away (or ended the stream early); the caller
            reconnects.
    """
    delivery = session.delivery
    out_of_credits = delivery.held_count() >= session.prefetch
    stream.ack(delivery.advance(wait=out_of_credits), take_pending())
    batch = stream.receive()
    if batch is None:
        target, index, num_batches, epoch = plan
        raise Unavailable(
            f"the server at {target!r} ended the stream where batch {index} of {num_batches} "
            f"(epoch {epoch}) was due"
        )
    return batch


def expect_batch(batch: ReceivedBatch, plan: tuple[str, int, int, int]) -> None:
    """Refuse a batch other than the one ``plan`` (target, index, batches, epoch) has due.

    Raises:
        DataLoss: the server follows another plan.
    """
    target, index, num_batches, epoch = plan
    if batch.index != index:
        raise disagreement(
            f"the server at {target!r} sent batch {batch.index} where batch {index} of "
            f"{num_batches} (epoch {epoch}) was due",
            on="the epoch's plan",
        )
