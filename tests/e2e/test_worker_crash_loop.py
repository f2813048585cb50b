"""Decode workers that keep dying before they are ready: replaced with backoff, then a crash
loop that health reports (gRPC health and ``batchd-server healthcheck``) and a metric shows,
sessions failing with a clear Unavailable instead of hanging; and all of it over once
workers can start again. The workers really cannot start: their interpreter refuses the
environment it inherits (an invalid PYTHONHASHSEED), as after a broken install."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest
from sqlalchemy.engine import Engine

from batchd import errors
from batchd_server import metrics
from batchd_server.api.health import check_server
from batchd_server.cli import main as cli_main
from batchd_server.workers import respawn

from chaos_harness import wait_until
from serving import record_dataset, records_loader, serve

# The embedded catalog only: the workers' fate does not depend on the catalog.
pytestmark = pytest.mark.backend("sqlite")


def _metric(name: str) -> float:
    return metrics.REGISTRY.get_sample_value(name) or 0.0


def test_workers_that_cannot_start_are_a_crash_loop_that_health_reports_and_ends(
    engine: Engine,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    record_dataset(engine, tmp_path / "r", n=50)
    url = engine.url.render_as_string(hide_password=False)
    restarts_before = _metric("batchd_worker_restarts_total")
    with serve(url, tmp_path, workers=1, health_interval_s=0.2) as srv:
        with records_loader(srv) as loader:
            assert sum(len(b["sample_id"]) for b in loader) == 50

        monkeypatch.setenv("PYTHONHASHSEED", "not-a-number")  # new interpreters exit at once
        (victim,) = srv.pool.pids()
        os.kill(victim, signal.SIGKILL)
        wait_until(lambda: srv.pool.crash_loop is not None, "the crash loop", 120)
        replaced = _metric("batchd_worker_restarts_total") - restarts_before
        assert replaced >= respawn.CRASH_LOOP_STARTS, "each try counts as a restart"
        assert _metric("batchd_workers_crash_loop") == 1.0

        # Readiness says NOT_SERVING with the reason, and so does the healthcheck command.
        said: list[str] = []

        def reports_crash_loop() -> bool:
            said.append(str(check_server(srv.address)))
            return "crash loop" in said[-1]

        wait_until(reports_crash_loop, "health to report the crash loop", 30)
        assert "NOT_SERVING" in said[-1] and "exit code 1" in said[-1], said[-1]
        capsys.readouterr()
        assert cli_main(["healthcheck", "--target", srv.address]) == 1
        assert "crash loop" in capsys.readouterr().out

        # A session fails at once with the reason, instead of waiting for batches forever.
        with (
            pytest.raises(errors.Unavailable, match="crash loop") as raised,
            records_loader(srv, reconnect_timeout_s=0) as loader,
        ):
            next(iter(loader))
        assert "installed completely" in str(raised.value)

        monkeypatch.delenv("PYTHONHASHSEED")  # the next try starts a worker that lives
        wait_until(lambda: srv.pool.crash_loop is None and srv.pool.alive == 1, "recovery", 60)
        wait_until(lambda: check_server(srv.address) is None, "health to be SERVING", 30)
        assert _metric("batchd_workers_crash_loop") == 0.0
        with records_loader(srv) as loader:
            assert sum(len(b["sample_id"]) for b in loader) == 50
