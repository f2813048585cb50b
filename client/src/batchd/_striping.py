"""Striping: one Loader's batches spread over several server replicas (DESIGN §7).

``Loader(target=["h1:50051", "h2:50051"])``, or ``target="dns:///batchd-headless:50051"``
whose name resolves to several addresses, opens one session per replica, every one on the
catalog snapshot of the first. Sampling is a pure function of the options and the snapshot,
so every replica plans the same epoch, and each serves every R-th batch of it
(``StreamStart.stride``): from the first batch ``b`` an iteration streams, replica ``i``
serves ``b + i``, ``b + i + R``, ... (batch k from replica k mod R for a whole epoch). The
Loader takes the batches in order from whichever replica holds each, so the loop sees one
server's epoch, decoded by R servers' CPUs; ``state_dict`` is the same global cursor.

NOTE [ A replica that fails ]
A replica whose stream fails mid-epoch (killed, unreachable, its session forgotten) is
asked once, at once, for a new session on the same snapshot (a restarted server, an expired
session). Either way every stream is then striped again from the first batch the loop has
not seen, over the replicas that are left: the failed one's remaining batches come from the
others, none is lost or repeated, and the order is unchanged. What the others had decoded
ahead (their prefetch) is decoded again. A dropped replica is tried again when a later
iteration starts (after a back-off; a DNS target is resolved again then, so a pool that
scaled out is used from the next epoch on). With no replica left the Loader waits for any of
them for ``reconnect_timeout_s``, as a single-target Loader waits for its server.
"""

from __future__ import annotations

import logging
import socket
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Final, Protocol

from batchd._catalog import resolve_target
from batchd._channel import ChannelSecurity
from batchd._connection import Connection, SessionHandle, expect_batch, receive_batch
from batchd._inline import InlineStream
from batchd._options import LoaderOptions
from batchd._proto.batchd.v1 import loader_pb2
from batchd._reconnect import retry_until
from batchd._shm import ShmStream
from batchd._state import Cursor
from batchd._stats import LoopClock
from batchd._stream import BatchStream
from batchd.errors import BatchdError, FailedPrecondition, InvalidArgument, NotFound, Unavailable

__all__ = ["Replicas", "StripedLoader", "Stripes", "connect", "replicas_of"]

logger = logging.getLogger(__name__)

_RETRY_FIRST_S: Final = 10.0
"""A dropped replica is tried again at an iteration's start this long after it failed..."""
_RETRY_MAX_S: Final = 300.0
"""...then, while it keeps failing, after twice as long each time, up to this."""
_RETRY_TIMEOUT_S: Final = 5.0
"""Deadline of OpenSession on a replica tried again (a vanished host must not stall an
iteration's start for the full ``timeout_s``)."""
_RESOLVE_EVERY_S: Final = 30.0
"""A DNS target is resolved again at an iteration's start at most this often."""
_MAX_RECOVERIES: Final = 3
"""A replica that takes a new session but fails its stream this often in a row is dropped."""

Resolver = Callable[..., list[tuple[Any, ...]]]


@dataclass(frozen=True)
class Replicas:
    """The servers one Loader stripes over: addresses, and the DNS name they came from."""

    addresses: tuple[str, ...]
    dns_host: str | None = None
    """The name a ``dns:///`` target resolved (resolved again later; checked by TLS)."""
    dns_port: int = 0


def _split_host_port(where: str, target: str) -> tuple[str, int]:
    host, sep, port = where.rpartition(":")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        # gRPC's default port is 443 for dns: targets; a loader pool never listens there.
        raise InvalidArgument(f"target={target!r}: give the name and the port, dns:///NAME:PORT")
    return host, int(port)


def _addresses(host: str, port: int, resolver: Resolver) -> list[str]:
    """Every address ``host`` resolves to, as ``ip:port`` (IPv6 in brackets), in order."""
    found: list[str] = []
    for family, _, _, _, sockaddr in resolver(host, port, type=socket.SOCK_STREAM):
        ip = str(sockaddr[0])
        address = f"[{ip}]:{port}" if family == socket.AF_INET6 else f"{ip}:{port}"
        if address not in found:
            found.append(address)
    return found


