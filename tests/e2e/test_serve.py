"""``batchd-server serve``: configuration from flags and BATCHD_* variables, one ready line,
a clean stop on SIGTERM, and a clear error for an address that is taken."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from sqlalchemy.engine import Engine

import batchd

from serving import RECORD_FLOATS, batchd_segments, record_dataset

SERVE = [sys.executable, "-m", "batchd_server.cli", "serve"]


def instance_of(ready_line: str) -> str:
    """The shm instance id a ready line names (``segments batchd-<id>-*``)."""
    return ready_line.split("segments batchd-", 1)[1].split("-*", 1)[0]


def _wait_ready(proc: subprocess.Popen[str]) -> list[str]:
    assert proc.stderr is not None
    lines = []
    for line in proc.stderr:
        lines.append(line)
        if "ready: serving on" in line:
            return lines
    pytest.fail(f"serve exited {proc.wait()} without a ready line:\n{''.join(lines)}")


def test_serve_reads_the_environment_logs_ready_once_and_stops_cleanly_on_sigterm(
    engine: Engine, tmp_path: Path
) -> None:
    """Configured only through BATCHD_*; serves a Loader; SIGTERM exits 0 leaving nothing."""
    record_dataset(engine, tmp_path / "r", n=64)
    sock = tmp_path / "batchd.sock"
    env = {
        **os.environ,
        "BATCHD_DATABASE_URL": engine.url.render_as_string(hide_password=False),
        "BATCHD_LISTEN": f"unix://{sock}",
        "BATCHD_WORKERS": "1",
        "BATCHD_SHM_BUDGET": "256MiB",
        "BATCHD_LEASE_TIMEOUT_S": "7",
    }
    proc = subprocess.Popen(SERVE, env=env, stderr=subprocess.PIPE, text=True)
    try:
        lines = _wait_ready(proc)
        ready = [line for line in lines if "ready:" in line]
        assert len(ready) == 1
        assert f"unix://{sock}" in ready[0] and "1 decode workers" in ready[0]
        assert "256.0 MiB" in ready[0] and "lease timeout 7 s" in ready[0]
        spec = batchd.Array((RECORD_FLOATS,), "float32", raw=True)
        with batchd.Loader(
            f"unix://{sock}", dataset="records", batch_size=10, pipeline=spec
        ) as loader:
            assert sum(len(b["sample_id"]) for b in loader) == 64
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 0
    finally:
        proc.kill()
        proc.wait(30)
    assert not sock.exists()
    assert batchd_segments(instance_of(ready[0])) == []


def test_serve_refuses_a_port_that_is_taken(sqlite_url: str, tmp_path: Path) -> None:
    """A TCP port someone holds is an error naming it, not a silent second listener."""
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        done = subprocess.run(
            [*SERVE, "--listen", f"127.0.0.1:{port}", "--workers", "1"],
            env={**os.environ, "BATCHD_DATABASE_URL": sqlite_url},
            capture_output=True,
            text=True,
            timeout=120,
        )
    assert done.returncode == 2, done.stderr
    assert f"port {port} is already in use" in done.stderr
    assert "ready:" not in done.stderr


def test_serve_rejects_bad_settings_with_the_variable_named(sqlite_url: str) -> None:
    """A malformed BATCHD_SHM_BUDGET is an error that names the variable."""
    done = subprocess.run(
        SERVE,
        env={**os.environ, "BATCHD_DATABASE_URL": sqlite_url, "BATCHD_SHM_BUDGET": "lots"},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 2
    assert "BATCHD_SHM_BUDGET='lots'" in done.stderr
