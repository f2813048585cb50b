"""bench/object_store.py reports the loader's own CPU per sample, cold and warm, against
local files, and counts the server's workers that exited within an epoch."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "bench"


@pytest.fixture(autouse=True)
def _bench_on_path(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.syspath_prepend(str(BENCH))


def _config(label: str, family: str, state: str, loader_cpu_s: float, store_cpu_s: float):
    from _common import Contender, Run
    from _objstore_runs import Config

    contender = Contender(label, family, None, None)
    contender.runs.append(Run(1000, 16, 1.0, 0.01, loader_cpu_s))
    config = Config(label, family, state, 20.0, contender)
    config.fetched_bytes.append(86_000_000)
    config.requests.append(34)
    config.request_types.append({"GET": 34})
    config.store_cpu_s.append(store_cpu_s)
    return config


def test_loader_cpu_per_sample_against_local_files() -> None:
    from _objstore_runs import loader_cpu_table, results_table

    local = _config("batchd, local files", "batchd files", "local", 1.0, 0.0)
    parquet_local = _config("batchd, Parquet, local files", "batchd Parquet", "local", 1.25, 0.0)
    tar_cold = _config("batchd, tar cold, 20 ms", "batchd tar", "cold", 1.5, 0.2)
    parquet_cold = _config("batchd, Parquet cold, 20 ms", "batchd Parquet", "cold", 1.5, 0.1)
    tar_warm = _config("batchd, tar warm, 20 ms", "batchd tar", "warm", 1.1, 0.0)
    configs = [local, parquet_local, tar_cold, parquet_cold, tar_warm]

    rows = {
        line.split("|")[1].strip(): [c.strip() for c in line.split("|")[2:-1]]
        for line in loader_cpu_table(configs, local).splitlines()[2:]
    }
    # ms per sample, over local files, over the same layout on the local disk, the store's.
    assert rows["batchd, tar cold, 20 ms"] == ["1.50", "1.50x", "", "0.20"]
    assert rows["batchd, Parquet cold, 20 ms"] == ["1.50", "1.50x", "1.20x", "0.10"]
    assert rows["batchd, tar warm, 20 ms"] == ["1.10", "1.10x", "", "0.00"]
    assert rows["**batchd, local files**"] == ["1.00", "1.00x", "", "-"]

    table = results_table(configs, local)
    assert "loader CPU ms/sample" in table and "store+proxy CPU ms/sample" in table


def test_server_cpu_counts_workers_that_exited() -> None:
    """A worker replaced within an epoch still counts: its CPU moves to the server's
    ``cutime`` once the server waits for it, which live descendants alone would miss."""
    from _common import ServerProcess, pids_cpu_s

    burn = "x = 0\nfor i in range(3_000_000): x += i"
    parent = (
        "import subprocess, sys\n"
        f"subprocess.run([sys.executable, '-c', {burn!r}], check=True)\n"
        "print('reaped', flush=True)\n"
        "sys.stdin.read()\n"
    )
    process = subprocess.Popen(
        [sys.executable, "-c", parent], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    try:
        assert process.stdout is not None
        assert process.stdout.readline().strip() == "reaped"
        server = ServerProcess(process, "unix:///nowhere")  # type: ignore[arg-type]
        own = pids_cpu_s([process.pid])
        assert server.cpu_s() - own >= 0.05  # the exited child's loop, not the parent's
    finally:
        assert process.stdin is not None
        process.stdin.close()
        process.wait(30)
