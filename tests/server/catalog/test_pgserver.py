"""The test run's private Postgres: found where installed, and a clear failure where not."""

from __future__ import annotations

import pytest
import sqlalchemy as sa

import pgserver


def test_missing_postgres_binaries_fail_with_what_to_install(monkeypatch, tmp_path) -> None:
    """With no initdb/pg_ctl anywhere, starting the server says what to install (no skip)."""
    monkeypatch.setenv("BATCHD_PG_BIN", str(tmp_path))  # an empty directory
    monkeypatch.setenv("PATH", str(tmp_path))
    monkeypatch.setattr(pgserver.glob, "glob", lambda pattern: [])

    with pytest.raises(pgserver.PostgresUnavailable) as excinfo:
        pgserver.ThrowawayPostgres.start()

    message = str(excinfo.value)
    assert "apt-get install postgresql" in message
    assert "BATCHD_TEST_DATABASE_URL" in message


def test_the_suite_runs_on_a_real_postgres_server(pg_admin_url: str) -> None:
    """The catalog tests' Postgres is a real server answering SQL, not a stand-in."""
    engine = sa.create_engine(pg_admin_url)
    try:
        with engine.connect() as conn:
            version = conn.execute(sa.text("SHOW server_version_num")).scalar_one()
    finally:
        engine.dispose()
    assert int(version) >= 120000