def replicas_of(
    target: str | Sequence[str] | None, resolver: Resolver = socket.getaddrinfo
) -> str | Replicas:
    """One server's address (the Loader's plain path, unchanged), or the replicas to stripe
    over: a list of two or more targets, or a ``dns:///NAME:PORT`` target whose name resolves
    to two or more addresses (A and AAAA records). A name that resolves to one address, or to
    none yet, stays one target for gRPC's own resolver.

    Raises:
        InvalidArgument: an empty list, a target listed twice, a ``dns:`` target without a
            port or naming a DNS server (``dns://SERVER/...``).
    """
    if target is None or isinstance(target, str):
        single = resolve_target(target)
        if not single.startswith("dns:"):
            return single
        rest = single.removeprefix("dns:")
        if rest.startswith("//"):
            authority, _, rest = rest[2:].partition("/")
            if authority:
                raise InvalidArgument(
                    f"target={single!r} names a DNS server ({authority}); batchd resolves with "
                    "this machine's resolver: use dns:///NAME:PORT"
                )
        host, port = _split_host_port(rest, single)
        try:
            addresses = _addresses(host, port, resolver)
        except OSError as e:
            logger.info("batchd: %s does not resolve yet (%s); one target for gRPC", host, e)
            return single
        if len(addresses) < 2:
            return single
        return Replicas(tuple(addresses), host, port)
    targets = [resolve_target(t) if isinstance(t, str) else t for t in target]
    bad = [t for t in targets if not isinstance(t, str)]
    if not targets or bad:
        raise InvalidArgument(
            f"target={list(target)!r}: give one address, or a list of addresses to stripe over"
        )
    twice = sorted({t for t in targets if targets.count(t) > 1})
    if twice:
        raise InvalidArgument(f"target lists {twice} more than once; list each replica once")
    if len(targets) == 1:
        return targets[0]
    return Replicas(tuple(targets))


def connect(
    target: str | Sequence[str] | None, security: ChannelSecurity
) -> tuple[Connection, Stripes | None]:
    """A Loader's connection to its one server, or to the primary of the replicas it
    stripes over (with them). Nothing is sent yet."""
    where = replicas_of(target)
    if isinstance(where, str):
        return Connection(where, security), None
    stripes = Stripes(where, security)
    return stripes.primary, stripes


class StripedLoader(Protocol):
    """What striping needs of a :class:`batchd.Loader` (it drives the Loader's cursor)."""

    _conn: Connection
    _lost: SessionHandle | None
    _options: LoaderOptions
    _clock: LoopClock
    _iteration: object | None
    _next_batch: int
    last_failed_sample_ids: tuple[int, ...]

    def _open_session(
        self,
        version: str | None = None,
        snapshot: str | None = None,
        *,
        conn: Connection | None = None,
        wait_for_ready: bool = False,
        timeout_s: float | None = None,
    ) -> SessionHandle: ...

    def _session(self) -> SessionHandle: ...

    def _position(self) -> Cursor: ...

    def _move_to(self, cursor: Cursor) -> None: ...

    def _epoch_batches(self) -> int: ...


@dataclass(eq=False)
class _Replica:
    conn: Connection
    retry_at: float = 0.0
    """Dropped: when an iteration's start may try it again (monotonic)."""
    retry_after_s: float = _RETRY_FIRST_S


