"""The catalog database going away: new sessions fail fast with Unavailable naming where the
database is (never its password), open sessions finish their epoch, sample errors wait in a
queue, and when the database is back everything works without a server restart."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import sqlalchemy as sa
from sqlalchemy.engine import make_url

import batchd
from batchd import errors
from batchd_server.api import RunningServer
from batchd_server.catalog import migrate
from batchd_server.catalog.db import make_engine
from batchd_server.catalog.schema import sample_errors

from pgserver import PostgresUnavailable, ThrowawayPostgres
from serving import RECORD_FLOATS, record_dataset, serve

PASSWORD = "hunter2-never-shown"


@pytest.fixture
def own_postgres() -> Iterator[ThrowawayPostgres]:
    """A Postgres of this test's own, so that stopping it disturbs no other test."""
    try:
        server = ThrowawayPostgres.start()
    except PostgresUnavailable as e:
        pytest.fail(str(e), pytrace=False)
    try:
        yield server
    finally:
        server.stop()


def _records(server: RunningServer, **kwargs: object) -> batchd.Loader:
    return batchd.Loader(
        server.address,
        dataset="records",
        batch_size=10,
        shuffle=False,
        prefetch=2,
        device="cpu",
        max_error_fraction=0.05,
        pipeline=batchd.Array((RECORD_FLOATS,), "float32", raw=True),
        **kwargs,  # type: ignore[arg-type]
    )


def _recorded(url: str) -> set[int]:
    engine = make_engine(url)
    try:
        with engine.connect() as conn:
            return set(conn.execute(sa.select(sample_errors.c.sample_id)).scalars())
    finally:
        engine.dispose()


def test_a_stopped_catalog_fails_new_sessions_fast_and_open_sessions_finish(
    own_postgres: ThrowawayPostgres, tmp_path: Path
) -> None:
    """Postgres stopped mid-epoch: a new Loader gets Unavailable within seconds naming the
    database's socket directory and not the password; the open Loader's epoch completes,
    each sample once, its bad sample's record waiting; Postgres back: a new Loader works and
    the record is written, with no server restart."""
    # Trust authentication accepts any password: the URL carries one to prove it stays hidden.
    url = make_url(own_postgres.url("postgres")).set(password=PASSWORD)
    url_text = url.render_as_string(hide_password=False)
    engine = make_engine(url_text)
    migrate.upgrade(engine)
    record_dataset(engine, tmp_path / "r", n=200, bad={150: "missing"})
    with engine.connect() as conn:
        ids = conn.execute(sa.text("SELECT id FROM samples ORDER BY id")).scalars().all()
    engine.dispose()
    with serve(url_text, tmp_path) as srv:
        with _records(srv) as loader:
            it = iter(loader)
            got = next(it)["sample_id"].tolist()
            own_postgres.pause()
            started = time.monotonic()
            with pytest.raises(errors.Unavailable) as caught:
                _records(srv)
            assert time.monotonic() - started < 10
            message = str(caught.value)
            assert str(own_postgres.sockdir) in message and PASSWORD not in message
            got += [i for batch in it for i in batch["sample_id"].tolist()]
        assert got == [i for i in ids if i != ids[150]]
        own_postgres.resume()
        with _records(srv) as again:
            assert sum(len(b["sample_id"]) for b in again) == 199
        deadline = time.monotonic() + 60
        while ids[150] not in _recorded(url_text):
            assert time.monotonic() < deadline, "the queued sample error was never written"
            time.sleep(0.2)
