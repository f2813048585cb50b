"""batchd inside training frameworks: torchdata's StatefulDataLoader, Lightning and accelerate
resume a mid-epoch checkpoint at exactly the next batch, on one rank and on two (gloo, CPU).

The examples under ``examples/`` are what the two-rank tests run, as a user would.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
import torch
from sqlalchemy.engine import Engine

import batchd
from batchd_server.api import RunningServer
from batchd_server.catalog import migrate
from batchd_server.catalog.db import make_engine

from serving import RECORD_FLOATS, image_dataset, record_dataset, serve

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
N_RECORDS = 64
IMAGES = 40  # 32 in train: 4 batches of 4 per rank per epoch at 2 ranks


@pytest.fixture
def catalog(sqlite_url: str, tmp_path: Path) -> Iterator[Engine]:
    engine = make_engine(sqlite_url)
    migrate.upgrade(engine)
    record_dataset(engine, tmp_path / "records", n=N_RECORDS)
    image_dataset(engine, tmp_path / "images", n=IMAGES)
    try:
        yield engine
    finally:
        engine.dispose()


@pytest.fixture
def server(catalog: Engine, sqlite_url: str, tmp_path: Path) -> Iterator[RunningServer]:
    with serve(sqlite_url, tmp_path) as srv:
        yield srv


def _records(server: RunningServer, **kwargs: Any) -> batchd.Loader:
    kwargs.setdefault("batch_size", 8)
    return batchd.Loader(
        server.address,
        dataset="records",
        pipeline=batchd.Array((RECORD_FLOATS,), "float32", raw=True),
        device="cpu",
        **kwargs,
    )


def _train_ids(engine: Engine) -> set[int]:
    with engine.connect() as conn:
        rows = conn.scalars(
            sa.text(
                "SELECT s.id FROM samples s JOIN datasets d ON d.id = s.dataset_id "
                "WHERE d.name = 'images' AND s.split = 'train'"
            )
        )
        return set(rows)


def test_stateful_dataloader_over_the_dataset_resumes_mid_epoch_exactly(
    server: RunningServer,
) -> None:
    """StatefulDataLoader(IterableDataset(loader)).state_dict() after 3 batches resumes at 3."""
    from torchdata.stateful_dataloader import StatefulDataLoader

    with _records(server) as loader:
        data = StatefulDataLoader(batchd.IterableDataset(loader), batch_size=None)
        whole = [b["sample_id"].tolist() for b in data]
        assert len(whole) == N_RECORDS // 8
    with _records(server) as loader:
        data = StatefulDataLoader(batchd.IterableDataset(loader), batch_size=None)
        it = iter(data)
        [next(it) for _ in range(3)]
        state = data.state_dict()
    with _records(server) as loader:
        data = StatefulDataLoader(batchd.IterableDataset(loader), batch_size=None)
        data.load_state_dict(state)
        rest = [b["sample_id"].tolist() for b in data]
    assert rest == whole[3:]


class _Recorder:
    """A LightningModule factory that records the sample ids of every training step."""

    @staticmethod
    def module(seen: list[list[int]]) -> Any:
        import lightning.pytorch as pl

        class Model(pl.LightningModule):
            def __init__(self) -> None:
                super().__init__()
                self.linear = torch.nn.Linear(RECORD_FLOATS, 1)

            def training_step(self, batch: dict[str, torch.Tensor], _: int) -> torch.Tensor:
                seen.append(batch["sample_id"].tolist())
                return self.linear(batch["array"] / 1e5).mean()

            def configure_optimizers(self) -> torch.optim.Optimizer:
                return torch.optim.SGD(self.parameters(), lr=0.01)

        return Model()


def _fit(server: RunningServer, form: str, root: Path, resume: Path | None) -> list[list[int]]:
    import lightning.pytorch as pl
    from torchdata.stateful_dataloader import StatefulDataLoader

    seen: list[list[int]] = []
    with _records(server) as loader:
        data: Any = loader
        if form == "StatefulDataLoader":
            data = StatefulDataLoader(batchd.IterableDataset(loader), batch_size=None)
        elif form == "batchd.DataLoader":
            data = batchd.DataLoader(loader)
        elif form == "torch DataLoader":
            data = torch.utils.data.DataLoader(batchd.IterableDataset(loader), batch_size=None)
        checkpoints = pl.callbacks.ModelCheckpoint(
            dirpath=root, filename="{step}", every_n_train_steps=2, save_top_k=-1
        )
        trainer = pl.Trainer(
            accelerator="cpu",
            devices=1,
            max_epochs=2,
            callbacks=[checkpoints],
            default_root_dir=root,
            logger=False,
            enable_progress_bar=False,
            enable_model_summary=False,
        )
        trainer.fit(_Recorder.module(seen), train_dataloaders=data, ckpt_path=resume)
    return seen


@pytest.mark.parametrize("form", ["Loader", "batchd.DataLoader", "StatefulDataLoader"])
def test_lightning_resumes_a_mid_epoch_checkpoint_exactly(
    server: RunningServer, tmp_path: Path, form: str
) -> None:
    """Lightning fed the Loader, or it wrapped in batchd.DataLoader or a StatefulDataLoader,
    resumes step 2 exactly: the resumed run's batches are the rest of the uninterrupted
    run's, both epochs."""
    whole = _fit(server, form, tmp_path / "run", None)
    assert len(whole) == 2 * N_RECORDS // 8
    rest = _fit(server, form, tmp_path / "resumed", tmp_path / "run" / "step=2.ckpt")
    assert rest == whole[2:]


