"""``batchd-server serve`` with a decode cache, checked from outside: a cache that leaves the
shm budget no room for a session, and a second server on a disk directory another one
holds, stop the server at start with a message that says what to change."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
from sqlalchemy.engine import Engine

pytestmark = pytest.mark.slow(seconds=30)

SERVE = [sys.executable, "-m", "batchd_server.cli", "serve", "--workers", "1"]


def env_of(engine: Engine) -> dict[str, str]:
    return {**os.environ, "BATCHD_DATABASE_URL": engine.url.render_as_string(hide_password=False)}


def test_a_decode_cache_as_large_as_the_shm_budget_stops_the_server_at_start(
    sqlite_engine: Engine, tmp_path: Path
) -> None:
    """A 1 GiB cache in a 1 GiB budget used to start and then refuse every session with
    "1.0 GiB is reserved by 0 segment(s)"; it exits at once, naming the decode cache, what a
    session needs and the two ways out."""
    # On a disk, so the budget is the 1 GiB asked for, not what /dev/shm holds; short, for
    # the doorbell socket's path.
    shm = Path(tempfile.mkdtemp(prefix="bd-shm-"))
    try:
        server = subprocess.Popen(
            [
                *SERVE,
                *("--decode-cache-size", "1GiB", "--shm-budget", "1GiB", "--shm-dir", str(shm)),
                *("--listen", f"unix://{tmp_path}/batchd.sock"),
            ],
            env=env_of(sqlite_engine),
            stderr=subprocess.PIPE,
            text=True,
        )
        assert server.stderr is not None
        lines = []
        for line in server.stderr:
            lines.append(line)
            if "ready: serving on" in line:  # the old behaviour: started, to refuse sessions
                server.send_signal(signal.SIGTERM)
        code = server.wait(60)
        left = sorted(p.name for p in shm.iterdir())
    finally:
        shutil.rmtree(shm, ignore_errors=True)
    stderr = "".join(lines)
    assert code == 2 and "ready:" not in stderr, stderr
    message = " ".join(stderr.split())
    assert (
        "the decode cache (--decode-cache-size) takes 1.0 GiB of the server's shared-memory "
        "budget of 1.0 GiB, which leaves 0 B for the sessions' rings" in message
    ), message
    assert "one session needs 56.0 MiB (--min-free-shm" in message, message
    assert "lower --decode-cache-size to at most 968.0 MiB" in message, message
    assert "raise --shm-budget (BATCHD_SHM_BUDGET) to at least 1.1 GiB" in message, message
    assert left == [], "nothing made before the refusal"


def test_a_second_server_on_a_decode_cache_dir_in_use_is_refused_naming_the_first(
    sqlite_engine: Engine, tmp_path: Path
) -> None:
    cache_dir = tmp_path / "dc"
    cache = ["--decode-cache-size", "64MiB", "--decode-cache-dir", str(cache_dir)]
    first = subprocess.Popen(
        [*SERVE, *cache, "--listen", f"unix://{tmp_path}/first.sock"],
        env=env_of(sqlite_engine),
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert first.stderr is not None
        lines = []
        for line in first.stderr:
            lines.append(line)
            if "ready: serving on" in line:
                break
        else:
            pytest.fail(f"the first server exited {first.wait()}: {''.join(lines)}")
        second = subprocess.run(
            [*SERVE, *cache, "--listen", f"unix://{tmp_path}/second.sock"],
            env=env_of(sqlite_engine),
            capture_output=True,
            text=True,
            timeout=120,
        )
    finally:
        first.send_signal(signal.SIGTERM)
        assert first.wait(60) == 0
    assert second.returncode == 2, second.stderr
    message = " ".join(second.stderr.split())
    assert f"--decode-cache-dir (BATCHD_DECODE_CACHE_DIR) {cache_dir} is in use" in message
    assert f"another batchd server (pid {first.pid}," in message, message
