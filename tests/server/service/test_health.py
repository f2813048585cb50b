"""The gRPC health service: readiness and liveness over real sockets, a real Postgres that
stops and comes back, draining, and the monitor's rules on their own."""

from __future__ import annotations

import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import grpc
import pytest
import sqlalchemy as sa
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import (
    ProtoReflectionDescriptorDatabase,
)

import batchd
from batchd import errors
from batchd_server.api.health import LIVENESS_SERVICE, LOADER_SERVICE, REASON_KEY
from batchd_server.catalog import migrate
from batchd_server.catalog.db import make_engine
from batchd_server.health import HealthMonitor, HealthReport
from batchd_server.shm.space import ShmSpace

from pgserver import ThrowawayPostgres
from serving import RECORD_FLOATS, record_dataset, serve

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING
HEALTHCHECK = [sys.executable, "-m", "batchd_server.cli", "healthcheck"]
FAST = {"health_interval_s": 0.1, "catalog_timeout_s": 1.0}


def check(address: str, service: str = "") -> tuple[int, str]:
    """The status of ``service`` and the reason the server gave (empty when none)."""
    with grpc.insecure_channel(address) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        response, call = stub.Check.with_call(
            health_pb2.HealthCheckRequest(service=service), timeout=10
        )
    reason = next((v for k, v in call.trailing_metadata() or () if k == REASON_KEY), b"")
    return response.status, reason.decode()


