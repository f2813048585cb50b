"""Opening, finding, closing and expiring sessions; the rings they own."""

from __future__ import annotations

import functools
import logging
import secrets
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import wait as wait_futures
from dataclasses import dataclass
from pathlib import Path
from typing import Final, NamedTuple

from batchd._wire.ring import slot_offset
from batchd_server.catalog_cache import CatalogCache, CatalogEntry
from batchd_server.errors import FailedPrecondition, InvalidArgument, NotFound, ResourceExhausted
from batchd_server.limits import MAX_SLOT_BYTES
from batchd_server.logs import session_log_id
from batchd_server.metrics.admission import REFUSED, SESSIONS
from batchd_server.pipelines.registry import build_pipeline
from batchd_server.planning.budget import plan_bytes
from batchd_server.planning.pacing import collector_paused
from batchd_server.service_settings import SessionSettings
from batchd_server.sessions.options import SessionOptions, ring_slots, slot_layout
from batchd_server.sessions.ring import SessionRing
from batchd_server.sessions.session import Session
from batchd_server.sessions.share_groups import ShareGroups, lent_slots
from batchd_server.sessions.sources import (
    acquire_sources,
    check_field_sources,
    check_source_pipelines,
    release_sources,
    snapshot_token,
)
from batchd_server.shm import ShmRegistry, format_bytes
from batchd_server.shm.space import remedy, usable_bytes
from batchd_server.storage.roots import check_object_root
from batchd_server.storage.schemes import is_local_root
from batchd_server.workers.packed import session_pipeline
from batchd_server.workers.pool import WorkerPool
from batchd_server.workers.task import ReadOptions, SlotField

__all__ = ["SessionManager"]

logger = logging.getLogger(__name__)

_CLOSE_WAIT_S: Final = 60.0
"""How long closing a session waits for workers still writing into its ring."""
_REAP_WAIT_S: Final = 5.0
"""How long the lease reaper waits, for all the sessions it closes together, on workers still
writing into their rings (an expired session has no stream, so normally none)."""


@dataclass
class _Usage:
    """One client's share: its sessions (open or opening), their rings' bytes and their
    plans' bytes (``planning.budget``)."""

    sessions: int = 0
    ring_bytes: int = 0
    plan_bytes: int = 0

    def add(self, ring_bytes: int) -> None:
        self.sessions += 1
        self.ring_bytes += ring_bytes

    def remove(self, ring_bytes: int, plan_bytes: int) -> bool:
        """Take one session off; True when none is left."""
        self.sessions -= 1
        self.ring_bytes -= ring_bytes
        self.plan_bytes -= plan_bytes
        return self.sessions <= 0


class _Owner(NamedTuple):
    """Who opened a session, and what it holds of their quotas."""

    client: str
    ring_bytes: int
    plan_bytes: int


