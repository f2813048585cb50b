"""The servers a Loader's batches come from, each a *replica*; one server is one replica.

A replica, to the client, is a server together with the Loader's connection and session on
it. A Loader on one server has one replica, which serves every batch; on R of them the epoch
is striped over the replicas. ``Loader(target=["h1:50051", "h2:50051"])``, or
``target="dns:///batchd-headless:50051"`` whose name resolves to several addresses
(``batchd._targets``), opens one session per replica, every one on the catalog snapshot of
the first. Sampling is a pure function of the options and the snapshot, so every replica
plans the same epoch, and each serves every R-th batch of it (``StreamStart.stride``): from
the first batch ``b`` an iteration streams, replica ``i`` serves ``b + i``, ``b + i + R``, ...
(batch k from replica k mod R for a whole epoch). The Loader's epoch loop takes the batches
in order from whichever replica holds each, so the loop sees one server's epoch, decoded by R
servers' CPUs; ``state_dict`` is the same global cursor.

NOTE [ A replica that fails ]
A replica whose stream fails mid-epoch (its server killed, restarted or unreachable, its
session forgotten after an idle lease) gets a new session on the same snapshot, and the
epoch goes on at the first batch the loop has not seen: sampling is a pure function of the
options and the snapshot, so the new session serves exactly the batches the old one would
have. While other replicas are live, the failed one is asked once, at once (a restarted
server, an expired session), and dropped if it does not answer. Either way every stream is
then striped again from the first batch the loop has not seen, over the replicas that are
left: the failed one's remaining batches come from the others, none is lost or repeated,
and the order is unchanged. What the others had decoded ahead (their prefetch) is decoded
again. With no replica left (always so on one server) the Loader waits for any of them for
``reconnect_timeout_s`` (``batchd._reconnect.retry_until``). A dropped replica is tried
again when a later iteration starts (after a back-off; a DNS target is resolved again then,
so a pool that scaled out is used from the next epoch on).
"""

from __future__ import annotations

import logging
import socket
import time
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any, Final

from batchd._channel import ChannelSecurity
from batchd._connection import Connection, SessionHandle
from batchd._options import LoaderOptions
from batchd._proto.batchd.v1 import loader_pb2
from batchd._reconnect import retry_until
from batchd._server_wait import ServerWait, wait_for_server
from batchd._state import Cursor
from batchd._targets import (
    ReplicaAddresses,
    Resolver,
    addresses_of,
    replicas_of,
    resolve_target,
)
from batchd._transport.stream import BatchStream
from batchd.errors import (
    BatchdError,
    FailedPrecondition,
    NotFound,
    ResourceExhausted,
    Unavailable,
)

__all__ = ["Replicas", "open_replicas"]

logger = logging.getLogger(__name__)

_RETRY_FIRST_S: Final = 10.0
"""A dropped replica is tried again at an iteration's start this long after it failed..."""
_RETRY_MAX_S: Final = 300.0
"""...then, while it keeps failing, after twice as long each time, up to this."""
_RETRY_TIMEOUT_S: Final = 5.0
"""Deadline of OpenSession on a replica asked at once or tried again (a vanished host must
not stall the others' batches, or an iteration's start, for the full ``timeout_s``)."""
_RESOLVE_EVERY_S: Final = 30.0
"""A DNS target is resolved again at an iteration's start at most this often."""
_MAX_RECOVERIES: Final = 3
"""A replica that takes a new session but fails its stream this often before the loop gets a
batch is dropped (while other replicas are live)."""


def open_replicas(
    target: str | Sequence[str] | None,
    security: ChannelSecurity,
    options: LoaderOptions,
    delivery_options: dict[str, Any],
    record: ServerWait,
) -> Replicas:
    """A Loader's replicas on ``target``, each with a session (:meth:`Replicas.open`); while
    no server answers, tried again for ``options.wait_for_server_s``, each try resolving the
    target again on fresh channels (``batchd._server_wait``).

    Raises:
        Unavailable: no server answered within the wait.
        BatchdError: a server refused the session.
    """

    def attempt(left_s: float) -> Replicas:
        replicas = Replicas(replicas_of(target), security, options, delivery_options)
        try:
            replicas.open(timeout_s=min(left_s, options.timeout_s) or options.timeout_s)
        except BaseException:
            replicas.close()
            raise
        return replicas

    assert options.wait_for_server_s is not None  # resolved in LoaderOptions
    if target is None or isinstance(target, str):
        shown = resolve_target(target)
    else:
        shown = ", ".join(map(str, target))
    return wait_for_server(
        attempt,
        target=shown,
        wait_s=options.wait_for_server_s,
        record=record,
    )


