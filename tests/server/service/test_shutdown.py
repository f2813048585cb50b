"""Graceful shutdown of ``batchd-server serve``: SIGTERM mid-epoch ends every stream with an
error the client recognises, removes every segment, and exits 0 within --grace-s."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy.engine import make_url

import batchd
from batchd import errors
from batchd_server.catalog import migrate
from batchd_server.catalog.db import make_engine

from serving import RECORD_FLOATS, batchd_segments, record_dataset

GRACE_S = 10.0
PASSWORD = "s3cret-do-not-log"


class _Lines:
    """The server's stderr, each line parsed as JSON (--log-format json), read on a thread."""

    def __init__(self, proc: subprocess.Popen[str]) -> None:
        self.entries: list[dict[str, Any]] = []
        self.raw: list[str] = []
        self._cond = threading.Condition()
        self._thread = threading.Thread(target=self._read, args=(proc,), daemon=True)
        self._thread.start()

    def _read(self, proc: subprocess.Popen[str]) -> None:
        assert proc.stderr is not None
        for line in proc.stderr:
            with self._cond:
                self.raw.append(line)
                self._cond.notify_all()

    def wait_for(self, prefix: str, timeout_s: float) -> dict[str, Any]:
        deadline = time.monotonic() + timeout_s
        with self._cond:
            while True:
                for line in self.raw:
                    entry = json.loads(line)  # every line: one JSON object
                    if entry["message"].startswith(prefix):
                        return entry
                left = deadline - time.monotonic()
                if left <= 0 or not self._thread.is_alive():
                    pytest.fail(f"no log line {prefix!r}:\n{''.join(self.raw)}")
                self._cond.wait(left)

    def finish(self) -> list[dict[str, Any]]:
        self._thread.join(30)
        return [json.loads(line) for line in self.raw]


def _next_or_error(iterator: Any) -> BaseException | None:
    """Drain ``iterator`` on a thread; the exception it ended with (None: it ended cleanly)."""
    outcome: list[BaseException | None] = []

    def drain() -> None:
        try:
            for _ in iterator:
                pass
            outcome.append(None)
        except BaseException as e:
            outcome.append(e)

    thread = threading.Thread(target=drain, daemon=True)
    thread.start()
    thread.join(60)
    assert not thread.is_alive(), "the client hung after the server stopped"
    return outcome[0]


@pytest.mark.parametrize("transport", ["inline", "shm"])
def test_sigterm_mid_epoch_exits_0_in_the_grace_period_and_the_client_raises_clearly(
    pg_url: str, tmp_path: Path, transport: str
) -> None:
    """Mid-epoch SIGTERM: health NOT_SERVING at once, the open stream ends, exit 0 well
    within --grace-s, no segment left; the client, finding no server to reconnect to within
    its reconnect_timeout_s, raises batchd's Unavailable naming the server, and never hangs.
    The JSON ready line names the version, address, workers, effective shm budget and the
    catalog URL with its password hidden."""
    engine = make_engine(pg_url)
    migrate.upgrade(engine)
    record_dataset(engine, tmp_path / "r", n=3000)
    engine.dispose()
    # The throwaway Postgres trusts local connections, so any password works: this one
    # must never reach the log.
    url = make_url(pg_url).set(password=PASSWORD).render_as_string(hide_password=False)
    sock = tmp_path / "batchd.sock"
    argv = [sys.executable, "-m", "batchd_server.cli", "--log-format", "json", "serve"]
    argv += ["--listen", f"unix://{sock}", "--workers", "1", "--grace-s", str(GRACE_S)]
    argv += ["--metrics-listen", "127.0.0.1:0"]
    env = {**os.environ, "BATCHD_DATABASE_URL": url}
    proc = subprocess.Popen(argv, env=env, stderr=subprocess.PIPE, text=True)
    lines = _Lines(proc)
    try:
        ready = lines.wait_for("ready: serving on", 120)["message"]
        assert f"unix://{sock}" in ready and "(batchd-server 0.1.0)" in ready
        assert "1 decode workers" in ready and "shm budget 1.0 GiB in /dev/shm" in ready
        assert "catalog postgresql+psycopg2://batchd:***@/" in ready and PASSWORD not in ready
        assert "metrics on http://127.0.0.1:" in ready and f"grace {GRACE_S:g} s" in ready
        instance = ready.split("segments batchd-", 1)[1].split("-*", 1)[0]

        spec = batchd.Array((RECORD_FLOATS,), "float32", raw=True)
        loader = batchd.Loader(
            f"unix://{sock}",
            dataset="records",
            batch_size=10,
            pipeline=spec,
            transport=transport,
            prefetch=2,
            reconnect_timeout_s=2,
        )
        iterator = iter(loader)
        for _ in range(3):
            next(iterator)
        assert any("-ring-" in name for name in batchd_segments(instance))

        started = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        code = proc.wait(GRACE_S + 30)
        took = time.monotonic() - started
        error = _next_or_error(iterator)
        loader.close()
    finally:
        proc.kill()
        proc.wait(30)
    entries = lines.finish()
    assert code == 0, "".join(lines.raw)
    assert took < GRACE_S, f"shutdown took {took:.1f} s, more than --grace-s {GRACE_S:g}"
    assert isinstance(error, errors.Unavailable), repr(error)
    assert f"unix://{sock}" in str(error) and "reconnect_timeout_s=2" in str(error), str(error)
    assert batchd_segments(instance) == []
    messages = [e["message"] for e in entries]
    draining = next(i for i, m in enumerate(messages) if m.startswith("health: NOT_SERVING"))
    assert "shutting down" in messages[draining]
    assert messages[-1].startswith("batchd-server stopped in")
    assert not any(PASSWORD in line for line in lines.raw)
