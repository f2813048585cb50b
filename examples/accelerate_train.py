"""Train a tiny CNN with Hugging Face accelerate on batches from batchd, and resume mid-epoch.

    BATCHD_TARGET=unix:///path/batchd.sock torchrun --standalone --nproc-per-node 2 \\
        examples/accelerate_train.py --cpu --ckpt-dir ckpt --every-n-steps 3 --stop-after-steps 3
    BATCHD_TARGET=unix:///path/batchd.sock torchrun --standalone --nproc-per-node 2 \\
        examples/accelerate_train.py --cpu --resume ckpt/step-3

(``accelerate launch --num_processes 2 --cpu`` works the same way.) Two things differ from
an accelerate script over a ``DataLoader``:

- The Loader is *not* passed to ``accelerator.prepare``. Each rank's Loader already serves
  only its own share (rank and world size from ``torch.distributed``) on the rank's device;
  ``prepare`` would shard or dispatch it a second time.
- ``accelerator.register_for_checkpointing(loader)``: ``save_state`` stores the Loader's
  position beside the model and optimizer and ``load_state`` restores it, so the resumed run
  continues at exactly the next batch. The state is the same on every rank (the main process
  writes it, every rank reads it).

``--record DIR`` writes the sample ids of every step to ``DIR/rank-<r>.jsonl``.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from accelerate import Accelerator
from torch import nn

import batchd


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--target", default=None, help="server address (default $BATCHD_TARGET)")
    parser.add_argument("--dataset", default="demo")
    parser.add_argument("--classes", type=int, default=4)
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--size", type=int, default=64, help="image side after crop")
    parser.add_argument("--cpu", action="store_true", help="train on the CPU (gloo across ranks)")
    parser.add_argument("--ckpt-dir", type=Path, default=Path("checkpoints"))
    parser.add_argument("--every-n-steps", type=int, default=0, help="save_state every N steps")
    parser.add_argument("--stop-after-steps", type=int, default=-1, help="stop early (a crash)")
    parser.add_argument("--resume", default=None, help="a save_state directory to resume from")
    parser.add_argument("--record", type=Path, default=None, help="write each step's ids here")
    args = parser.parse_args()

    torch.manual_seed(0)
    torch.set_num_threads(1)  # leave the other cores to the decode workers
    accelerator = Accelerator(cpu=args.cpu)
    loader = batchd.Loader(
        args.target,
        dataset=args.dataset,
        batch_size=args.batch_size,
        pipeline=batchd.Image(size=args.size, random_crop=True, flip=True),
        device=accelerator.device,
        seed=0,
    )
    model = nn.Sequential(
        nn.Conv2d(3, 8, 3, stride=2, padding=1),
        nn.ReLU(),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(8, args.classes),
    )
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    model, optimizer = accelerator.prepare(model, optimizer)
    accelerator.register_for_checkpointing(loader)
    step = 0
    if args.resume:
        accelerator.load_state(args.resume)
        step = int(Path(args.resume).name.rsplit("-", 1)[1])
    mean = torch.tensor([0.485, 0.456, 0.406], device=accelerator.device).view(1, 3, 1, 1) * 255
    std = torch.tensor([0.229, 0.224, 0.225], device=accelerator.device).view(1, 3, 1, 1) * 255

    with loader:
        # loader.epoch is where the restored state continues: set_epoch of the epoch the
        # Loader is in the middle of keeps its place.
        for epoch in range(loader.epoch, args.epochs):
            loader.set_epoch(epoch)
            for batch in loader:
                if args.record is not None:
                    line = {"epoch": epoch, "step": step, "ids": batch["sample_id"].tolist()}
                    path = args.record / f"rank-{accelerator.process_index}.jsonl"
                    with open(path, "a") as f:
                        f.write(json.dumps(line) + "\n")
                images = (batch["image"].float() - mean) / std
                loss = nn.functional.cross_entropy(model(images), batch["label"])
                optimizer.zero_grad(set_to_none=True)
                accelerator.backward(loss)
                optimizer.step()
                step += 1
                if args.every_n_steps and step % args.every_n_steps == 0:
                    accelerator.save_state(str(args.ckpt_dir / f"step-{step}"))
                if step == args.stop_after_steps:
                    accelerator.end_training()
                    return
    accelerator.end_training()


if __name__ == "__main__":
    main()
