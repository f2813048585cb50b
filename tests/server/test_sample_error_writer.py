"""Sample-error records go through a bounded queue: a catalog that cannot take them never
blocks the caller, they are retried, and the overflow is dropped and counted."""

from __future__ import annotations

import time
from pathlib import Path

import sqlalchemy as sa

from batchd_server.catalog import migrate
from batchd_server.catalog.db import make_engine
from batchd_server.catalog.sample_errors import SampleErrorWriter
from batchd_server.catalog.schema import sample_errors

from serving import record_dataset


def test_rows_wait_while_the_catalog_refuses_them_and_are_written_once_it_accepts(
    tmp_path: Path,
) -> None:
    """No schema yet: submit returns at once, rows beyond max_rows are dropped and counted;
    once migrated, the kept rows are written."""
    engine = make_engine(f"sqlite:///{tmp_path / 'c.db'}")
    writer = SampleErrorWriter(engine, max_rows=5, retry_s=0.1)
    try:
        started = time.monotonic()
        for sample_id in range(1, 21):
            writer.submit([(sample_id, "missing", "no such file")])
        assert time.monotonic() - started < 1.0
        deadline = time.monotonic() + 30
        while writer.dropped < 15:
            assert time.monotonic() < deadline, f"dropped {writer.dropped}, expected 15"
            time.sleep(0.05)
        migrate.upgrade(engine)
        record_dataset(engine, tmp_path / "r", n=20)
        assert writer.flush(30)
        with engine.connect() as conn:
            written = set(conn.execute(sa.select(sample_errors.c.sample_id)).scalars())
        assert len(written) == 5 and written <= set(range(1, 21))
        assert writer.dropped == 15
    finally:
        writer.close()
        engine.dispose()
