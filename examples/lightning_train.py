"""Train a tiny CNN with Lightning on batches from batchd, and resume a mid-epoch checkpoint.

    BATCHD_TARGET=unix:///path/batchd.sock python examples/lightning_train.py \\
        --devices 2 --ckpt-dir ckpt --every-n-steps 3 --stop-after-steps 3
    BATCHD_TARGET=unix:///path/batchd.sock python examples/lightning_train.py \\
        --devices 2 --resume ckpt/step=3.ckpt

The Loader is made in ``train_dataloader()``, after Lightning started DDP (``--devices 2``
runs two CPU ranks over gloo), so its rank and world size come from ``torch.distributed``.
Lightning gets it as it is (``--form loader``) or wrapped for code that wants a
``DataLoader``: ``batchd.DataLoader(loader)`` (``--form dataloader``, a
``torch.utils.data.DataLoader`` subclass) or torchdata's
``StatefulDataLoader(batchd.IterableDataset(loader), batch_size=None)`` (``--form
stateful``). All three have ``state_dict``/``load_state_dict``, so every checkpoint holds the
loader's position and a resumed run continues at exactly the next batch. A plain
``torch.utils.data.DataLoader(batchd.IterableDataset(loader), batch_size=None)`` has no
state: Lightning saves nothing for it (and warns that it is "not resumable"), and a resumed
run starts the epoch over, so do not use one.

``--record DIR`` writes the sample ids of every step, one JSON line per step, to
``DIR/rank-<r>.jsonl`` (the tests read them to check that nothing repeats or goes missing).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from torch import nn

import batchd


class TinyCNN(pl.LightningModule):
    def __init__(self, classes: int, record: Path | None) -> None:
        super().__init__()
        self.net = nn.Sequential(
            nn.Conv2d(3, 8, 3, stride=2, padding=1),
            nn.ReLU(),
            nn.AdaptiveAvgPool2d(1),
            nn.Flatten(),
            nn.Linear(8, classes),
        )
        self.record = record
        self.register_buffer("mean", torch.tensor([0.485, 0.456, 0.406]).view(1, 3, 1, 1) * 255)
        self.register_buffer("std", torch.tensor([0.229, 0.224, 0.225]).view(1, 3, 1, 1) * 255)

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        if self.record is not None:
            line = {
                "epoch": self.current_epoch,
                "step": self.global_step,
                "ids": batch["sample_id"].tolist(),
            }
            with open(self.record / f"rank-{self.global_rank}.jsonl", "a") as f:
                f.write(json.dumps(line) + "\n")
        images = (batch["image"].float() - self.mean) / self.std
        return nn.functional.cross_entropy(self.net(images), batch["label"])

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.05)


class BatchdData(pl.LightningDataModule):
    """Makes the Loader once DDP is up; closes it when training ends."""

    def __init__(self, args: argparse.Namespace) -> None:
        super().__init__()
        self.args = args
        self.loader: batchd.Loader | None = None

    def train_dataloader(self) -> Any:
        args = self.args
        self.loader = batchd.Loader(
            args.target,
            dataset=args.dataset,
            batch_size=args.batch_size,
            pipeline=batchd.Image(size=args.size, random_crop=True, flip=True),
            device="cpu",  # Lightning moves the batch to the rank's device itself
            seed=0,
        )
        if args.form == "loader":
            return self.loader
        if args.form == "dataloader":
            return batchd.DataLoader(self.loader)
        from torchdata.stateful_dataloader import StatefulDataLoader

        return StatefulDataLoader(batchd.IterableDataset(self.loader), batch_size=None)

    def teardown(self, stage: str) -> None:
        if self.loader is not None:
            self.loader.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--target", default=None, help="server address (default $BATCHD_TARGET)")
    parser.add_argument("--dataset", default="demo")
    parser.add_argument("--classes", type=int, default=4)
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--size", type=int, default=64, help="image side after crop")
    parser.add_argument("--devices", type=int, default=1, help="CPU ranks (DDP over gloo)")
    parser.add_argument("--form", choices=("loader", "dataloader", "stateful"), default="loader")
    parser.add_argument("--ckpt-dir", type=Path, default=Path("checkpoints"))
    parser.add_argument("--every-n-steps", type=int, default=0, help="checkpoint every N steps")
    parser.add_argument("--stop-after-steps", type=int, default=-1, help="stop early (a crash)")
    parser.add_argument("--resume", default=None, help="a checkpoint to resume from")
    parser.add_argument("--record", type=Path, default=None, help="write each step's ids here")
    args = parser.parse_args()

    torch.manual_seed(0)
    torch.set_num_threads(1)  # leave the other cores to the decode workers
    callbacks = []
    if args.every_n_steps:
        callbacks.append(
            pl.callbacks.ModelCheckpoint(
                dirpath=args.ckpt_dir,
                filename="{step}",
                every_n_train_steps=args.every_n_steps,
                save_top_k=-1,
            )
        )
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=args.devices,
        strategy="ddp" if args.devices > 1 else "auto",
        max_epochs=args.epochs,
        max_steps=args.stop_after_steps,
        callbacks=callbacks,
        default_root_dir=args.ckpt_dir,
        enable_checkpointing=bool(callbacks),
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    model = TinyCNN(args.classes, args.record)
    trainer.fit(model, datamodule=BatchdData(args), ckpt_path=args.resume)


if __name__ == "__main__":
    main()
