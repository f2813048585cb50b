"""Fixtures shared by every test: a real Postgres and the embedded SQLite catalog.

Catalog tests take the ``engine`` fixture, which is parametrized over both backends, so each
such test runs once on Postgres and once on SQLite; a test marked ``backend("sqlite")`` (or
``"postgres"``) runs on that one only. With ``BATCHD_TEST_DATABASE_URL`` unset
the run starts its own Postgres (see ``tests/pgserver.py``); without Postgres binaries it
fails and says what to install. It never skips.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator

import pytest
import sqlalchemy as sa
from sqlalchemy.engine import Engine, make_url

from batchd_server.catalog import migrate
from batchd_server.catalog.db import make_engine

from pgserver import PostgresUnavailable, ThrowawayPostgres
from serving import batchd_segments

BACKENDS = ("postgres", "sqlite")


_SHM_BEFORE = pytest.StashKey[set[str]]()


def _is_xdist_worker(config: pytest.Config) -> bool:
    return hasattr(config, "workerinput")


def pytest_sessionstart(session: pytest.Session) -> None:
    """Note the batchd entries in /dev/shm before the run. With pytest-xdist only the
    controller looks: a worker would see its sibling's live segments."""
    if not _is_xdist_worker(session.config):
        session.config.stash[_SHM_BEFORE] = set(batchd_segments())


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    """After the whole run (every xdist worker done), /dev/shm holds no batchd entry that was
    not there before it; a leak fails the run."""
    before = session.config.stash.get(_SHM_BEFORE, None)
    if before is None:
        return
    left = sorted(set(batchd_segments()) - before)
    if left:
        session.config.stash[_SHM_LEFT] = left
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


_SHM_LEFT = pytest.StashKey[list[str]]()


@pytest.fixture(scope="session")
def pg_admin_url() -> Iterator[str]:
    """URL of a Postgres database in which the tests may create and drop databases."""
    given = os.environ.get("BATCHD_TEST_DATABASE_URL")
    if given:
        yield given
        return
    try:
        server = ThrowawayPostgres.start()
    except PostgresUnavailable as e:
        pytest.fail(str(e), pytrace=False)
    try:
        yield server.url("postgres")
    finally:
        server.stop()


@pytest.fixture
def pg_url(pg_admin_url: str) -> Iterator[str]:
    """A fresh, empty Postgres database for one test, dropped afterwards."""
    name = f"batchd_test_{uuid.uuid4().hex[:12]}"
    admin = sa.create_engine(pg_admin_url, isolation_level="AUTOCOMMIT")
    try:
        with admin.connect() as conn:
            conn.execute(sa.text(f'CREATE DATABASE "{name}"'))
        yield make_url(pg_admin_url).set(database=name).render_as_string(hide_password=False)
        with admin.connect() as conn:
            conn.execute(sa.text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
    finally:
        admin.dispose()


@pytest.fixture
def sqlite_url(tmp_path) -> str:
    return f"sqlite:///{tmp_path / 'catalog.db'}"


@pytest.fixture(params=BACKENDS)
def catalog_url(request: pytest.FixtureRequest) -> str:
    """An empty catalog database URL (no schema yet), once per backend."""
    fixture = "pg_url" if request.param == "postgres" else "sqlite_url"
    return request.getfixturevalue(fixture)


def _migrated(url: str) -> Iterator[Engine]:
    eng = make_engine(url)
    migrate.upgrade(eng)
    try:
        yield eng
    finally:
        eng.dispose()


@pytest.fixture
def engine(catalog_url: str) -> Iterator[Engine]:
    """An engine on a catalog migrated to head, once per backend."""
    yield from _migrated(catalog_url)


@pytest.fixture
def sqlite_engine(sqlite_url: str) -> Iterator[Engine]:
    """The embedded catalog, migrated: for tests whose subject does not depend on the
    catalog's backend (they override ``engine`` with it)."""
    yield from _migrated(sqlite_url)


@pytest.fixture
def pg_engine(pg_url: str) -> Iterator[Engine]:
    """A migrated Postgres catalog, for tests that need the real server only."""
    yield from _migrated(pg_url)


@pytest.hookimpl(tryfirst=True)
def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    """``@pytest.mark.backend("sqlite")`` (or ``"postgres"``, or ``pytestmark = ...`` for a
    whole file): the test's catalog (``engine``, ``catalog_url``) on that one backend only,
    for a subject that does not depend on the catalog. It parametrizes ``catalog_url``
    directly, which takes precedence over the fixture's own parameters."""
    mark = metafunc.definition.get_closest_marker("backend")
    if mark is None:
        return
    (backend,) = mark.args
    if backend not in BACKENDS:
        raise pytest.UsageError(
            f"{metafunc.definition.nodeid}: backend({backend!r}) is not one of {BACKENDS}"
        )
    if "catalog_url" not in metafunc.fixturenames:
        return  # a file's mark: this test of it has no catalog
    metafunc.definition.add_marker(pytest.mark.parametrize("catalog_url", [backend], indirect=True))


def _cuda_available() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return bool(torch.cuda.is_available())


def _expected_seconds(item: pytest.Item) -> float:
    marker = item.get_closest_marker("slow")
    return float(marker.kwargs.get("seconds", 10)) if marker is not None else 0.0


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """The files of ``slow`` tests run first, longest first (``slow(seconds=N)``), so that on
    two pytest-xdist workers the soak test does not start last and stretch the run; the order
    within a file is kept.

    Tests marked ``gpu`` are deselected, loudly, on machines without CUDA. Set
    BATCHD_TEST_GPU=1 to run them anyway: they then fail, never skip, without a device.
    """
    per_file: dict[str, float] = {}
    for item in items:
        per_file[item.path.as_posix()] = per_file.get(item.path.as_posix(), 0.0) + (
            _expected_seconds(item)
        )
    items.sort(key=lambda item: -per_file[item.path.as_posix()])  # stable: files keep order
    if os.environ.get("BATCHD_TEST_GPU") == "1" or _cuda_available():
        return
    gpu = [item for item in items if item.get_closest_marker("gpu")]
    if gpu:
        items[:] = [item for item in items if not item.get_closest_marker("gpu")]
        config.hook.pytest_deselected(items=gpu)
        config.stash[_GPU_DESELECTED] = len(gpu)


_GPU_DESELECTED = pytest.StashKey[int]()


def pytest_terminal_summary(terminalreporter, exitstatus, config: pytest.Config) -> None:  # type: ignore[no-untyped-def]
    left = config.stash.get(_SHM_LEFT, None)
    if left:
        terminalreporter.write_line(
            f"FAILED: the tests left shared memory behind in /dev/shm: {left}", red=True
        )
    n = config.stash.get(_GPU_DESELECTED, 0)
    if n:
        terminalreporter.write_line(
            f"{n} gpu-marked tests deselected: no CUDA device here "
            "(run them on a CUDA machine, or force with BATCHD_TEST_GPU=1)"
        )