class Stripes:
    """The replicas of a striped Loader, a :class:`Connection` (and a session) each.

    The Loader's own ``_conn`` is always one of them, the *primary*, whose session answers
    ``len()``, ``state_dict()`` and the rest; the others are kept on its snapshot.
    """

    def __init__(
        self, replicas: Replicas, security: ChannelSecurity, resolver: Resolver = socket.getaddrinfo
    ) -> None:
        self._source = replicas
        self._resolver = resolver
        self._security = security
        self._replicas = [_Replica(self._connect(a)) for a in replicas.addresses]
        self._live: list[_Replica] = []
        """Replicas with a session on the reference snapshot, in ``_replicas`` order."""
        self._reference: loader_pb2.OpenSessionResponse | None = None
        """The primary's OpenSession answer: the snapshot, version and plan all must share."""
        self._resolved_at = time.monotonic()

    def _connect(self, address: str) -> Connection:
        options: list[tuple[str, Any]] = []
        if self._source.dns_host is not None and self._security.tls:
            # Connected by address; the certificate names the service.
            options.append(("grpc.ssl_target_name_override", self._source.dns_host))
        return Connection(address, self._security, options)

    @property
    def primary(self) -> Connection:
        return self._replicas[0].conn

    @property
    def live_targets(self) -> list[str]:
        """The replicas the next stripes go to, in order."""
        return [r.conn.target for r in self._live]

    def _targets(self) -> str:
        return ", ".join(repr(r.conn.target) for r in self._replicas)

    # -- sessions ----------------------------------------------------------------------------

    def open(self, loader: StripedLoader) -> None:
        """A session on every replica that answers, all on the first one's snapshot.

        Raises:
            Unavailable: no replica answered.
            BatchdError: a replica refused the session (anything but Unavailable), or
                plans the epoch differently (another catalog).
        """
        failures = []
        for replica in self._replicas:
            try:
                self._open_on(loader, replica, timeout_s=loader._options.timeout_s)
            except Unavailable as e:
                self._dropped(replica)
                failures.append(str(e))
                target = replica.conn.target
                logger.warning("batchd: replica %r unreachable, striping without it: %s", target, e)
        if not self._live:
            raise Unavailable(
                f"none of the batchd replicas {self._targets()} answered: {'; '.join(failures)}"
            )

    def _open_on(self, loader: StripedLoader, replica: _Replica, *, timeout_s: float) -> None:
        conn, reference = replica.conn, self._reference
        if reference is None:
            session = loader._open_session(conn=conn, timeout_s=timeout_s)
        else:
            session = loader._open_session(
                reference.version, reference.snapshot, conn=conn, timeout_s=timeout_s
            )
            if (session.num_batches, session.reply.num_rows) != (
                reference.num_batches,
                reference.num_rows,
            ):
                session.close(conn.stub, conn.target)
                raise FailedPrecondition(
                    f"replica {conn.target!r} plans {session.num_batches} batches of "
                    f"{session.reply.num_rows} rows on snapshot {reference.snapshot}, the "
                    f"others {reference.num_batches} of {reference.num_rows}: every replica "
                    "must serve the same catalog"
                )
        old, conn.session = conn.session, session
        if old is not None:
            old.close(conn.stub, conn.target, quiet=True)
        if reference is None:
            self._reference = session.reply
        self._admit(replica)
        replica.retry_after_s = _RETRY_FIRST_S
        if loader._conn.session is None or all(r.conn is not loader._conn for r in self._live):
            loader._conn, loader._lost = conn, None

    def _dropped(self, replica: _Replica) -> None:
        replica.retry_at = time.monotonic() + replica.retry_after_s
        replica.retry_after_s = min(replica.retry_after_s * 2, _RETRY_MAX_S)

    def _drop(self, loader: StripedLoader, replica: _Replica) -> None:
        """Stop using ``replica``: close its session (quietly: it is likely gone)."""
        if replica in self._live:
            self._live.remove(replica)
        self._dropped(replica)
        conn = replica.conn
        session, conn.session = conn.session, None
        if session is not None:
            session.close(conn.stub, conn.target, quiet=True)
        if loader._conn is conn:
            if self._live:
                loader._conn = self._live[0].conn
            else:
                # As a single-target Loader whose reconnect gave up: the next use tries again.
                loader._lost = session

    def _refresh(self, loader: StripedLoader) -> None:
        """At an iteration's start: follow the primary's session (``load_state_dict`` may
        have replaced it), resolve a DNS target again, and try dropped replicas again."""
        primary = loader._session()
        self._reference = primary.reply
        now = time.monotonic()
        if self._source.dns_host is not None and now - self._resolved_at >= _RESOLVE_EVERY_S:
            self._resolved_at = now
            self._resolve_again()
        for replica in self._replicas:
            session = replica.conn.session
            if session is not None and (session.reply.snapshot, session.reply.version) == (
                primary.reply.snapshot,
                primary.reply.version,
            ):
                self._admit(replica)  # the primary, after Loader._session() reopened it
                continue
            if session is None and replica.retry_at > now:
                continue
            try:
                self._open_on(loader, replica, timeout_s=_RETRY_TIMEOUT_S)
            except BatchdError as e:
                # A replica that cannot join costs this iteration nothing but its share.
                level = logging.DEBUG if isinstance(e, Unavailable) else logging.WARNING
                logger.log(level, "batchd: replica %r left out: %s", replica.conn.target, e)
                self._drop(loader, replica)

    def _resolve_again(self) -> None:
        """Add the DNS name's new addresses; forget dropped ones it no longer has."""
        host, port = self._source.dns_host, self._source.dns_port
        assert host is not None
        try:
            found = _addresses(host, port, self._resolver)
        except OSError as e:
            logger.info("batchd: resolving %s again failed (%s); keeping its replicas", host, e)
            return
        for replica in list(self._replicas):
            if replica.conn.target not in found and replica not in self._live:
                self._replicas.remove(replica)
                replica.conn.close()
        known = {r.conn.target for r in self._replicas}
        for address in found:
            if address not in known:
                logger.info("batchd: %s has a new replica %s", host, address)
                self._replicas.append(_Replica(self._connect(address)))

    def _admit(self, replica: _Replica) -> None:
        if replica not in self._live:
            self._live.append(replica)
            self._live.sort(key=self._replicas.index)

    def _reopen_any(self, loader: StripedLoader, left_s: float) -> None:
        """One try on every replica; Unavailable when none took a session."""
        errors = []
        for replica in self._replicas:
            try:
                self._open_on(loader, replica, timeout_s=left_s or loader._options.timeout_s)
            except Unavailable as e:
                errors.append(str(e))
        if not self._live:
            raise Unavailable("; ".join(errors))

    # -- iteration ---------------------------------------------------------------------------

    def iterate(self, loader: StripedLoader, token: object, superseded: str) -> Iterator[Any]:
        """The Loader's iteration from its cursor, striped (see the module's docstring);
        ``superseded`` is the error once a newer iteration took over."""
        if loader._iteration is not token:
            raise FailedPrecondition(superseded)
        self._refresh(loader)
        cursor = loader._position()
        loader._move_to(cursor)
        epoch, base = cursor.epoch, cursor.next_batch
        num_batches = loader._epoch_batches()
        if base >= num_batches:
            loader._move_to(Cursor(epoch + 1))
            return
        clock = loader._clock
        clock.iteration_started()
        mine: set[int] = set()
        """The streams this iteration started (by id): only those are its to cancel."""
        lanes = self._stripe(loader, cursor, base, num_batches, None, 0.0)
        mine.update(id(r.conn.stream) for r in lanes if r.conn.stream is not None)
        lost_at: float | None = None
        finished = False
        previous: Connection | None = None
        try:
            index = base
            while index < num_batches:
                conn = lanes[(index - base) % len(lanes)].conn
                session, stream = conn.session, conn.stream
                assert session is not None and stream is not None, "a lane has a stream"
                delivery = session.delivery
                plan = (conn.target, index, num_batches, epoch)
                try:
                    if previous is not None and previous is not conn:
                        # Zero-copy slots of the batch the loop just let go of go back now.
                        _ack_ready(previous)
                    batch = receive_batch(stream, session, clock.take_pending, plan)
                except (NotFound, Unavailable) as e:
                    lost_at = time.monotonic() if lost_at is None else lost_at
                    lanes, base = self._lost(loader, conn, e, cursor, index, lost_at), index
                    mine.update(id(r.conn.stream) for r in lanes if r.conn.stream is not None)
                    previous = None
                    continue
                expect_batch(batch, plan)
                out, acks = delivery.deliver(batch)
                clock.handed(batch.rows)
                stream.ack(acks, clock.take_pending())
                loader._next_batch = index + 1
                loader.last_failed_sample_ids = batch.failed_sample_ids
                index, previous, lost_at = index + 1, conn, None
                yield out
                if loader._iteration is not token:
                    raise FailedPrecondition(superseded)
                clock.asked()
            for replica in lanes:
                self._finish(replica.conn, clock)
            finished = True
            loader._move_to(Cursor(epoch + 1))
        finally:
            if not finished:
                for replica in self._replicas:
                    if id(replica.conn.stream) in mine:
                        replica.conn.abandon_stream()
            if loader._iteration is token:
                loader._iteration = None

    def _finish(self, conn: Connection, clock: LoopClock) -> None:
        stream, session = conn.stream, conn.session
        if stream is None or session is None:
            return
        conn.stream = None
        try:
            stream.ack(session.delivery.drain(), ())
            stream.finish(clock.take_pending())
        except Unavailable as e:
            # Every batch it had to serve arrived; only the goodbye was lost.
            logger.info("batchd: replica %r went away after its last batch: %s", conn.target, e)

    def _lost(
        self,
        loader: StripedLoader,
        conn: Connection,
        cause: BaseException,
        cursor: Cursor,
        index: int,
        lost_at: float,
    ) -> list[_Replica]:
        """``conn`` failed where batch ``index`` was due: see NOTE [ A replica that fails ]."""
        self.abandon_stream()
        replica = next(r for r in self._replicas if r.conn is conn)
        try:
            self._open_on(loader, replica, timeout_s=_RETRY_TIMEOUT_S)
            logger.info("batchd: replica %r took a new session (%s)", conn.target, cause)
        except BatchdError as e:
            self._drop(loader, replica)
            logger.debug("batchd: replica %r failed (%s), and again: %s", conn.target, cause, e)
            logger.warning(
                "batchd: replica %r failed mid-epoch and does not answer (%s); batches from %d "
                "on go to %s",
                conn.target,
                type(cause).__name__,
                index,
                ", ".join(map(repr, self.live_targets)) or "whichever replica comes back first",
            )
        return self._stripe(loader, cursor, index, loader._epoch_batches(), cause, lost_at)

    def _stripe(
        self,
        loader: StripedLoader,
        cursor: Cursor,
        base: int,
        num_batches: int,
        cause: BaseException | None,
        lost_at: float,
    ) -> list[_Replica]:
        """Start a stream on every live replica, striped from batch ``base``; the lanes."""
        failures: dict[_Replica, int] = {}
        while True:
            if not self._live:
                assert cause is not None, "open() leaves at least one live replica"
                retry_until(
                    lambda left_s: self._reopen_any(loader, left_s),
                    target=self._targets(),
                    timeout_s=loader._options.reconnect_timeout_s,
                    lost_at=lost_at,
                    cause=cause,
                )
            lanes = list(self._live)
            replica = lanes[0]
            try:
                for i, replica in enumerate(lanes):
                    if base + i < num_batches:
                        _start_stream(loader, replica.conn, cursor, base + i, len(lanes))
                return lanes
            except (NotFound, Unavailable) as e:
                # Its session is gone (an expired lease, a restart): one new session, else
                # drop it; then stripe again over whoever is left.
                self.abandon_stream()
                cause, lost_at = e, lost_at or time.monotonic()
                tries = failures[replica] = failures.get(replica, 0) + 1
                try:
                    if tries >= _MAX_RECOVERIES:
                        raise Unavailable(f"its streams failed {tries} times in a row: {e}")
                    self._open_on(loader, replica, timeout_s=_RETRY_TIMEOUT_S)
                except BatchdError as again:
                    logger.warning("batchd: dropping replica %r: %s", replica.conn.target, again)
                    self._drop(loader, replica)

    # -- lifetime ----------------------------------------------------------------------------

    def abandon_stream(self) -> None:
        """Cancel every replica's live stream (after device copies from its slots finish)."""
        for replica in self._replicas:
            replica.conn.abandon_stream()

    def close(self) -> None:
        """Close every session and channel. Idempotent."""
        for replica in self._replicas:
            replica.conn.close()


def _ack_ready(conn: Connection) -> None:
    """Ack what ``conn``'s delivery can give back without waiting."""
    session, stream = conn.session, conn.stream
    if session is not None and stream is not None:
        stream.ack(session.delivery.advance(wait=False), ())


def _start_stream(
    loader: StripedLoader, conn: Connection, cursor: Cursor, first: int, stride: int
) -> BatchStream:
    """As ``Loader._open_stream``: ``conn``'s stream of every ``stride``-th batch from
    ``first``, without waiting for a batch (the replicas start decoding together)."""
    session = conn.session
    assert session is not None, "only live replicas get streams"
    session.streams_started += 1
    start = loader_pb2.StreamStart(
        session_id=session.reply.session_id,
        epoch=cursor.epoch,
        start_batch=first,
        start_sample=cursor.start,
        order_world_size=cursor.order_world_size,
        transport=session.transport,
        stride=stride,
    )
    stream: BatchStream
    if session.ring is not None:
        start.seq = session.streams_started
        start.held_leases.extend(session.delivery.lent())
        stream = ShmStream(start, ring=session.ring)
    else:
        stream = InlineStream(
            conn.stub, start, target=conn.target, timeout_s=loader._options.timeout_s
        )
    conn.stream = stream
    return stream
