"""Sample-error records go through a bounded queue: a catalog that cannot take them never
blocks the caller, they are retried, and the overflow is dropped and counted."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
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


def test_the_queue_is_bounded_in_rows_and_keeps_the_newest(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """While the writer waits to retry a refused row, 30 batches of 5 rows arrive with
    max_rows=10: at once only 10 rows are kept however they were batched, the 141 oldest are
    dropped and counted (and logged), and once the catalog takes them the 10 written are the
    newest."""
    engine = make_engine(f"sqlite:///{tmp_path / 'c.db'}")
    writer = SampleErrorWriter(engine, max_rows=10, retry_s=2.0)
    try:
        writer.submit([(1, "corrupt", "bad bytes")])
        deadline = time.monotonic() + 30
        while not any("could not record" in r.getMessage() for r in caplog.records):
            assert time.monotonic() < deadline, "the writer never tried the first row"
            time.sleep(0.01)
        for batch in range(30):
            writer.submit([(2 + batch * 5 + i, "corrupt", "bad bytes") for i in range(5)])
        assert writer.dropped == 141
        assert any("dropped the oldest" in r.getMessage() for r in caplog.records)
        migrate.upgrade(engine)
        record_dataset(engine, tmp_path / "r", n=151)
        assert writer.flush(30)
        with engine.connect() as conn:
            written = set(conn.execute(sa.select(sample_errors.c.sample_id)).scalars())
        assert written == set(range(142, 152))
        assert writer.dropped == 141
    finally:
        writer.close()
        engine.dispose()
