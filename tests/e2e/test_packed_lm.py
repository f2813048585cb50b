"""examples/packed_lm.py on two CPU ranks (torchrun, gloo) over packed batches: a run
interrupted mid-epoch and resumed from its checkpoint has bitwise the loss curve of a run
never interrupted."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from sqlalchemy.engine import Engine

from batchd_server.api import RunningServer

from packing_data import documents_dataset
from serving import serve

pytestmark = [pytest.mark.slow(seconds=60), pytest.mark.timeout(600), pytest.mark.backend("sqlite")]

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "packed_lm.py"


@pytest.fixture
def server(engine: Engine, tmp_path: Path) -> Iterator[RunningServer]:
    documents_dataset(engine, tmp_path / "web", name="web", n=60, seed=3)
    with serve(engine.url.render_as_string(hide_password=False), tmp_path) as srv:
        yield srv


def _train(server: RunningServer, cwd: Path, *args: str) -> None:
    env = {**os.environ, "BATCHD_TARGET": server.address, "PYTHONUNBUFFERED": "1"}
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(name, None)
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node=2",
        str(EXAMPLE),
        "--seq-len=128",
        "--batch-size=2",
        *args,
    ]
    done = subprocess.run(
        command, cwd=cwd, env=env, capture_output=True, text=True, timeout=300, check=False
    )
    assert done.returncode == 0, f"{command} failed:\n{done.stdout[-4000:]}\n{done.stderr[-6000:]}"


def test_a_resumed_packed_run_has_bitwise_the_loss_curve_of_an_uninterrupted_one(
    server: RunningServer, tmp_path: Path
) -> None:
    whole, parts = tmp_path / "whole.txt", tmp_path / "parts.txt"
    _train(server, tmp_path, f"--losses={whole}")
    _train(server, tmp_path, f"--losses={parts}", "--stop-after-steps=4", "--ckpt=ckpt.pt")
    assert len(parts.read_text().splitlines()) == 4
    _train(server, tmp_path, f"--losses={parts}", "--resume=ckpt.pt")
    expected = whole.read_text().splitlines()
    assert len(expected) > 8, "the epoch has steps after the interruption"
    assert parts.read_text().splitlines() == expected
    # The losses are real numbers that move: a curve, not a constant.
    values = [float.fromhex(line.split()[1]) for line in expected]
    assert all(v == v and v > 0 for v in values) and len(set(values)) > 1
