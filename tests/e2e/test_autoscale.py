"""``--workers 1..2`` through a served epoch: the pool grows while a trainer stalls on decode
work, every epoch still exactly once, and shrinks back when the trainer is gone.

The policy's thresholds are loosened here (no idle core asked for, short windows): the test
runs beside other tests on a busy machine, and what it checks is the mechanism (signals →
size → workers serving), not this machine's spare CPU; the rules themselves are tested
signal by signal in ``tests/server/workers/test_worker_sizing.py``."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import batchd
from batchd_server import metrics
from batchd_server.workers.sizing import ScalingPolicy, WorkerRange

from chaos_harness import wait_until
from serving import image_dataset, serve

EAGER = ScalingPolicy(
    tick_s=0.05, grow_window_s=0.3, shrink_window_s=1.0, stall_ratio=0.0, idle_cores=0.0
)


TRAIN = 32
"""Of 40 demo images, 80% are in the train split."""


def _scalings(direction: str, reason: str) -> float:
    value = metrics.REGISTRY.get_sample_value(
        "batchd_worker_scaling_total", {"direction": direction, "reason": reason}
    )
    return value or 0.0


def test_a_range_of_workers_grows_under_decode_load_and_shrinks_when_idle(
    engine: Any, tmp_path: Path
) -> None:
    image_dataset(engine, tmp_path / "images", n=40)
    url = engine.url.render_as_string(hide_password=False)
    up, down = _scalings("up", "stall"), _scalings("down", "idle")
    with serve(url, tmp_path, workers=WorkerRange(1, 2)) as server:
        scaler = server.parts.autoscaler
        assert scaler is not None and server.pool.size == 1
        scaler.policy = EAGER
        epochs = 0
        with batchd.Loader(
            server.address,
            dataset="images",
            batch_size=4,
            pipeline=batchd.Image(size=224),
            shuffle=True,
        ) as loader:
            while server.pool.size < 2 and epochs < 40:
                ids = [i for batch in loader for i in batch["sample_id"].tolist()]
                assert len(ids) == len(set(ids)) == TRAIN, f"epoch {epochs}: {sorted(ids)}"
                epochs += 1
            assert server.pool.size == 2, f"no growth after {epochs} epochs of decode load"
            wait_until(lambda: len(server.pool.pids()) == 2, "the second worker", 60)
            # The grown pool serves: a whole epoch once more, exactly once.
            ids = [i for batch in loader for i in batch["sample_id"].tolist()]
            assert len(ids) == len(set(ids)) == TRAIN
        wait_until(lambda: server.pool.size == 1, "the pool to shrink once idle", 60)
        wait_until(lambda: len(server.pool.pids()) == 1, "the spare worker to retire", 60)
        # Health expects the size the autoscaler chose, not MAX: a shrunk pool is not a
        # dead worker.
        assert "workers" not in server.monitor.evaluate().checks
    assert _scalings("up", "stall") > up and _scalings("down", "idle") > down
