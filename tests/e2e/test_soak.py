"""Soak: four training clients (two shm, two inline) stream for about two minutes while they
are killed with SIGKILL and started again at random (seeded), and the server is killed -9
and restarted once on the same socket. Every epoch a client completed holds each sample
exactly once, in order; afterwards the server's memory, open files and /dev/shm usage are
back to what they were after a warm-up, and nothing is left behind. Real server and client
processes, real signals, Postgres, /dev/shm. Bounded to about three minutes."""

from __future__ import annotations

import random
import shutil
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import sqlalchemy as sa

from batchd_server.catalog import migrate
from batchd_server.catalog.db import make_engine

from chaos_harness import (
    ClientFleet,
    ServerProcess,
    alive,
    process_stats,
    shm_entries,
    tally,
    wait_until,
)
from serving import SHM, record_dataset

pytestmark = [pytest.mark.slow(seconds=125), pytest.mark.timeout(420)]

SEED = 20240612
TRANSPORTS = ["shm", "shm", "inline", "inline"]
PHASE_S = (45.0, 60.0)
"""Chaos before the server restart is measured (same process), then with the restart."""
MiB = 1 << 20


@pytest.fixture
def workdir() -> Iterator[Path]:
    """A short directory (unix socket paths have at most 107 bytes)."""
    path = Path(tempfile.mkdtemp(prefix="batchd-soak-"))
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


def _split_ids(url: str) -> set[int]:
    engine = make_engine(url)
    try:
        with engine.connect() as conn:
            return set(conn.scalars(sa.text("SELECT id FROM samples WHERE split = 'train'")))
    finally:
        engine.dispose()


def _quiet(server: ServerProcess) -> dict[str, int]:
    """Once no ring is left (clients closed or their leases expired): the server's and its
    workers' resident memory, the server's open fds and threads, the instance's shm bytes."""
    wait_until(
        lambda: not any("-ring-" in n for n in shm_entries(SHM, server.instance)),
        "every ring to be freed",
        timeout_s=60,
    )
    stats = process_stats(server.pid)
    workers = server.worker_pids()
    return {
        **stats,
        "workers_rss": sum(process_stats(pid)["rss"] for pid in workers),
        "workers": len(workers),
        "shm_bytes": sum(shm_entries(SHM, server.instance).values()),
    }


def _chaos(fleet: ClientFleet, rng: random.Random, seconds: float, server: ServerProcess | None):
    """Kill a random client every 1-4 s for ``seconds``; with ``server``, kill -9 it a third
    of the way in and start it again on the same socket."""
    fleet.start_all()
    started = time.monotonic()
    restart_at = started + seconds / 3 if server is not None else None
    while time.monotonic() - started < seconds:
        time.sleep(rng.uniform(1.0, 4.0))  # the fault schedule, not a synchronisation
        assert not fleet.failed(), fleet.failed()
        if restart_at is not None and server is not None and time.monotonic() >= restart_at:
            server.kill9()
            server.start()
            restart_at = None
        fleet.kill(rng.randrange(len(fleet.transports)))
    fleet.finish(timeout_s=180)


def _assert_back(name: str, now: dict[str, int], base: dict[str, int]) -> None:

    def problem(key: str, slack: int) -> str | None:
        if now[key] <= base[key] + slack:
            return None
        return f"{key} {base[key]} -> {now[key]} (allowed +{slack})"

    found = [
        problem("rss", max(48 * MiB, base["rss"] // 4)),
        problem("workers_rss", max(64 * MiB, base["workers_rss"] // 4)),
        problem("fds", 8),
        problem("threads", 24),
        problem("shm_bytes", 0),
        problem("workers", 0),
    ]
    found = [f for f in found if f is not None]
    assert not found, f"{name}: not back to the warm-up baseline: {'; '.join(found)}"


def test_clients_killed_at_random_and_a_server_restart_lose_nothing_and_leak_nothing(
    pg_url: str, workdir: Path
) -> None:
    """The soak described at the top of the module."""
    engine = make_engine(pg_url)
    migrate.upgrade(engine)
    record_dataset(engine, workdir / "records", n=1000)
    engine.dispose()
    split = _split_ids(pg_url)
    rng = random.Random(SEED)
    server = ServerProcess(pg_url, workdir / "grpc.sock", workdir, workers=2, lease_timeout_s=3)
    fleets = [
        ClientFleet(server.target, workdir / name, TRANSPORTS, seed=SEED)
        for name in ("warm-up", "phase-1", "phase-2")
    ]
    for fleet in fleets:
        fleet.workdir.mkdir()
    first = server.start()
    try:
        warm = fleets[0]
        warm.start_all()
        wait_until(
            lambda: all(tally([warm.log(i)], split).epochs >= 1 for i in range(4)),
            "an epoch of each client",
            timeout_s=120,
        )
        warm.finish(timeout_s=120)
        baseline = _quiet(server)

        _chaos(fleets[1], rng, PHASE_S[0], None)
        _assert_back("the same server after clients were killed", _quiet(server), baseline)

        _chaos(fleets[2], rng, PHASE_S[1], server)
        assert server.starts == 2 and server.instance != first
        assert shm_entries(SHM, first) == {}, "the restarted server sweeps the killed one's"
        _assert_back("the restarted server", _quiet(server), baseline)
        assert server.stop() == 0, server.log_text()[-4000:]
    finally:
        for fleet in fleets:
            fleet.stop_file.touch()
            for process in fleet.processes:
                if process is not None and process.poll() is None:
                    process.kill()
                    process.wait(30)
        server.stop()
    assert shm_entries(SHM, server.instance) == {} and shm_entries(SHM, first) == {}
    wait_until(lambda: not alive(server.spawned), "the servers' workers to exit", 30)
    assert not alive(fleet_pid for f in fleets for fleet_pid in f.spawned)

    result = tally([f.log(i) for f in fleets[1:] for i in range(4)], split)
    kills = sum(f.kills for f in fleets)
    assert kills >= 20, f"only {kills} clients were killed"
    assert not result.problems, result.problems
    assert result.epochs >= 8, f"only {result.epochs} epochs completed"
    assert result.resumed >= 10, f"only {result.resumed} epochs were resumed after a kill"
    assert (result.lost, result.duplicated) == (0, 0), result
    assert result.samples == result.epochs * len(split)
