"""One slow catalog query holds up only its own OpenSession: no lock of the server is held
across database I/O, so another dataset's session opens and streams meanwhile.

The slow query is a real one, blocked inside Postgres: the server connects as a role that
row-level security applies to, and a policy on ``samples`` makes every row of one dataset
wait for an advisory lock the test holds. Rows of other datasets never look at it."""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
import sqlalchemy as sa
from sqlalchemy.engine import Engine

import batchd
from batchd_server.catalog import migrate
from batchd_server.catalog.db import make_engine

from serving import RECORD_FLOATS, record_dataset, serve

GATE = 4242
"""The advisory lock the slow dataset's rows wait for."""


@pytest.fixture
def admin(pg_url: str) -> Iterator[Engine]:
    """A superuser engine on a fresh, migrated Postgres catalog."""
    engine = make_engine(pg_url)
    migrate.upgrade(engine)
    try:
        yield engine
    finally:
        engine.dispose()


@pytest.fixture
def role(admin: Engine) -> Iterator[str]:
    """A login role's name (roles outlive databases: it is dropped again afterwards)."""
    name = f"batchd_gated_{uuid.uuid4().hex[:8]}"
    try:
        yield name
    finally:
        with admin.begin() as conn:
            if conn.execute(
                sa.text("SELECT 1 FROM pg_roles WHERE rolname = :r"), {"r": name}
            ).first():
                conn.execute(sa.text(f"DROP OWNED BY {name}"))
                conn.execute(sa.text(f"DROP ROLE {name}"))


def _gate_one_dataset(admin: Engine, role: str, dataset_id: int) -> str:
    """Let ``role`` use the catalog, with every read of ``dataset_id``'s sample rows waiting
    for the advisory lock ``GATE``; the role's URL."""
    with admin.begin() as conn:
        for statement in (
            f"CREATE ROLE {role} LOGIN",
            f"GRANT USAGE ON SCHEMA public TO {role}",
            f"GRANT SELECT, INSERT, UPDATE, DELETE ON ALL TABLES IN SCHEMA public TO {role}",
            f"GRANT USAGE, SELECT ON ALL SEQUENCES IN SCHEMA public TO {role}",
            "CREATE FUNCTION batchd_test_gate() RETURNS boolean LANGUAGE plpgsql VOLATILE AS "
            f"$$ BEGIN PERFORM pg_advisory_lock_shared({GATE}); "
            f"PERFORM pg_advisory_unlock_shared({GATE}); RETURN true; END $$",
            "ALTER TABLE samples ENABLE ROW LEVEL SECURITY",
            "CREATE POLICY batchd_test_gate ON samples "
            f"USING (dataset_id <> {dataset_id} OR batchd_test_gate())",
        ):
            conn.execute(sa.text(statement))
    return admin.url.set(username=role).render_as_string(hide_password=False)


def _open_and_read(address: str, dataset: str, out: list[object]) -> None:
    try:
        with batchd.Loader(
            address,
            dataset=dataset,
            batch_size=16,
            pipeline=batchd.Array((RECORD_FLOATS,), "float32", raw=True),
        ) as loader:
            out.append(sum(len(b["sample_id"]) for b in loader))
    except BaseException as e:
        out.append(e)


def test_a_blocked_catalog_query_does_not_hold_up_another_datasets_open(
    admin: Engine, role: str, tmp_path: Path
) -> None:
    """The open of "slow" waits in Postgres for a lock the test holds; meanwhile "fast" opens
    and serves its whole epoch; released, "slow" opens and serves too."""
    record_dataset(admin, tmp_path / "slow", n=60, name="slow")
    record_dataset(admin, tmp_path / "fast", n=60, name="fast")
    with admin.connect() as conn:
        slow_id = conn.execute(sa.text("SELECT id FROM datasets WHERE name = 'slow'")).scalar_one()
    url = _gate_one_dataset(admin, role, slow_id)
    holder = admin.connect()
    try:
        holder.execute(sa.text(f"SELECT pg_advisory_lock({GATE})"))
        with serve(url, tmp_path) as srv:
            slow: list[object] = []
            opener = threading.Thread(target=_open_and_read, args=(srv.address, "slow", slow))
            opener.start()
            try:
                deadline = time.monotonic() + 60
                while not _waiting_on_the_gate(admin, role):
                    assert not slow, f"the slow open finished while the gate was shut: {slow}"
                    assert time.monotonic() < deadline, "the slow open never reached the gate"
                    time.sleep(0.05)

                fast: list[object] = []
                _open_and_read(srv.address, "fast", fast)
                assert fast == [60], fast
                assert not slow and _waiting_on_the_gate(admin, role), "slow is still blocked"
            finally:
                holder.execute(sa.text(f"SELECT pg_advisory_unlock({GATE})"))
                opener.join(120)
            assert not opener.is_alive()
            assert slow == [60], slow
    finally:
        holder.close()


def _waiting_on_the_gate(admin: Engine, role: str) -> bool:
    """A backend of ``role`` waits for an advisory lock."""
    with admin.connect() as conn:
        return bool(
            conn.execute(
                sa.text(
                    "SELECT count(*) FROM pg_stat_activity WHERE usename = :r "
                    "AND wait_event_type = 'Lock' AND wait_event = 'advisory'"
                ),
                {"r": role},
            ).scalar_one()
        )
