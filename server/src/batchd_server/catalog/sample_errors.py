"""Record samples that failed to decode in ``sample_errors``, one row per (sample, kind)."""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Iterable

import sqlalchemy as sa
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.engine import Engine

from batchd_server.catalog.db import connect, is_postgres
from batchd_server.catalog.schema import sample_errors
from batchd_server.errors import Unavailable

__all__ = ["SampleErrorWriter", "record_sample_errors"]

logger = logging.getLogger(__name__)

_MAX_MESSAGE_CHARS = 2000


def record_sample_errors(engine: Engine, errors: Iterable[tuple[int, str, str]]) -> int:
    """Upsert ``(sample_id, kind, message)`` rows: a new (sample, kind) is inserted, a known
    one gets ``count + 1``, the latest message and ``last_seen = now()``.

    Returns:
        How many rows were written.
    """
    merged: dict[tuple[int, str], int] = {}
    messages: dict[tuple[int, str], str] = {}
    for sample_id, kind, message in errors:
        key = (int(sample_id), kind)
        merged[key] = merged.get(key, 0) + 1
        messages[key] = message[:_MAX_MESSAGE_CHARS]
    if not merged:
        return 0
    rows = [
        {"sample_id": sid, "kind": kind, "message": messages[sid, kind], "count": n}
        for (sid, kind), n in merged.items()
    ]
    insert = (postgresql.insert if is_postgres(engine) else sqlite.insert)(sample_errors)
    table = sample_errors
    statement = insert.on_conflict_do_update(
        index_elements=[table.c.sample_id, table.c.kind],
        set_={
            "count": table.c.count + insert.excluded.count,
            "message": insert.excluded.message,
            "last_seen": sa.func.now(),
        },
    )
    with connect(engine) as conn:
        conn.execute(statement, rows)
        conn.commit()
    return len(rows)


class SampleErrorWriter:
    """Writes sample-error rows from a bounded queue on a thread of its own.

    A stream that meets a bad sample only enqueues its rows (:meth:`submit` never blocks),
    so a slow or unreachable catalog never stalls a batch. Rows that cannot be written are
    kept (up to ``max_rows``) and retried every ``retry_s``; beyond that the oldest are
    dropped and counted in :attr:`dropped` (every failure is also in the server's log and
    metrics).
    """

    def __init__(self, engine: Engine, *, max_rows: int = 10_000, retry_s: float = 5.0) -> None:
        self._engine = engine
        self._max_rows = max_rows
        self._retry_s = retry_s
        self._queue: queue.Queue[list[tuple[int, str, str]]] = queue.Queue(maxsize=max_rows)
        self._stop = threading.Event()
        self.dropped = 0
        """Rows given up on (queue full, or kept too long while the catalog was down)."""
        self._accepted = 0
        self._settled = 0
        """Accepted rows written or dropped since; :meth:`flush` waits for all."""
        self._thread = threading.Thread(target=self._run, name="batchd-sample-errors", daemon=True)
        self._thread.start()

    def submit(self, rows: list[tuple[int, str, str]]) -> None:
        """Queue ``rows`` for writing; drops them (counted) when the queue is full."""
        if not rows:
            return
        try:
            self._queue.put_nowait(list(rows))
            self._accepted += len(rows)
        except queue.Full:
            self.dropped += len(rows)
            logger.warning(
                "sample-error queue full: %d rows not recorded in the catalog (%d so far)",
                len(rows),
                self.dropped,
            )

    def _take(self, pending: list[tuple[int, str, str]], timeout_s: float) -> None:
        try:
            pending += self._queue.get(timeout=timeout_s)
            while True:
                pending += self._queue.get_nowait()
        except queue.Empty:
            pass

    def _run(self) -> None:
        pending: list[tuple[int, str, str]] = []
        while not (self._stop.is_set() and not pending and self._queue.empty()):
            self._take(pending, 0.25)
            if not pending:
                continue
            try:
                record_sample_errors(self._engine, pending)
            except Unavailable as e:  # the catalog is down or slow: keep them, retry
                if len(pending) > self._max_rows:
                    excess = len(pending) - self._max_rows
                    self.dropped += excess
                    self._settled += excess
                    pending = pending[-self._max_rows :]
                logger.warning(
                    "could not record %d sample errors in the catalog (%s); retrying in %g s",
                    len(pending),
                    e,
                    self._retry_s,
                )
                if self._stop.wait(self._retry_s):
                    self.dropped += len(pending)
                    self._settled += len(pending)
                    return
                continue
            except Exception:  # e.g. the samples were deleted meanwhile: retrying won't help
                logger.exception("dropping %d sample-error records", len(pending))
                self.dropped += len(pending)
            self._settled += len(pending)
            pending = []

    def flush(self, timeout_s: float = 10.0) -> bool:
        """Wait until every queued row is written (tests); False after ``timeout_s``."""
        deadline = time.monotonic() + timeout_s
        while self._settled < self._accepted:
            if time.monotonic() > deadline:
                return False
            time.sleep(0.05)
        return True

    def close(self, timeout_s: float = 5.0) -> None:
        """Write what is queued (for up to ``timeout_s``), then stop. Idempotent."""
        self._stop.set()
        self._thread.join(timeout_s)
