"""How batchd scales with its decode workers: samples/s at 1, 2, ... workers up to the cores.

For each workload and each worker count ``W`` (1 up to the machine's cores, or ``--workers``),
a fresh ``batchd-server serve --workers W`` runs as its own process and one ``batchd.Loader``
at its defaults reads whole epochs (timed from ``iter()``, so each epoch's start counts). The
table puts the median beside ``W x`` the one-worker median — what perfect scaling would give —
and their ratio (the efficiency). The output is saved to ``bench/results/scaling.md`` and its
chart drawn into ``docs/img/bench/scaling.png`` (``plots.py``; matplotlib from
``requirements/bench.txt``).

Workloads (``--only`` picks some):

- ``images``: ``--images`` photo-like 500x375 JPEGs (the same generator as
  ``loader_vs_dataloader.py``) through ``batchd.Image()`` (224x224), batch 64: decode-bound;
- ``npy``: ``--records`` records, each a ``.npy`` of 32 float32 in one shard file
  (``batchd.Array((32,), "float32")``), batch 256: bound by the per-batch work of the
  training loop, the server and the client, not by the workers (500,000 by default, so an
  epoch lasts about a second: at 50,000 one epoch is ~0.1 s and the runs are noise).

What limits it on a small machine: the server's own process and the training loop share the
cores with the workers, so on 2 cores ``W = 2`` cannot reach 2x; the table's last column says
how busy the machine's cores were during the runs (the loop, the server and its workers).

Run: ``python bench/scaling.py`` (a few minutes on 2 cores), ``--quick`` (under a minute).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from _common import (
    batchd_server,
    closing_line,
    cores,
    machine_busy_s,
    machine_lines,
    markdown_table,
    own_cpu_s,
    spread,
)
from loader_vs_dataloader import write_images
from plots import recorded
from worker_path import write_shard

import batchd
from batchd_server.catalog import migrate
from batchd_server.catalog.db import make_engine
from batchd_server.catalog.ingest import ingest_imagefolder, ingest_manifest

LEASE_TIMEOUT_S = 3600


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="a smoke run: little data, 1 rep")
    p.add_argument("--only", choices=("images", "npy"), action="append", help="workloads to run")
    p.add_argument("--images", type=int, default=1000, help="JPEGs in the image set")
    p.add_argument("--records", type=int, default=500_000, help="records in the npy shard")
    p.add_argument("--reps", type=int, default=5, help="timed epochs per worker count")
    p.add_argument("--workers", type=int, nargs="+", help="worker counts (default 1..cores)")
    args = p.parse_args()
    if args.quick:
        args.images, args.records, args.reps = 200, 10_000, 1
    args.workers = sorted(set(args.workers or range(1, cores() + 1)))
    if args.workers[0] < 1:
        p.error("--workers must be >= 1")
    if 1 not in args.workers:
        args.workers = [1, *args.workers]  # the baseline that W x one worker multiplies
    args.only = args.only or ["images", "npy"]
    return args


def epochs(target: str, options: dict[str, Any], reps: int) -> tuple[list[float], float]:
    """``reps`` timed epochs after one warm-up: their samples/s and the cores kept busy."""
    rates: list[float] = []
    loader = batchd.Loader(target, shuffle=True, seed=0, device="cpu", **options)
    try:
        for _ in loader:  # warm-up: workers import torch, the catalog segment is built
            pass
        busy0, wall0 = machine_busy_s(), time.perf_counter()
        for epoch in range(1, reps + 1):
            loader.set_epoch(epoch)
            start, samples = time.perf_counter(), 0
            for batch in loader:
                samples += len(batch["label"])
            rates.append(samples / (time.perf_counter() - start))
        busy = (machine_busy_s() - busy0) / (time.perf_counter() - wall0)
    finally:
        loader.close()
    return rates, busy


def workload_rows(
    name: str, url: str, root: Path, options: dict[str, Any], args: argparse.Namespace
) -> tuple[list[list[str]], list[float]]:
    rows: list[list[str]] = []
    medians: list[float] = []
    for w in args.workers:
        print(f"{name}: {w} worker(s) ...", file=sys.stderr)
        with batchd_server(url, root, workers=w, lease_timeout_s=LEASE_TIMEOUT_S) as server:
            rates, busy = epochs(server.target, options, args.reps)
        med = statistics.median(rates)
        medians.append(med)
        ideal = w * medians[0]
        rows.append(
            [
                name,
                str(w),
                spread(rates),
                f"{ideal:,.0f}",
                f"{med / ideal:.2f}",
                f"{busy:.2f} of {cores()}",
            ]
        )
    return rows, medians


def main() -> None:
    args = parse_args()
    print("## batchd scaling with decode workers\n")
    for line in machine_lines():
        print(f"- {line}")
    print(
        f"- settings: workers {args.workers}, {args.reps} timed epochs after 1 warm-up per "
        f"count, Loader defaults (prefetch 4, shm, CPU tensors), shuffle; images: {args.images} "
        f"JPEGs 500x375 -> Image() 224x224, batch 64; npy: {args.records:,} records of 32 "
        "float32, batch 256; each count a fresh `batchd-server serve --workers W` on a unix socket"
    )
    started, busy0, own0 = time.perf_counter(), machine_busy_s(), own_cpu_s()
    table: list[list[str]] = []
    with tempfile.TemporaryDirectory(prefix="batchd-scaling-") as tmp:
        root = Path(tmp)
        url = f"sqlite:///{root / 'catalog.db'}"
        engine = make_engine(url)
        migrate.upgrade(engine)
        if "images" in args.only:
            write_images(root / "images", args.images)
            ingest_imagefolder(engine, dataset="scale-images", root=root / "images", split="train")
        if "npy" in args.only:
            (root / "records").mkdir()
            rows = write_shard(root / "records", "npy", args.records, 32, 128)
            manifest = root / "records" / "npy.jsonl"
            with manifest.open("w", encoding="utf-8") as out:
                for i, (path, offset, length) in enumerate(rows):
                    entry = {"key": f"r{i:07d}", "path": path, "byte_offset": offset}
                    out.write(json.dumps({**entry, "byte_length": length, "label": i % 1000}))
                    out.write("\n")
            ingest_manifest(
                engine,
                dataset="scale-npy",
                root=root / "records",
                manifest=manifest,
                split="train",
                verify=False,
            )
        engine.dispose()
        workloads = {
            "images": {"dataset": "scale-images", "batch_size": 64, "pipeline": batchd.Image()},
            "npy": {
                "dataset": "scale-npy",
                "batch_size": 256,
                "pipeline": batchd.Array((32,), "float32"),
            },
        }
        for name in args.only:
            rows, _ = workload_rows(name, url, root, workloads[name], args)
            table += rows
    header = ["workload", "workers", "samples/s", "W x one worker", "efficiency", "cores busy"]
    print("\n" + markdown_table(header, table))
    print(closing_line(started, busy0, own0))


if __name__ == "__main__":
    with recorded("scaling"):
        main()