class SessionManager:
    """Opens, finds, closes and expires sessions; owns their rings through ``registry``."""

    def __init__(
        self,
        *,
        catalog: CatalogCache,
        pool: WorkerPool,
        registry: ShmRegistry,
        limits: SessionSettings,
        client_shm_quota_bytes: int | None = None,
        record_errors: Callable[[list[tuple[int, str, str]]], object],
        doorbell: str = "",
        read: ReadOptions | None = None,
    ) -> None:
        """``limits``: the sessions' settings (``--max-sessions``, ``--client-max-sessions``,
        ``--lease-timeout-s``, ``--data-root``); the server's whole configuration is one."""
        self._read = read or ReadOptions()
        """How workers read and decode samples; its decode cache goes to every session that
        does not opt out."""
        self._catalog = catalog
        self._pool = pool
        self._registry = registry
        self.lease_timeout_s = limits.lease_timeout_s
        self._max_sessions = limits.max_sessions
        self._client_max_sessions = min(limits.client_max_sessions, limits.max_sessions)
        self._client_shm_quota = client_shm_quota_bytes or registry.budget_bytes
        self._client_plan_quota = limits.client_plan_quota_bytes
        self._usage: dict[str, _Usage] = {}
        """Per client: its sessions (open or opening), their ring bytes and plan bytes."""
        self._owners: dict[str, _Owner] = {}
        """Session id -> its client and what it holds of their quotas, for every open one."""
        self._record_errors = record_errors
        self._sessions: dict[str, Session] = {}
        self._opening = 0
        """Opens past the max-sessions check and not yet in ``_sessions``."""
        self.doorbell = doorbell
        """The doorbell socket's name in the shm directory (``RingLayout.doorbell``)."""
        self._data_roots = tuple(r.resolve() for r in limits.data_roots)
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self.shares = ShareGroups(pool, limits.share_loan_timeout_s)
        """The share groups of sessions opened with ``share=`` (``sessions/share.py``); it
        builds every session's dispatcher."""
        self._reaper = threading.Thread(target=self._reap, name="batchd-lease", daemon=True)
        self._reaper.start()

    def __len__(self) -> int:
        return len(self._sessions)

    def open(self, options: SessionOptions, client: str = "") -> Session:
        """Open a session for ``client`` (an identity from ``api/admission.py``; its sessions
        and ring bytes count against the per-client quotas).

        Raises:
            InvalidArgument, NotFound, FailedPrecondition, SnapshotMismatch,
            ResourceExhausted: as the message says.
        """
        decoder = build_pipeline(options.pipeline_kind, options.pipeline_options)
        check_source_pipelines(options, decoder)
        fields = session_pipeline(decoder, options.pack).fields()
        layout, slot_bytes = slot_layout(
            fields,
            options.sampler.batch_size,
            labels_rows=options.mixing.labels_rows,
        )
        if slot_bytes > MAX_SLOT_BYTES:
            raise InvalidArgument(
                f"one batch would take {format_bytes(slot_bytes)}, more than the "
                f"{format_bytes(MAX_SLOT_BYTES)} a slot may hold; lower batch_size"
            )
        slots = ring_slots(options.prefetch, slot_bytes) + lent_slots(options)
        ring_bytes = slot_offset(slots, slot_bytes)
        # The checks and the reservation are one step, so that opens racing each other cannot
        # pass a limit together.
        with self._lock:
            self._check_limits(client, ring_bytes)
            self._opening += 1
            self._usage.setdefault(client, _Usage()).add(ring_bytes)
        try:
            return self._open(options, client, layout, slot_bytes, slots)
        except BaseException:
            with self._lock:
                self._opening -= 1
                self._drop_usage(_Owner(client, ring_bytes, 0))
            raise

    def _check_limits(self, client: str, ring_bytes: int) -> None:
        """Refuse an open past the server's or the client's limits (caller holds the lock)."""
        if len(self._sessions) + self._opening >= self._max_sessions:
            REFUSED.labels("max_sessions").inc()
            raise ResourceExhausted(
                f"the server has {len(self._sessions)} open sessions and "
                f"{self._opening} opening, its limit (--max-sessions, BATCHD_MAX_SESSIONS="
                f"{self._max_sessions}); close loaders you no longer use, or raise it"
            )
        usage = self._usage.get(client, _Usage())
        if usage.sessions >= self._client_max_sessions:
            REFUSED.labels("client_max_sessions").inc()
            raise ResourceExhausted(
                f"client {client!r} holds {usage.sessions} sessions (open or opening), its "
                f"limit (--client-max-sessions, BATCHD_CLIENT_MAX_SESSIONS="
                f"{self._client_max_sessions}); close loaders this process no longer uses, "
                "or raise the limit"
            )
        # A closed share-group member's ring that this client's loans keep is the client's.
        kept = self.shares.kept_bytes(client)
        if usage.ring_bytes + kept + ring_bytes > self._client_shm_quota:
            REFUSED.labels("client_shm_quota").inc()
            raise ResourceExhausted(self._over_quota(client, usage, ring_bytes, kept))

    def _over_quota(self, client: str, usage: _Usage, ring_bytes: int, kept: int = 0) -> str:
        """Why ``client``'s next ring of ``ring_bytes`` is refused: the shm filesystem when it
        could not hold the client's rings whatever the quota (raising the quota is then no
        help), else the quota."""
        held = usage.ring_bytes + kept + ring_bytes
        space = self._registry.space()
        room = usable_bytes(space.size_bytes)
        if held > room and self._registry.budget_bytes >= room:
            beside = (
                f" beside the {format_bytes(usage.ring_bytes)} client {client!r} holds"
                if usage.ring_bytes
                else ""
            )
            return (
                f"{space.path} is {format_bytes(space.size_bytes)} in all "
                f"({format_bytes(space.free_bytes)} free), too small for the "
                f"{format_bytes(ring_bytes)} of ring this session needs{beside}: "
                f"{remedy(space, held)}; or lower prefetch or batch_size. The filesystem is "
                "the limit, so raising --client-shm-quota or --shm-budget would not help"
            )
        return (
            f"client {client!r} holds {format_bytes(usage.ring_bytes)} of rings in "
            f"{usage.sessions} sessions"
            + (
                f" and {format_bytes(kept)} of closed share-group members' rings that its "
                "loaders still read"
                if kept
                else ""
            )
            + f" and this one needs {format_bytes(ring_bytes)} "
            f"more, over its quota of {format_bytes(self._client_shm_quota)} "
            "(--client-shm-quota, BATCHD_CLIENT_SHM_QUOTA; default half of --shm-budget, at "
            "most what the shm directory holds); close loaders this process no longer uses, "
            "lower prefetch or batch_size, or raise the quota"
        )

    def _drop_usage(self, owner: _Owner) -> None:
        """Give back one session's share of its client's quotas (caller holds the lock)."""
        usage = self._usage.get(owner.client)
        if usage is not None and usage.remove(owner.ring_bytes, owner.plan_bytes):
            del self._usage[owner.client]

    def usage(self, client: str) -> tuple[int, int]:
        """``client``'s sessions (open or opening) and the ring bytes they hold."""
        with self._lock:
            usage = self._usage.get(client, _Usage())
            return usage.sessions, usage.ring_bytes

    def plan_usage(self, client: str) -> int:
        """The plan bytes ``client``'s sessions (open or opening) are charged."""
        with self._lock:
            return self._usage.get(client, _Usage()).plan_bytes

    def _charge_plan(
        self, client: str, options: SessionOptions, entries: Sequence[CatalogEntry]
    ) -> int:
        """Charge the plans of a session of ``options`` over ``entries`` to ``client``'s plan
        quota, before any is built; the bytes charged.

        Raises:
            ResourceExhausted: past the quota (nothing is charged).
            InvalidArgument, FailedPrecondition: the sources cannot be planned.
        """
        needed = plan_bytes(
            options.mixing,
            options.pack,
            (options.pipeline_kind, options.pipeline_options),
            [entry.arrays for entry in entries],
        )
        with self._lock:
            usage = self._usage[client]  # the open counts: it is there
            if usage.plan_bytes + needed > self._client_plan_quota:
                REFUSED.labels("client_plan_quota").inc()
                raise ResourceExhausted(
                    f"client {client!r} holds {format_bytes(usage.plan_bytes)} of epoch plans "
                    f"in its other sessions and this one's would take "
                    f"{format_bytes(needed)} more, over its quota of "
                    f"{format_bytes(self._client_plan_quota)} (--client-plan-quota, "
                    "BATCHD_CLIENT_PLAN_QUOTA); close loaders this process no longer uses, "
                    "set a smaller Mix stop, a larger Pack seq_len, or open a smaller split, "
                    "or raise the quota"
                )
            usage.plan_bytes += needed
        return needed

    def _open(
        self,
        options: SessionOptions,
        client: str,
        layout: tuple[SlotField, ...],
        slot_bytes: int,
        slots: int,
    ) -> Session:
        ring_bytes = slot_offset(slots, slot_bytes)
        entries = acquire_sources(self._catalog, options)
        try:
            check_field_sources(options, entries)
            planned = self._charge_plan(client, options, entries)
        except BaseException:
            release_sources(self._catalog, entries)
            raise
        try:
            return self._open_charged(
                options, _Owner(client, ring_bytes, planned), entries, layout, slot_bytes, slots
            )
        except BaseException:
            with self._lock:
                self._usage[client].plan_bytes -= planned
            raise

    def _open_charged(
        self,
        options: SessionOptions,
        owner: _Owner,
        entries: tuple[CatalogEntry, ...],
        layout: tuple[SlotField, ...],
        slot_bytes: int,
        slots: int,
    ) -> Session:
        client, ring_bytes = owner.client, owner.ring_bytes
        try:
            roots = tuple(
                self._checked_root(e.arrays.dataset.name, e.arrays.dataset.root) for e in entries
            )
            purpose = (
                f"{slots} slots of {format_bytes(slot_bytes)} for batch_size="
                f"{options.sampler.batch_size} of {options.dataset!r}"
            )
            ring = self._catalog.create_segment("ring", ring_bytes, purpose=purpose)
        except BaseException:
            release_sources(self._catalog, entries)
            raise
        token = secrets.token_bytes(16)
        ring.buf[: len(token)] = token
        session_id = secrets.token_hex(16)
        session_ring = SessionRing(session_id, ring, layout, slot_bytes, token, client)
        dispatch = self.shares.dispatch(session_ring, options, snapshot_token(options, entries))
        try:
            # Its sources packed and its first epoch planned (NOTE in planning/pacing.py).
            with collector_paused():
                session = Session(
                    session_id=session_id,
                    options=options,
                    sources=entries,
                    ring=session_ring,
                    dispatch=dispatch,
                    record_errors=self._record_errors,
                    roots=roots,
                    read=self._read.for_session(decode_cache=options.decode_cache),
                )
            if session.num_batches == 0:
                raise FailedPrecondition(
                    f"drop_last=True leaves no batch: {session.num_rows} samples over "
                    f"{options.sampler.world_size} rank(s) do not fill one batch of "
                    f"{options.sampler.batch_size}; lower batch_size or set drop_last=False"
                )
        except BaseException:
            dispatch.leave(functools.partial(self._registry.release, ring))
            release_sources(self._catalog, entries)
            raise
        with self._lock:
            # Opening to open in one step: a session counted in both would make the
            # max-sessions check refuse an open the limit allows.
            self._opening -= 1
            self._sessions[session_id] = session
            self._owners[session_id] = owner
            SESSIONS.set(len(self._sessions))
        logger.info(
            "session %s opened for %s: %s, %d batches of %d on rank %d/%d, ring %s",
            session_log_id(session_id),
            client or "an unnamed client",
            " + ".join(
                f"{e.arrays.dataset.name}/{e.arrays.dataset.version} split {e.arrays.split}"
                for e in entries
            ),
            session.num_batches,
            options.sampler.batch_size,
            options.sampler.rank,
            options.sampler.world_size,
            format_bytes(ring.nbytes),
        )
        return session

    def _checked_root(self, dataset: str, root: str) -> str:
        """``root`` with its symlinks resolved, once checked to lie under a ``--data-root`` and
        to be a directory: what the workers open, so that a symlink swapped in after the
        check cannot lead them elsewhere.

        An ``s3://`` root is checked by listing one object under it (see
        :func:`check_object_root`).

        Raises:
            FailedPrecondition: the root is outside every data root, or not a directory
                (or an object-store prefix that cannot be reached).
        """
        if not is_local_root(root):
            check_object_root(dataset, root, self._read.store)
            return root
        resolved = Path(root).resolve()
        if self._data_roots and not any(resolved.is_relative_to(r) for r in self._data_roots):
            allowed = ", ".join(str(r) for r in self._data_roots)
            raise FailedPrecondition(
                f"dataset {dataset!r} has root {root!r}, outside the server's data roots "
                f"({allowed}); move the data under one of them and re-ingest, or add its "
                "directory with --data-root (BATCHD_DATA_ROOTS)"
            )
        if not resolved.is_dir():
            raise FailedPrecondition(
                f"dataset {dataset!r} has root {root!r}, which is not a directory on the "
                "server; mount the data there or re-ingest with the right --root"
            )
        return str(resolved)

    def live(self) -> list[Session]:
        """Every open session, now (the node cache's manager reads their plans)."""
        with self._lock:
            return list(self._sessions.values())

    def live_roots(self) -> set[str]:
        """The dataset roots the open sessions' workers read (the decode cache keeps their
        entries: NOTE [ Admission and eviction ] in ``decode_cache/owner.py``)."""
        with self._lock:
            sessions = list(self._sessions.values())
        return {source.root for session in sessions for source in session.spec.sources}

    def get(self, session_id: str, client: str | None = None) -> Session:
        """The open session ``session_id``; with ``client``, only if that client opened it.

        Raises:
            NotFound: no such session open, or (with ``client``) another client's: the two
                read the same, so that a session's existence is no one else's to learn.
        """
        with self._lock:
            session = self._sessions.get(session_id)
            if session is not None and not self._owned_by(session_id, client):
                session = None
        if session is None:
            raise NotFound(
                f"no open session {session_id!r}: it was closed, or expired after "
                f"{self.lease_timeout_s:g} s without a stream, or the server restarted; "
                "open a new one"
            )
        return session

    def _owned_by(self, session_id: str, client: str | None) -> bool:
        """Whether ``client`` (None: the server itself) may use the session (caller holds the
        lock); a refusal is logged, for the operator, never told to the caller."""
        owner = self._owners[session_id].client
        if client is None or client == owner:
            return True
        logger.warning(
            "client %r named session %s, which client %r opened; it is told there is no "
            "such session",
            client,
            session_log_id(session_id),
            owner,
        )
        return False

    def close(
        self,
        session_id: str,
        *,
        client: str | None = None,
        reason: str = "closed by the client",
    ) -> bool:
        """Close a session and free its ring; False when there was no such session, or
        (with ``client``) it is another client's, which stays open."""
        with self._lock:
            session = self._sessions.get(session_id)
            if session is None or not self._owned_by(session_id, client):
                return False
            self._take(session)
        self._finish([session], timeout_s=_CLOSE_WAIT_S, reason=reason)
        return True

    def _take(self, session: Session) -> None:
        """Remove ``session`` and give back its share of its client's quota (caller holds the
        lock)."""
        del self._sessions[session.id]
        SESSIONS.set(len(self._sessions))
        self._drop_usage(self._owners.pop(session.id))

    def _finish(self, sessions: list[Session], *, timeout_s: float, reason: str | None) -> None:
        """Close ``sessions`` (already taken) together: all their streams end at once, then
        the workers still writing into any of their rings get ``timeout_s`` seconds in all,
        then every ring and catalog entry is freed; a line each says ``reason`` (if any)."""
        busy = [future for session in sessions for future in session.close()]
        if busy:
            wait_futures(busy, timeout=timeout_s)
        for session in sessions:
            self._pool.forget_session(session.id)
            # A share group's member's ring outlives it while another member's client reads
            # a slot of it.
            session.dispatch.leave(functools.partial(self._registry.release, session.ring.segment))
            release_sources(self._catalog, session.catalogs)
            if reason is not None:
                logger.info("session %s %s; its ring is freed", session_log_id(session.id), reason)

    def _reap(self) -> None:
        interval = min(1.0, self.lease_timeout_s / 4)
        while not self._stop.wait(interval):
            self.reap()
            self.shares.reclaim()

    def reap(self) -> int:
        """Close every session that went ``lease_timeout_s`` without a stream; how many.

        Each is checked again under the locks right before it is taken (``Session.expire``):
        a client may start a stream on it meanwhile (a reconnect), and then it stays open.
        Those taken close together, in one bounded wait, so that none holds up the others.
        """
        now = time.monotonic()
        with self._lock:
            idle = [
                s
                for s in self._sessions.values()
                if not s.streaming and now - s.last_used > self.lease_timeout_s
            ]
        if not idle:
            return 0
        expired = []
        with self._lock:
            for session in idle:
                if self._sessions.get(session.id) is session and session.expire(
                    self.lease_timeout_s
                ):
                    self._take(session)
                    expired.append(session)
        if expired:
            reason = f"expired after {self.lease_timeout_s:g} s without a stream"
            self._finish(expired, timeout_s=_REAP_WAIT_S, reason=reason)
        return len(expired)

    def close_all(self, timeout_s: float = _CLOSE_WAIT_S) -> None:
        """Close every session (server shutdown): all their streams end at once, then the
        workers still writing into any ring get ``timeout_s`` seconds in all, together."""
        self._stop.set()
        with self._lock:
            sessions = list(self._sessions.values())
            self._sessions.clear()
            self._owners.clear()
            self._usage.clear()
            SESSIONS.set(0)
        self._finish(sessions, timeout_s=timeout_s, reason=None)
        if sessions:
            logger.info("closed %d session(s) at server shutdown", len(sessions))
        self._reaper.join(min(5.0, timeout_s))
