"""Record samples that failed to decode in ``sample_errors``, one row per (sample, kind)."""

from __future__ import annotations

import logging
from collections.abc import Iterable

import sqlalchemy as sa
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.engine import Engine

from batchd_server.catalog.db import connect, is_postgres
from batchd_server.catalog.schema import sample_errors

__all__ = ["record_sample_errors"]

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