@dataclass(eq=False)
class _Replica:
    conn: Connection
    retry_at: float = 0.0
    """Dropped: when an iteration's start may try it again (monotonic)."""
    retry_after_s: float = _RETRY_FIRST_S


class Replicas:
    """A Loader's replicas (one for one server), a :class:`Connection` and a session each.

    One replica is the *primary*, whose session answers ``len()``, ``state_dict()`` and the
    rest; the others are kept on its snapshot and plan, the *reference*.

    Args:
        addresses: The servers (``batchd._targets.replicas_of``).
        security: TLS and token for every channel.
        options: The Loader's options: what each session asks for, and its deadlines.
        delivery_options: How each session's batches reach the loop
            (``batchd._device.make_delivery``'s keywords).
        resolver: ``socket.getaddrinfo``, or a stand-in, to resolve a DNS target again.
    """

    def __init__(
        self,
        addresses: ReplicaAddresses,
        security: ChannelSecurity,
        options: LoaderOptions,
        delivery_options: dict[str, Any],
        resolver: Resolver = socket.getaddrinfo,
    ) -> None:
        self._source = addresses
        self._security = security
        self._options = options
        self._delivery_options = delivery_options
        self._resolver = resolver
        self._replicas = [_Replica(self._connect(a)) for a in addresses.addresses]
        self._primary = self._replicas[0]
        self._live: list[_Replica] = []
        """Replicas with a session on the reference snapshot, in ``_replicas`` order."""
        self._reference: loader_pb2.OpenSessionResponse | None = None
        """The primary's OpenSession answer: the snapshot, version and plan all must share."""
        self._resolved_at = time.monotonic()
        self._outage_at: float | None = None
        """When the loop last lost a batch that has not arrived since (the ``lost_at`` of
        the latest failure)..."""
        self._failures: dict[_Replica, int] = {}
        """...and how often each replica failed since then."""

    def _connect(self, address: str) -> Connection:
        options: list[tuple[str, Any]] = []
        if self._source.dns_host is not None and self._security.tls:
            # Connected by address; the certificate names the service.
            options.append(("grpc.ssl_target_name_override", self._source.dns_host))
        return Connection(address, self._security, options)

    @property
    def primary(self) -> Connection:
        return self._primary.conn

    @property
    def live_targets(self) -> list[str]:
        """The replicas the next streams are striped over, in order."""
        return [replica.conn.target for replica in self._live]

    def _targets(self) -> str:
        return ", ".join(replica.conn.target for replica in self._replicas)

    # -- sessions ----------------------------------------------------------------------------

    def open(self, *, timeout_s: float | None = None) -> None:
        """A session on every replica that answers, all on the first one's snapshot, each
        OpenSession bounded by ``timeout_s`` (default: the options').

        Raises:
            Unavailable: no replica answered (on one server: its own error).
            BatchdError: a replica refused the session (anything but Unavailable), or
                plans the epoch differently (another catalog).
        """
        failures: list[tuple[_Replica, Unavailable]] = []
        for replica in self._replicas:
            try:
                self._open_on(replica, timeout_s=timeout_s or self._options.timeout_s)
            except Unavailable as e:
                self._dropped(replica)
                failures.append((replica, e))
        if not self._live:
            if len(failures) == 1:
                raise failures[0][1]
            raise Unavailable(
                f"none of the batchd replicas {self._targets()} answered: "
                + "; ".join(str(e) for _, e in failures)
            )
        for replica, error in failures:
            target = replica.conn.target
            logger.warning("batchd: replica %r unreachable, striping without it: %s", target, error)

    def session(self) -> SessionHandle:
        """The primary's session; when reconnecting gave up (Unavailable was raised), a new
        one on the reference snapshot, tried once now.

        Raises:
            BatchdError: the server is still away, or refused the session.
        """
        conn = self._primary.conn
        if conn.session is None:
            self._open_on(self._primary, timeout_s=self._options.timeout_s)
            conn = self._primary.conn
        assert conn.session is not None, "_open_on leaves the replica a session"
        return conn.session

    def open_session(self, version: str | None, snapshot: str | None) -> SessionHandle:
        """A new session on the primary's server, on ``version`` and ``snapshot`` (None:
        the options' own), not yet used: :meth:`adopt` makes it the primary's."""
        return self._open_session(
            self._primary.conn, version, snapshot, timeout_s=self._options.timeout_s
        )

    def adopt(self, session: SessionHandle) -> None:
        """Make ``session`` (from :meth:`open_session`) the primary's and its snapshot the
        reference; the other replicas follow it when the next iteration starts."""
        self._primary.conn.replace_session(session)
        self._reference = session.reply

    def refresh(self) -> SessionHandle:
        """At an iteration's start: follow the primary's session (``load_state_dict`` may
        have replaced it), resolve a DNS target again, try dropped replicas again; the
        primary's session."""
        primary = self.session()
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
                self._admit(replica)  # the primary, after session() reopened it
                continue
            if session is None and replica.retry_at > now:
                continue
            try:
                self._open_on(replica, timeout_s=_RETRY_TIMEOUT_S)
            except BatchdError as e:
                # A replica that cannot join costs this iteration nothing but its share.
                level = logging.DEBUG if isinstance(e, Unavailable) else logging.WARNING
                logger.log(level, "batchd: replica %r left out: %s", replica.conn.target, e)
                self._drop(replica)
        return primary

    def _open_session(
        self,
        conn: Connection,
        version: str | None,
        snapshot: str | None,
        *,
        timeout_s: float,
        wait_for_ready: bool = False,
    ) -> SessionHandle:
        options = self._options
        return conn.open_session(
            options.to_request(version=version, snapshot=snapshot),
            transport=options.transport,
            timeout_s=timeout_s,
            wait_for_ready=wait_for_ready,
            delivery_options=self._delivery_options,
        )

    def _open_on(
        self, replica: _Replica, *, timeout_s: float, wait_for_ready: bool = False
    ) -> None:
        """A new session for ``replica`` on the reference (the first one: the options' own, and
        it becomes the reference). Its old session goes first, quietly: it failed, or it
        serves another snapshot, and it would hold a place in the server's limits.

        Raises:
            FailedPrecondition: the replica plans the epoch differently.
            BatchdError: it refused the session or did not answer.
        """
        conn, reference = replica.conn, self._reference
        conn.abandon_stream()
        old, conn.session = conn.session, None
        if old is not None:
            old.close(conn.stub, conn.target, quiet=True)
        if reference is None:
            session = self._open_session(conn, None, None, timeout_s=timeout_s)
            self._reference = session.reply
        else:
            session = self._open_session(
                conn,
                reference.version,
                reference.snapshot,
                timeout_s=timeout_s,
                wait_for_ready=wait_for_ready,
            )
            planned = (session.num_batches, session.reply.num_rows)
            if planned != (reference.num_batches, reference.num_rows):
                session.close(conn.stub, conn.target)
                raise FailedPrecondition(
                    f"the server at {conn.target!r} plans {session.num_batches} batches of "
                    f"{session.reply.num_rows} rows on snapshot {reference.snapshot}, this "
                    f"Loader {reference.num_batches} of {reference.num_rows}: every replica "
                    "must serve the same catalog; create a new Loader"
                )
        conn.session = session
        self._admit(replica)
        replica.retry_after_s = _RETRY_FIRST_S
        if self._primary.conn.session is None or self._primary not in self._live:
            self._primary = replica

    def _dropped(self, replica: _Replica) -> None:
        replica.retry_at = time.monotonic() + replica.retry_after_s
        replica.retry_after_s = min(replica.retry_after_s * 2, _RETRY_MAX_S)

    def _drop(self, replica: _Replica) -> None:
        """Stop using ``replica``: close its session (quietly: it is likely gone)."""
        if replica in self._live:
            self._live.remove(replica)
        self._dropped(replica)
        conn = replica.conn
        conn.abandon_stream()
        session, conn.session = conn.session, None
        if session is not None:
            session.close(conn.stub, conn.target, quiet=True)
        if replica is self._primary and self._live:
            self._primary = self._live[0]

    def _admit(self, replica: _Replica) -> None:
        if replica not in self._live:
            self._live.append(replica)
            self._live.sort(key=self._replicas.index)

    def _resolve_again(self) -> None:
        """Add the DNS name's new addresses; forget dropped ones it no longer has."""
        host, port = self._source.dns_host, self._source.dns_port
        assert host is not None
        try:
            found = addresses_of(host, port, self._resolver)
        except OSError as e:
            logger.info("batchd: resolving %s again failed (%s); keeping its replicas", host, e)
            return
        for replica in list(self._replicas):
            if replica.conn.target not in found and replica not in self._live:
                self._replicas.remove(replica)
                replica.conn.close()
        known = {replica.conn.target for replica in self._replicas}
        for address in found:
            if address not in known:
                logger.info("batchd: %s has a new replica %s", host, address)
                self._replicas.append(_Replica(self._connect(address)))

    def _reopen_any(self, left_s: float) -> None:
        """One try on every replica, ``left_s`` seconds before the deadline (0: no time to
        wait); the error when none took a session."""
        timeout_s = self._options.timeout_s
        if left_s > 0:
            timeout_s = min(left_s, timeout_s)
        # One server is waited for until it is reachable; several are tried in turn, so one
        # that is gone for good does not keep the others waiting.
        wait_for_ready = left_s > 0 and len(self._replicas) == 1
        errors: list[BatchdError] = []
        for replica in self._replicas:
            try:
                self._open_on(replica, timeout_s=timeout_s, wait_for_ready=wait_for_ready)
            except (Unavailable, ResourceExhausted) as e:
                errors.append(e)
        if not self._live:
            if len(errors) == 1:
                raise errors[0]
            raise Unavailable("; ".join(map(str, errors)))

    # -- streams -----------------------------------------------------------------------------

    def stripe(
        self,
        cursor: Cursor,
        num_batches: int,
        *,
        cause: BaseException | None = None,
        lost_at: float | None = None,
        join_share: bool = False,
    ) -> list[Connection]:
        """Start a stream on every live replica, striped from batch ``cursor.next_batch`` of
        ``num_batches``; their connections, replica ``i`` serving that batch ``+ i``,
        ``+ i + R``, ...

        A replica whose session turns out to be gone gets a new one or is dropped; with none
        left, any replica is waited for until ``reconnect_timeout_s`` after ``lost_at``
        (see NOTE [ A replica that fails ]).

        Args:
            cursor: The epoch and the first batch to stream.
            num_batches: The batches of the epoch's plan on this rank.
            cause: What failed, when striping again after a failure.
            lost_at: When it failed (monotonic).
            join_share: Ask each replica's server to start the epoch at its share group's
                position; the server decides whether the stream may (``StreamStart.join_share``).

        Raises:
            Unavailable, ResourceExhausted: no replica took a session in time, or the last
                one kept failing its streams until then.
            BatchdError: a replica refused the session or the stream.
        """
        try:
            while True:
                if not self._live:
                    assert cause is not None and lost_at is not None, "open() leaves a replica"
                    retry_until(
                        self._reopen_any,
                        target=self._targets(),
                        timeout_s=self._options.reconnect_timeout_s,
                        lost_at=lost_at,
                        cause=cause,
                        failed_before=max(self._failures.values(), default=1) - 1,
                    )
                replicas = list(self._live)
                replica = replicas[0]
                try:
                    for i, replica in enumerate(replicas):
                        first = cursor.next_batch + i
                        if first < num_batches:
                            replica.conn.start_stream(
                                replace(cursor, next_batch=first),
                                stride=len(replicas),
                                timeout_s=self._options.timeout_s,
                                join_share=join_share,
                            )
                    return [replica.conn for replica in replicas]
                except (NotFound, Unavailable) as e:
                    # Its session is gone (an idle lease ran out, a restart): see the NOTE.
                    logger.info(
                        "batchd: stream on %r failed (%s); reopening", replica.conn.target, e
                    )
                    self.abandon_streams()
                    cause, lost_at = e, time.monotonic() if lost_at is None else lost_at
                    self._recover(replica, e, cursor.next_batch, lost_at)
        except BaseException:
            self.abandon_streams()
            raise

    def lost(
        self,
        conn: Connection,
        cause: BaseException,
        cursor: Cursor,
        num_batches: int,
        lost_at: float,
    ) -> list[Connection]:
        """``conn``'s stream failed where batch ``cursor.next_batch`` was due: see NOTE [ A
        replica that fails ]; the replicas striped again from that batch, as :meth:`stripe`."""
        self.abandon_streams()
        replica = next(replica for replica in self._replicas if replica.conn is conn)
        self._recover(replica, cause, cursor.next_batch, lost_at)
        return self.stripe(cursor, num_batches, cause=cause, lost_at=lost_at)

    def _recover(self, replica: _Replica, cause: BaseException, index: int, lost_at: float) -> None:
        """After ``replica``'s stream failed where batch ``index`` was due, in the outage that
        began at ``lost_at``: while other replicas are live, ask it once, at once, for a new
        session; else (or when that fails, or it failed too often) drop it.

        Raises:
            Unavailable: the replica is the last one, and keeps failing on new sessions past
                ``reconnect_timeout_s`` after ``lost_at``.
        """
        target = replica.conn.target
        if lost_at != self._outage_at:
            self._outage_at, self._failures = lost_at, {}
        tries = self._failures[replica] = self._failures.get(replica, 0) + 1
        others = [other.conn.target for other in self._live if other is not replica]
        if not others:
            waited_s = time.monotonic() - lost_at
            timeout_s = self._options.reconnect_timeout_s
            if tries > 1 and waited_s >= timeout_s:
                # It takes new sessions, but no batch comes (retry_until cannot tell: its
                # attempts succeed).
                raise Unavailable(
                    f"the batchd server at {target!r} took new sessions but lost each before "
                    f"a batch came ({tries - 1} times in {waited_s:.1f} s, reconnect_timeout_s="
                    f"{timeout_s:g} s); the last failure: {cause}. Check the server's log"
                ) from cause
            self._drop(replica)  # stripe() waits for any replica, this one included
            return
        try:
            if tries >= _MAX_RECOVERIES:
                raise Unavailable(f"its streams failed {tries} times in a row")
            self._open_on(replica, timeout_s=_RETRY_TIMEOUT_S)
        except BatchdError as e:
            self._drop(replica)
            logger.debug("batchd: replica %r failed (%s), and again: %s", target, cause, e)
            logger.warning(
                "batchd: replica %r failed mid-epoch and does not answer (%s); batches from %d "
                "on go to %s",
                target,
                type(cause).__name__,
                index,
                ", ".join(map(repr, others)),
            )
        else:
            logger.info("batchd: replica %r took a new session (%s)", target, cause)

    # -- lifetime ----------------------------------------------------------------------------

    def abandon_streams(self) -> None:
        """Cancel every replica's live stream (after device copies from its slots finish)."""
        for replica in self._replicas:
            replica.conn.abandon_stream()

    def abandon(self, streams: Sequence[BatchStream]) -> None:
        """Cancel ``streams`` (one iteration's), leaving a newer iteration's alone."""
        for replica in self._replicas:
            stream = replica.conn.stream
            if stream is not None and any(stream is mine for mine in streams):
                replica.conn.abandon_stream()
        for stream in streams:
            stream.cancel()

    def close(self) -> None:
        """Close every session and channel. Idempotent."""
        for replica in self._replicas:
            replica.conn.close()