def test_a_plain_torch_dataloader_is_not_resumable_and_lightning_says_so(
    server: RunningServer, tmp_path: Path
) -> None:
    """What the README warns of: a plain DataLoader around the dataset has no state, so the
    checkpoint holds no data position; Lightning warns, and the resumed epoch starts over."""
    from lightning.pytorch.utilities.warnings import PossibleUserWarning

    form = "torch DataLoader"
    whole = _fit(server, form, tmp_path / "run", None)
    with pytest.warns(PossibleUserWarning, match="not resumable"):
        rest = _fit(server, form, tmp_path / "resumed", tmp_path / "run" / "step=2.ckpt")
    assert rest[0] == whole[0] != whole[2], "the resumed epoch starts over"


def test_a_state_saved_on_rank_0_resumes_every_rank(server: RunningServer) -> None:
    """Frameworks save rank 0's state and load it on every rank: each rank goes on exactly."""
    whole = {}
    for rank in (0, 1):
        with _records(server, rank=rank, world_size=2) as loader:
            whole[rank] = [b["sample_id"].tolist() for b in loader]
    with _records(server, rank=0, world_size=2) as loader:
        it = iter(loader)
        [next(it) for _ in range(2)]
        state = loader.state_dict()
    for rank in (0, 1):
        with _records(server, rank=rank, world_size=2) as loader:
            loader.load_state_dict(state)
            assert [b["sample_id"].tolist() for b in loader] == whole[rank][2:]


def _run(command: list[str], server: RunningServer, cwd: Path) -> None:
    env = {**os.environ, "BATCHD_TARGET": server.address, "PYTHONUNBUFFERED": "1"}
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(name, None)
    done = subprocess.run(
        command, cwd=cwd, env=env, capture_output=True, text=True, timeout=240, check=False
    )
    assert done.returncode == 0, f"{command} failed:\n{done.stdout[-4000:]}\n{done.stderr[-6000:]}"


def _assert_each_epoch_once(record: Path, train: set[int], epochs: int) -> None:
    """Across both runs and both ranks, each epoch served every train sample exactly once,
    and no step ran twice."""
    steps: Counter[tuple[int, int]] = Counter()
    per_epoch: dict[int, Counter[int]] = {e: Counter() for e in range(epochs)}
    for rank in (0, 1):
        for line in (record / f"rank-{rank}.jsonl").read_text().splitlines():
            row = json.loads(line)
            steps[(rank, row["step"])] += 1
            per_epoch[row["epoch"]].update(row["ids"])
    assert max(steps.values()) == 1, f"steps ran twice: {steps}"
    for epoch, counts in per_epoch.items():
        assert set(counts) == train, f"epoch {epoch} missed or added samples"
        assert max(counts.values()) == 1, f"epoch {epoch} repeated samples"


def _example_args(record: Path, ckpt: Path) -> list[str]:
    return [
        "--dataset=images",
        "--batch-size=4",
        "--size=32",
        "--epochs=2",
        f"--record={record}",
        f"--ckpt-dir={ckpt}",
    ]


@pytest.mark.slow(seconds=40)
@pytest.mark.timeout(600)
@pytest.mark.parametrize("form", ["dataloader", "stateful"])
def test_lightning_example_on_two_ranks_resumes_each_epoch_exactly_once(
    server: RunningServer, catalog: Engine, tmp_path: Path, form: str
) -> None:
    """examples/lightning_train.py, DDP on 2 CPU ranks, the Loader wrapped in batchd.DataLoader
    or a StatefulDataLoader: stop at step 3, resume, no repeats."""
    record, ckpt = tmp_path / "record", tmp_path / "ckpt"
    record.mkdir()
    script = [sys.executable, str(EXAMPLES / "lightning_train.py"), "--devices=2"]
    script.append(f"--form={form}")
    args = _example_args(record, ckpt)
    _run([*script, *args, "--every-n-steps=3", "--stop-after-steps=3"], server, tmp_path)
    _run([*script, *args, f"--resume={ckpt / 'step=3.ckpt'}"], server, tmp_path)
    _assert_each_epoch_once(record, _train_ids(catalog), epochs=2)


@pytest.mark.slow(seconds=40)
@pytest.mark.timeout(600)
def test_accelerate_example_on_two_ranks_resumes_each_epoch_exactly_once(
    server: RunningServer, catalog: Engine, tmp_path: Path
) -> None:
    """examples/accelerate_train.py under torchrun, 2 CPU ranks (gloo): stop, resume, once."""
    record, ckpt = tmp_path / "record", tmp_path / "ckpt"
    record.mkdir()
    launch = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2"]
    script = [*launch, str(EXAMPLES / "accelerate_train.py"), "--cpu"]
    args = _example_args(record, ckpt)
    _run([*script, *args, "--every-n-steps=3", "--stop-after-steps=3"], server, tmp_path)
    _run([*script, *args, f"--resume={ckpt / 'step-3'}"], server, tmp_path)
    _assert_each_epoch_once(record, _train_ids(catalog), epochs=2)
