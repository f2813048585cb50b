"""A running server's decode workers never load grpc; the server process itself does.

Workers are started with ``spawn``, which runs the parent's main module again in the child
(as ``__mp_main__``): ``batchd-server``'s console script, ``python -m batchd_server.cli`` or
pytest, as the server was started. So the check runs on a server started each of those ways,
after it served a batch (its one worker has attached a ring and decoded), and looks for
grpc's extension module (``cygrpc``) among each process's mappings.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from sqlalchemy.engine import Engine

import batchd

from chaos_harness import wait_until
from serving import RECORD_FLOATS, batchd_segments, record_dataset, serve

N_RECORDS = 64
GRPC_EXTENSION = "cygrpc"
"""grpc's compiled core (``grpc/_cython/cygrpc.*.so``), mapped once grpc is imported."""
SCRIPT = Path(sys.executable).parent / "batchd-server"
LAUNCHES = {
    "console_script": [str(SCRIPT), "serve"],
    "python_m": [sys.executable, "-m", "batchd_server.cli", "serve"],
}


def stop(proc: subprocess.Popen[bytes]) -> None:
    """SIGTERM, so that the server removes its segments even when the test failed; SIGKILL
    only if it does not exit within a minute."""
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(60)
    finally:
        proc.kill()
        proc.wait(30)


def read_epoch(address: str) -> None:
    """One epoch of the "records" dataset through the server at ``address``."""
    spec = batchd.Array((RECORD_FLOATS,), "float32", raw=True)
    with batchd.Loader(address, dataset="records", batch_size=16, pipeline=spec) as loader:
        assert sum(len(batch["sample_id"]) for batch in loader) == N_RECORDS


def grpc_mappings(pid: int) -> list[str]:
    """The files of grpc's extension module that process ``pid`` maps."""
    with open(f"/proc/{pid}/maps") as maps:
        return sorted({line.split()[-1] for line in maps if GRPC_EXTENSION in line})


def children(pid: int) -> dict[int, str]:
    """Live children of ``pid``, each with its command line."""
    found = {}
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            pids = (task / "children").read_text().split()
        except OSError:
            continue
        for child in map(int, pids):
            try:
                cmdline = Path(f"/proc/{child}/cmdline").read_bytes().replace(b"\0", b" ")
            except OSError:
                continue
            found[child] = cmdline.decode(errors="replace").strip()
    return found


def assert_workers_load_no_grpc(server_pid: int, worker_pids: list[int]) -> None:
    """The server maps grpc (so the check can fail) and no worker does."""
    assert worker_pids, "the server has no decode worker to look at"
    assert grpc_mappings(server_pid), f"the server (pid {server_pid}) has not loaded grpc"
    loaded = {pid: grpc_mappings(pid) for pid in worker_pids}
    assert not any(loaded.values()), (
        "decode workers loaded grpc (python -X importtime in a worker shows who imports it; "
        f"spawn re-runs the server's main module there): {loaded}"
    )


@pytest.mark.parametrize("launch", sorted(LAUNCHES))
def test_a_served_servers_worker_has_no_grpc_however_the_server_was_started(
    launch: str, sqlite_engine: Engine, tmp_path: Path
) -> None:
    """``batchd-server serve`` and ``python -m batchd_server.cli serve``: after a served
    epoch, the worker process maps no cygrpc while the server process does."""
    if not SCRIPT.exists():
        pytest.fail(f"{SCRIPT} is missing: install the server (pip install -e server)")
    record_dataset(sqlite_engine, tmp_path / "r", n=N_RECORDS)
    sock, log = tmp_path / "batchd.sock", tmp_path / "server.log"
    env = {
        **os.environ,
        "BATCHD_DATABASE_URL": sqlite_engine.url.render_as_string(hide_password=False),
        "BATCHD_LISTEN": f"unix://{sock}",
        "BATCHD_WORKERS": "1",
    }
    with log.open("wb") as out:
        proc = subprocess.Popen(LAUNCHES[launch], env=env, stdout=out, stderr=out)
    instance = ""
    try:

        def ready() -> bool:
            if proc.poll() is not None:
                pytest.fail(f"the server exited {proc.returncode}:\n{log.read_text()}")
            return "ready: serving on" in log.read_text()

        wait_until(ready, "the server to be ready", 120)
        instance = log.read_text().split("segments batchd-", 1)[1].split("-*", 1)[0]
        read_epoch(f"unix://{sock}")
        spawned = {pid: cmd for pid, cmd in children(proc.pid).items() if "spawn_main" in cmd}
        assert len(spawned) == 1, f"expected one decode worker among {children(proc.pid)}"
        assert_workers_load_no_grpc(proc.pid, sorted(spawned))
    finally:
        stop(proc)
    assert proc.returncode == 0, log.read_text()
    assert instance and batchd_segments(instance) == []


def test_an_in_process_servers_worker_has_no_grpc(sqlite_engine: Engine, tmp_path: Path) -> None:
    """A server built in this (pytest) process, as most tests do: after a served epoch its
    worker maps no cygrpc while this process does."""
    record_dataset(sqlite_engine, tmp_path / "r", n=N_RECORDS)
    url = sqlite_engine.url.render_as_string(hide_password=False)
    with serve(url, tmp_path, workers=1) as server:
        read_epoch(server.address)
        assert_workers_load_no_grpc(os.getpid(), server.pool.pids())