def wait_for(condition: Callable[[], bool], timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            pytest.fail(f"timed out after {timeout_s} s waiting for {what}")
        time.sleep(0.05)


def test_a_healthy_server_is_serving_for_readiness_and_liveness(
    sqlite_url: str, tmp_path: Path
) -> None:
    """ "", batchd.v1.Loader and liveness say SERVING; an unknown service is NOT_FOUND;
    reflection is not served unless the operator asks (test_health_abuse.py)."""
    with serve(sqlite_url, tmp_path, workers=1, **FAST) as server:
        for service in ("", LOADER_SERVICE, LIVENESS_SERVICE):
            assert check(server.address, service) == (SERVING, "")
        with pytest.raises(grpc.RpcError) as raised:
            check(server.address, "no.such.Service")
        assert raised.value.code() == grpc.StatusCode.NOT_FOUND
        with (
            grpc.insecure_channel(server.address) as channel,
            pytest.raises(grpc.RpcError) as raised,
        ):
            ProtoReflectionDescriptorDatabase(channel).get_services()
        assert raised.value.code() == grpc.StatusCode.UNIMPLEMENTED


def _pg_ctl(pg: ThrowawayPostgres, action: str) -> None:
    opts = (
        f"-c listen_addresses='' -c unix_socket_directories='{pg.sockdir}' -c fsync=off "
        "-c max_connections=50"
    )
    args = ["pg_ctl", "-D", str(pg.datadir), "-w", "-t", "60"]
    if action == "stop":
        args += ["-m", "fast", "stop"]
    else:
        args += ["-o", opts, "-l", str(pg.workdir / "postgres.log"), "start"]
    done = pg._run(*args)
    assert done.returncode == 0, f"pg_ctl {action}: {done.stderr}"


@pytest.fixture
def own_postgres() -> Iterator[ThrowawayPostgres]:
    """A Postgres of this test's own, which it may stop and start."""
    pg = ThrowawayPostgres.start()
    try:
        yield pg
    finally:
        pg.stop()


def test_health_follows_postgres_down_and_back_without_a_restart(
    own_postgres: ThrowawayPostgres, tmp_path: Path
) -> None:
    """SERVING, then NOT_SERVING with the catalog as the reason when Postgres stops (liveness
    stays SERVING, `healthcheck --target` exits 1 saying so), then SERVING when it is back."""
    admin = sa.create_engine(own_postgres.url("postgres"), isolation_level="AUTOCOMMIT")
    name = f"health_{uuid.uuid4().hex[:8]}"
    with admin.connect() as conn:
        conn.execute(sa.text(f'CREATE DATABASE "{name}"'))
    admin.dispose()
    url = own_postgres.url(name)
    engine = make_engine(url)
    migrate.upgrade(engine)
    engine.dispose()
    with serve(url, tmp_path, workers=1, **FAST) as server:
        target = server.address
        assert check(target, "")[0] == SERVING
        _pg_ctl(own_postgres, "stop")
        wait_for(lambda: check(target, "")[0] == NOT_SERVING, 30, "NOT_SERVING")
        status, reason = check(target, LOADER_SERVICE)
        assert status == NOT_SERVING and "catalog" in reason, reason
        assert "batchd@" not in reason and str(own_postgres.sockdir) not in reason, reason
        assert check(target, LIVENESS_SERVICE)[0] == SERVING, "an unready server is not dead"
        done = subprocess.run(
            [*HEALTHCHECK, "--target", target], capture_output=True, text=True, timeout=60
        )
        assert done.returncode == 1, done
        [line] = done.stdout.splitlines()
        assert line.startswith(f"the server at {target} is NOT_SERVING: ") and "catalog" in line

        _pg_ctl(own_postgres, "start")
        wait_for(lambda: check(target, "")[0] == SERVING, 30, "SERVING again")
        done = subprocess.run(
            [*HEALTHCHECK, "--target", target], capture_output=True, text=True, timeout=60
        )
        assert done.returncode == 0, done
        assert "is SERVING" in done.stdout


def test_a_draining_server_is_not_serving_and_refuses_new_sessions(
    sqlite_url: str, tmp_path: Path
) -> None:
    """After drain(): readiness NOT_SERVING with the reason, liveness SERVING, and a new
    Loader fails with batchd's Unavailable saying the server is shutting down."""
    engine = make_engine(sqlite_url)
    migrate.upgrade(engine)
    record_dataset(engine, tmp_path / "r", n=20)
    engine.dispose()
    with serve(sqlite_url, tmp_path, workers=1, **FAST) as server:
        server.drain()
        status, reason = check(server.address, "")
        assert status == NOT_SERVING and "shutting down" in reason
        assert check(server.address, LIVENESS_SERVICE)[0] == SERVING
        spec = batchd.Array((RECORD_FLOATS,), "float32", raw=True)
        with pytest.raises(errors.Unavailable, match="shutting down"):
            batchd.Loader(server.address, dataset="records", batch_size=4, pipeline=spec)


def test_too_little_free_shm_is_not_serving_with_the_setting_to_change(
    sqlite_url: str, tmp_path: Path
) -> None:
    """With --min-free-shm above what /dev/shm has free, readiness names /dev/shm, the need
    and shm_size / sizeLimit."""
    with serve(sqlite_url, tmp_path, workers=1, min_free_shm_bytes=1 << 50, **FAST) as server:
        status, reason = check(server.address, "")
    assert status == NOT_SERVING
    assert reason.startswith("/dev/shm has ") and "batchd needs 1024.0 TiB" in reason
    assert "shm_size:" in reason and "sizeLimit:" in reason


class _Inputs:
    """What a monitor reads, set by the test."""

    def __init__(self) -> None:
        self.free = 1 << 30
        self.alive = 2
        self.probe_gate = threading.Event()
        self.probe_gate.set()
        self.reports: list[HealthReport] = []
        self.rounds = 0

    def space(self) -> ShmSpace:
        self.rounds += 1  # read once per round of checks
        return ShmSpace(Path("/dev/shm"), 2 << 30, self.free)

    def probe(self) -> None:
        self.probe_gate.wait()

    def monitor(self, *, catalog_timeout_s: float = 5.0) -> HealthMonitor:
        return HealthMonitor(
            space=self.space,
            min_free_shm_bytes=64 << 20,
            catalog_probe=self.probe,
            catalog_timeout_s=catalog_timeout_s,
            workers_wanted=lambda: 2,
            workers_alive=lambda: self.alive,
            dispatcher_alive=lambda: True,
            interval_s=0.05,
            on_change=self.reports.append,
        )


def test_each_status_change_is_published_and_logged_once_with_its_reason(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A dead worker, then too little shm, then both fixed: three changes, three log lines,
    however many rounds ran in between."""
    inputs = _Inputs()
    monitor = inputs.monitor()
    caplog.set_level("INFO", logger="batchd_server.health")
    monitor.start()
    try:
        inputs.alive = 1
        wait_for(lambda: len(inputs.reports) == 2, 10, "the worker problem")
        inputs.free = 1 << 20
        wait_for(lambda: len(inputs.reports) == 3, 10, "the shm problem")
        inputs.alive, inputs.free = 2, 1 << 30
        wait_for(lambda: len(inputs.reports) == 4, 10, "recovery")
        rounds = inputs.rounds
        wait_for(lambda: inputs.rounds >= rounds + 5, 10, "five more rounds")
    finally:
        monitor.stop()
    assert [r.checks for r in inputs.reports] == [
        frozenset(),
        frozenset({"workers"}),
        frozenset({"workers", "shm"}),
        frozenset(),
    ]
    assert "1 of 2 decode workers are alive" in inputs.reports[1].reason
    lines = [r.getMessage() for r in caplog.records if r.name == "batchd_server.health"]
    assert len(lines) == 4, lines
    assert lines[1].startswith("health: NOT_SERVING: 1 of 2 decode workers")
    assert lines[3] == "health: SERVING again"


def test_a_hung_catalog_probe_is_a_failure_and_does_not_stall_the_checks() -> None:
    """A probe stuck past its timeout makes the report NOT_SERVING for the catalog while
    the monitor keeps turning (liveness holds); the answer coming back clears it."""
    inputs = _Inputs()
    monitor = inputs.monitor(catalog_timeout_s=0.2)
    monitor.start()
    try:
        inputs.probe_gate.clear()
        wait_for(lambda: "catalog" in monitor.report.checks, 10, "the hung probe to count")
        assert "has not answered" in monitor.report.reason
        inputs.alive = 1  # other checks still run while the probe hangs
        wait_for(lambda: "workers" in monitor.report.checks, 10, "the worker check")
        assert monitor.live()
        inputs.alive = 2
        inputs.probe_gate.set()
        wait_for(lambda: monitor.report.ready, 10, "recovery")
    finally:
        inputs.probe_gate.set()
        monitor.stop()
