"""Record samples that failed to decode in ``sample_errors``, one row per (sample, kind)."""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Iterable
from typing import Final

import sqlalchemy as sa
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.engine import Engine

from batchd_server.catalog.db import connect, is_postgres
from batchd_server.catalog.schema import sample_errors
from batchd_server.errors import Unavailable

__all__ = ["MAX_QUEUED_ROWS", "SampleErrorWriter", "record_sample_errors"]

logger = logging.getLogger(__name__)

_MAX_MESSAGE_CHARS = 2000
MAX_QUEUED_ROWS: Final = 10_000
"""Sample-error rows a server keeps while the catalog cannot take them; beyond, the oldest
are dropped."""
_WRITE_ROWS: Final = 1000
"""Rows written in one statement at most."""
_WARN_EVERY_S: Final = 60.0
"""Dropped rows are logged at most this often (with the running count)."""


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
    """Writes sample-error rows from a queue bounded in rows, on a thread of its own.

    A stream that meets a bad sample only enqueues its rows (:meth:`submit` never blocks),
    so a slow or unreachable catalog never stalls a batch. Rows that cannot be written are
    kept and retried every ``retry_s``. At most ``max_rows`` rows are kept, however they
    were submitted (one batch may bring thousands): beyond that the oldest are dropped,
    counted in :attr:`dropped` and logged (every failure is also in the server's log).

    Args:
        engine: The catalog.
        max_rows: Rows kept at most, those being written included.
        retry_s: Seconds between tries while the catalog refuses them.
    """

    def __init__(
        self, engine: Engine, *, max_rows: int = MAX_QUEUED_ROWS, retry_s: float = 5.0
    ) -> None:
        if max_rows < 1:
            raise ValueError(f"max_rows={max_rows} must be >= 1")
        self._engine = engine
        self._max_rows = max_rows
        self._retry_s = retry_s
        self._cond = threading.Condition()
        self._rows: deque[tuple[int, str, str]] = deque()
        """Rows waiting, oldest first (those being written are out of it, in ``_writing``)."""
        self._writing = 0
        self._stop = threading.Event()
        self.dropped = 0
        """Rows given up on: the oldest beyond ``max_rows``, those the catalog rejected for
        good, and those still waiting at :meth:`close`."""
        self._accepted = 0
        self._settled = 0
        """Accepted rows written or dropped since; :meth:`flush` waits for all."""
        self._warned_at: float | None = None
        self._thread = threading.Thread(target=self._run, name="batchd-sample-errors", daemon=True)
        self._thread.start()

    def submit(self, rows: list[tuple[int, str, str]]) -> None:
        """Queue ``rows`` for writing; drops the oldest rows (counted) beyond ``max_rows``."""
        if not rows:
            return
        with self._cond:
            self._rows.extend(rows)
            self._accepted += len(rows)
            self._drop_oldest(len(self._rows) + self._writing - self._max_rows)
            self._cond.notify_all()

    def _drop_oldest(self, count: int) -> None:
        """Drop up to ``count`` waiting rows, oldest first (the lock held)."""
        count = min(count, len(self._rows))
        if count <= 0:
            return
        for _ in range(count):
            self._rows.popleft()
        self._give_up(count)
        now = time.monotonic()
        if self._warned_at is None or now - self._warned_at >= _WARN_EVERY_S:
            self._warned_at = now
            logger.warning(
                "sample-error queue full (%d rows): dropped the oldest %d rows; %d not recorded "
                "in the catalog so far (is it reachable?)",
                self._max_rows,
                count,
                self.dropped,
            )

    def _give_up(self, count: int) -> None:
        self.dropped += count
        self._settled += count
        self._cond.notify_all()

    def _take(self, timeout_s: float) -> list[tuple[int, str, str]]:
        """The oldest waiting rows (at most a write's worth), now being written."""
        with self._cond:
            if not self._rows and not self._stop.is_set():
                self._cond.wait(timeout_s)
            count = min(len(self._rows), _WRITE_ROWS, self._max_rows)
            taken = [self._rows.popleft() for _ in range(count)]
            self._writing = count
            return taken

    def _settle(self, rows: list[tuple[int, str, str]], *, written: bool) -> None:
        with self._cond:
            self._writing = 0
            if written:
                self._settled += len(rows)
                self._cond.notify_all()
            else:
                self._give_up(len(rows))

    def _put_back(self, rows: list[tuple[int, str, str]]) -> None:
        """Rows the catalog refused for now: first in line again, the oldest beyond
        ``max_rows`` dropped."""
        with self._cond:
            self._writing = 0
            self._rows.extendleft(reversed(rows))
            self._drop_oldest(len(self._rows) - self._max_rows)

    def _run(self) -> None:
        while True:
            rows = self._take(0.25)
            if not rows:
                if self._stop.is_set():
                    return
                continue
            try:
                record_sample_errors(self._engine, rows)
            except Unavailable as e:  # the catalog is down or slow: keep them, retry
                self._put_back(rows)
                logger.warning(
                    "could not record %d sample errors in the catalog (%s); retrying in %g s",
                    len(rows),
                    e,
                    self._retry_s,
                )
                if self._stop.wait(self._retry_s):
                    with self._cond:
                        self._drop_oldest(len(self._rows))
                    return
                continue
            except Exception:  # e.g. the samples were deleted meanwhile: retrying won't help
                logger.exception("dropping %d sample-error records", len(rows))
                self._settle(rows, written=False)
                continue
            self._settle(rows, written=True)

    def flush(self, timeout_s: float = 10.0) -> bool:
        """Wait until every queued row is written or dropped (tests); False after
        ``timeout_s``."""
        with self._cond:
            return self._cond.wait_for(lambda: self._settled >= self._accepted, timeout_s)

    def close(self, timeout_s: float = 5.0) -> None:
        """Write what is queued (for up to ``timeout_s``), then stop. Idempotent."""
        self._stop.set()
        with self._cond:
            self._cond.notify_all()
        self._thread.join(timeout_s)
