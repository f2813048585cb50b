"""Train a tiny CNN on the demo images through batchd, and say how long it waited for data.

Run by ``scripts/demo.sh`` once the server is up; by hand:

    BATCHD_TARGET=unix:///path/batchd.sock python examples/train_demo.py --epochs 2

The loop is an ordinary PyTorch loop: the only batchd line is the ``batchd.Loader(...)``.
Normalisation to float happens here, after the (uint8, four times smaller) batch arrived.
"""

from __future__ import annotations

import argparse
import time

import torch
from torch import nn

import batchd


def tiny_cnn(classes: int) -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(3, 16, 3, stride=2, padding=1),
        nn.ReLU(),
        nn.Conv2d(16, 32, 3, stride=2, padding=1),
        nn.ReLU(),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(32, classes),
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--target", default=None, help="server address (default $BATCHD_TARGET)")
    parser.add_argument("--dataset", default="demo")
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--size", type=int, default=64, help="image side after crop")
    args = parser.parse_args()

    torch.manual_seed(0)
    torch.set_num_threads(1)  # leave the other cores to the decode workers
    loader = batchd.Loader(
        args.target,
        dataset=args.dataset,
        batch_size=args.batch_size,
        pipeline=batchd.Image(size=args.size, random_crop=True, flip=True),
        seed=0,
    )
    device = torch.device(loader.device)
    classes = len(batchd.Catalog(args.target).describe_dataset(args.dataset).classes) or 1
    model = tiny_cnn(classes).to(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    mean = torch.tensor([0.485, 0.456, 0.406], device=device).view(1, 3, 1, 1) * 255
    std = torch.tensor([0.229, 0.224, 0.225], device=device).view(1, 3, 1, 1) * 255

    with loader:
        print(f"batchd: {len(loader)} batches of {args.batch_size} per epoch, device {device}")
        for epoch in range(args.epochs):
            loader.set_epoch(epoch)
            wait_before, samples, correct, loss_sum = loader.wait_s, 0, 0, 0.0
            started = time.perf_counter()
            for batch in loader:
                images = (batch["image"].float() - mean) / std
                labels = batch["label"]
                logits = model(images)
                loss = nn.functional.cross_entropy(logits, labels)
                optimizer.zero_grad(set_to_none=True)
                loss.backward()
                optimizer.step()
                samples += len(labels)
                correct += int((logits.argmax(1) == labels).sum())
                loss_sum += loss.item() * len(labels)
            seconds = time.perf_counter() - started
            waited = loader.wait_s - wait_before
            print(
                f"epoch {epoch}: {samples} samples in {seconds:.1f} s = "
                f"{samples / seconds:.0f} samples/s; waited for data {waited:.2f} s "
                f"({100 * waited / seconds:.0f}% of the loop); loss {loss_sum / samples:.3f}, "
                f"train accuracy {correct / samples:.2f}"
            )


if __name__ == "__main__":
    main()
