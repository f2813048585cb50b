"""The decode cache: epoch 1 against epochs 2 and 3, and the batches against a server without it.

One run, three datasets, two servers:

- ``--images`` photo-like 500x375 JPEGs (``loader_vs_dataloader.photo_jpeg``), served as
  ``Image()`` (deterministic: shorter side to 256, centre crop 224) and as
  ``Image(random_crop=True, flip=True)`` (RandomResizedCrop to 224 and a flip);
- ``--npy`` ``.npy`` files of float32 ``(3, 64, 64)``, one sample each, served as
  ``Array((3, 64, 64), "float32")``.

A ``batchd-server serve --decode-cache-size`` (``--cache-size``, room for everything) serves
three epochs of each pipeline, one Loader each (batch ``--batch-size``, shuffled, seed 0):
samples/s of each epoch, timed from ``set_epoch`` to the last batch, and the ratios of epochs
2 and 3 to epoch 1, all measured in this run on the same server, after a warm-up (two batches
of each pipeline through sessions that opt out of the cache: the workers' imports and the
catalog loads are not in epoch 1). Epoch 1 decodes and fills the
cache; the later ones read it (a random crop still crops, resizes and flips each epoch).

Then exactness: epochs 1 and 2 of every pipeline are read again from the (now warm) cached
server and from a second server started without the cache, and each batch's bytes (every
field) are compared by BLAKE2b digest.

Run: ``python bench/decode_cache.py`` (about 2 minutes on 2 cores; ``--quick``: 40 s). On a
machine shared with other work the samples/s are noisy; the ratios less so.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
from _common import batchd_server, closing_line, cores, machine_busy_s, machine_lines, own_cpu_s
from _common import markdown_table as table
from loader_vs_dataloader import write_images
from plots import recorded

import batchd
from batchd_server.catalog import migrate
from batchd_server.catalog.db import make_engine
from batchd_server.catalog.ingest import ingest_imagefolder, ingest_manifest

NPY_SHAPE = (3, 64, 64)
LEASE_TIMEOUT_S = 3600
EPOCHS = 3
PIPELINES: dict[str, tuple[str, Any]] = {
    "Image() (deterministic)": ("bench-images", batchd.Image()),
    "Image(random_crop=True, flip=True)": (
        "bench-images",
        batchd.Image(random_crop=True, flip=True),
    ),
    f"Array{NPY_SHAPE} of .npy files": ("bench-npy", batchd.Array(NPY_SHAPE, "float32")),
}


def write_npy(root: Path, n: int) -> Path:
    """``n`` .npy files of float32 NPY_SHAPE and their manifest."""
    root.mkdir(parents=True)
    rng = np.random.default_rng(0)
    rows = []
    for i in range(n):
        np.save(root / f"{i:06d}.npy", rng.standard_normal(NPY_SHAPE, dtype=np.float32))
        rows.append({"path": f"{i:06d}.npy", "split": "train", "label": i % 10})
    manifest = root.parent / "npy.jsonl"
    manifest.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return manifest


def timed_epochs(address: str, dataset: str, pipeline: Any, batch_size: int) -> list[float]:
    """Samples/s of each of EPOCHS epochs through one Loader."""
    rates = []
    with batchd.Loader(
        address, dataset=dataset, batch_size=batch_size, pipeline=pipeline, seed=0
    ) as loader:
        for epoch in range(EPOCHS):
            loader.set_epoch(epoch)
            start = time.perf_counter()
            samples = sum(len(batch["sample_id"]) for batch in loader)
            rates.append(samples / (time.perf_counter() - start))
    return rates


def warm_up(address: str, batch_size: int) -> None:
    """Start the workers' imports and load both catalogs before anything is timed, through
    sessions that opt out of the cache (they add no entries)."""
    for dataset, pipeline in PIPELINES.values():
        with batchd.Loader(
            address,
            dataset=dataset,
            batch_size=batch_size,
            pipeline=pipeline,
            decode_cache=False,
            seed=99,
        ) as loader:
            for _, _ in zip(range(2), loader, strict=False):
                pass


def digests(address: str, dataset: str, pipeline: Any, batch_size: int) -> list[str]:
    """A digest of every batch (every field's bytes) of epochs 1 and 2."""
    found = []
    with batchd.Loader(
        address, dataset=dataset, batch_size=batch_size, pipeline=pipeline, seed=0
    ) as loader:
        for epoch in range(2):
            loader.set_epoch(epoch)
            for batch in loader:
                h = hashlib.blake2b(digest_size=16)
                for key in sorted(batch):
                    h.update(key.encode())
                    h.update(batch[key].contiguous().numpy().tobytes())
                found.append(h.hexdigest())
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--images", type=int, default=1000)
    parser.add_argument("--npy", type=int, default=4000)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--server-workers", type=int, default=cores())
    parser.add_argument("--cache-size", default="2GiB", help="--decode-cache-size")
    parser.add_argument("--quick", action="store_true", help="300 images, 1000 .npy files")
    args = parser.parse_args()
    if args.quick:
        args.images, args.npy = 300, 1000
    started, busy0, own0 = time.perf_counter(), machine_busy_s(), own_cpu_s()
    print("\n".join(machine_lines()))
    print(
        f"settings: {args.images} JPEGs 500x375, {args.npy} .npy files {NPY_SHAPE} float32, "
        f"batch {args.batch_size}, server --workers {args.server_workers}, "
        f"--decode-cache-size {args.cache_size} (shm tier only), {EPOCHS} epochs, seed 0"
    )
    with tempfile.TemporaryDirectory(prefix="batchd-bench-") as tmp:
        root = Path(tmp)
        url = f"sqlite:///{root / 'catalog.db'}"
        engine = make_engine(url)
        migrate.upgrade(engine)
        write_images(root / "images", args.images)
        ingest_imagefolder(engine, dataset="bench-images", root=root / "images", split="train")
        manifest = write_npy(root / "npy", args.npy)
        ingest_manifest(engine, dataset="bench-npy", root=root / "npy", manifest=manifest)
        engine.dispose()
        common = {"workers": args.server_workers, "lease_timeout_s": LEASE_TIMEOUT_S}
        cached_args = ["--decode-cache-size", args.cache_size, "--shm-budget", "8GiB"]
        rates: dict[str, list[float]] = {}
        cached_digests: dict[str, list[str]] = {}
        (root / "cached").mkdir()
        with batchd_server(url, root / "cached", extra_args=cached_args, **common) as server:
            warm_up(server.target, args.batch_size)
            for name, (dataset, pipeline) in PIPELINES.items():
                rates[name] = timed_epochs(server.target, dataset, pipeline, args.batch_size)
                print(f"{name}: {[f'{r:,.0f}' for r in rates[name]]} samples/s", file=sys.stderr)
            for name, (dataset, pipeline) in PIPELINES.items():
                cached_digests[name] = digests(server.target, dataset, pipeline, args.batch_size)
        (root / "plain").mkdir()
        same: dict[str, str] = {}
        with batchd_server(url, root / "plain", **common) as server:
            for name, (dataset, pipeline) in PIPELINES.items():
                plain = digests(server.target, dataset, pipeline, args.batch_size)
                equal = sum(a == b for a, b in zip(plain, cached_digests[name], strict=True))
                verdict = "yes" if equal == len(plain) == len(cached_digests[name]) else "NO"
                same[name] = f"{verdict} ({equal}/{len(plain)} batches)"
    rows = []
    for name, (r1, r2, r3) in rates.items():
        rows.append(
            [name, f"{r1:,.0f}", f"{r2:,.0f}", f"{r3:,.0f}", f"{r2 / r1:.1f}x", f"{r3 / r1:.1f}x",
             same[name]]
        )  # fmt: skip
    print()
    print(
        table(
            ["pipeline", "epoch 1 /s", "epoch 2 /s", "epoch 3 /s", "2 / 1", "3 / 1",
             "epochs 1-2 equal to no cache"],
            rows,
        )
    )  # fmt: skip
    print(closing_line(started, busy0, own0))


if __name__ == "__main__":
    with recorded("decode_cache"):
        main()
