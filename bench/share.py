"""Two co-located jobs on one server, with and without ``share=``, in one run.

Two training jobs on one host often read the same data in the same order (a sweep over
learning rates, one seed). Each is its own process with its own ``batchd.Loader`` on the
same ``batchd-server serve`` (its own process, unix socket, SQLite catalog), and the decode
is CPU-heavy (photo-like 500x375 JPEGs to ``[B, 3, 224, 224]`` uint8, ``batchd.Image()``),
so the server's decode workers are the bottleneck and each job's loop only counts rows:

- **separate**: both Loaders without ``share=``: every batch is decoded once per job;
- **shared**: both with ``share="bench"``: each batch is decoded once, into one job's ring,
  and the other job reads it in that slot.

A round starts both jobs at one barrier and times until the second has finished its
``--epochs`` epochs;
aggregate samples/s is both jobs' samples over that time, server CPU the server's and its
decode workers' CPU seconds over the same span. Every round also checks what the jobs got:
each job's epoch has every sample exactly once, and with ``share=`` the two jobs' epochs
are identical batch for batch. Configurations alternate over ``--reps`` rounds after one
warm-up round each; medians are reported. Target: shared >= 1.8x separate, aggregate
samples/s.

Run: ``python bench/share.py`` (about 2 minutes on 2 cores), ``--quick`` (a smoke run).
"""

from __future__ import annotations

import argparse
import hashlib
import multiprocessing as mp
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
)
from loader_vs_dataloader import IMAGE_H, IMAGE_W, write_images
from plots import recorded

import batchd
from batchd_server.catalog import migrate
from batchd_server.catalog.db import make_engine
from batchd_server.catalog.ingest import ingest_imagefolder

LEASE_TIMEOUT_S = 3600
TARGET_RATIO = 1.8
DATASET = "bench-images"


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add = parser.add_argument
    add("--quick", action="store_true", help="a smoke run: 128 images, 1 rep")
    add("--images", type=int, default=640, help="JPEGs in the image set")
    add("--batch-size", type=int, default=32, help="samples per batch")
    add("--reps", type=int, default=3, help="timed rounds per config")
    add("--epochs", type=int, default=3, help="epochs each job reads per round")
    add("--prefetch", type=int, default=4, help="each Loader's prefetch")
    add("--workers", type=int, default=2, help="the server's decode workers")
    args = parser.parse_args()
    if args.quick:
        args.images, args.reps, args.epochs = 128, 1, 1
    return args


def print_settings(args: argparse.Namespace) -> None:
    print("## Two co-located jobs on one server, with and without share=\n")
    print(f"command: {Path(sys.executable).name} {' '.join(sys.argv)}")
    for line in machine_lines():
        print(line)
    print(
        f"server: batchd-server serve --workers {args.workers} --lease-timeout-s "
        f"{LEASE_TIMEOUT_S}, its own process on a unix socket, one SQLite catalog"
    )
    print(
        f"jobs: 2 processes, each one batchd.Loader: {args.images} JPEGs {IMAGE_W}x{IMAGE_H}, "
        f"batch_size={args.batch_size}, pipeline batchd.Image() (224, centre crop), prefetch "
        f"{args.prefetch}, shuffle=True seed=0, transport auto (shm), device cpu; the loop "
        "counts rows only; 'shared' adds share='bench' to both"
    )
    print(
        f"rounds: 1 warm-up + {args.reps} timed per config, configs alternating; a round is "
        f"{args.epochs} epoch(s) of both jobs, from one start barrier until the second job "
        "is done"
    )
    print(
        "server CPU: /proc utime+stime of the server process and its decode workers over "
        "the round. Timings on a shared machine are noisy; the ratio is of medians taken "
        "in the same run"
    )


def job(
    target: str, options: dict[str, Any], epochs: range, start: Any, out: Any, index: int
) -> None:
    """One training job: wait at ``start``, read ``epochs``, report (samples, every epoch
    exactly once, digest of every batch's ids)."""
    with batchd.Loader(target, **options) as loader:
        start.wait()
        samples, once = 0, True
        digest = hashlib.sha256()
        for epoch in epochs:
            loader.set_epoch(epoch)
            ids: list[int] = []
            # The stream starts at iter(): nothing is decoded before the clock runs.
            for batch in loader:
                batch_ids = batch["sample_id"].tolist()
                ids += batch_ids
                digest.update(repr(batch_ids).encode())
            samples += len(ids)
            once = once and len(set(ids)) == len(ids) == loader.num_samples
        out.put((index, samples, once, digest.hexdigest()))


def one_round(
    target: str, options: dict[str, Any], epochs: range, cpu_s: Any
) -> tuple[float, float, list[tuple[int, int, bool, str]]]:
    """Both jobs over ``epochs``: (wall seconds, server CPU seconds, each job's report)."""
    ctx = mp.get_context("spawn")
    start = ctx.Barrier(3)
    out = ctx.Queue()
    procs = [
        ctx.Process(target=job, args=(target, options, epochs, start, out, i)) for i in range(2)
    ]
    for p in procs:
        p.start()
    start.wait()  # both jobs opened their sessions
    t0, cpu0 = time.perf_counter(), cpu_s()
    reports = [out.get(timeout=600) for _ in procs]
    wall, cpu = time.perf_counter() - t0, cpu_s() - cpu0
    for p in procs:
        p.join(60)
        if p.exitcode != 0:
            raise RuntimeError(f"a job exited with {p.exitcode}")
    return wall, cpu, sorted(reports)


def main() -> None:
    args = parse_args()
    print_settings(args)
    started, busy0, own0 = time.perf_counter(), machine_busy_s(), own_cpu_s()
    with tempfile.TemporaryDirectory(prefix="batchd-bench-") as tmp:
        root = Path(tmp)
        url = f"sqlite:///{root / 'catalog.db'}"
        engine = make_engine(url)
        migrate.upgrade(engine)
        write_images(root / "images", args.images)
        ingest_imagefolder(engine, dataset=DATASET, root=root / "images", split="train")
        engine.dispose()
        print(f"data ready after {time.perf_counter() - started:.0f} s", file=sys.stderr)
        base = {
            "dataset": DATASET,
            "batch_size": args.batch_size,
            "pipeline": batchd.Image(),
            "prefetch": args.prefetch,
            "device": "cpu",
            "seed": 0,
        }
        configs = {"separate": base, "shared": {**base, "share": "bench"}}
        runs: dict[str, list[tuple[float, float]]] = {name: [] for name in configs}
        checks: list[str] = []
        server_opts = {"workers": args.workers, "lease_timeout_s": LEASE_TIMEOUT_S}
        with batchd_server(url, root, **server_opts) as server:
            epoch = 0
            for rep in range(args.reps + 1):
                order = list(configs) if rep % 2 == 0 else list(reversed(configs))
                for name in order:
                    epochs = range(epoch, epoch + args.epochs)
                    wall, cpu, reports = one_round(
                        server.target, configs[name], epochs, server.cpu_s
                    )
                    epoch += args.epochs
                    samples = sum(r[1] for r in reports)
                    once = all(r[2] and r[1] == args.images * args.epochs for r in reports)
                    same = reports[0][3] == reports[1][3]
                    print(
                        f"{'warm-up' if rep == 0 else f'round {rep}'} {name}: {wall:.2f} s, "
                        f"{samples / wall:,.0f} samples/s, server CPU {cpu:.1f} s, each "
                        f"epoch once: {once}, identical epochs: {same}",
                        file=sys.stderr,
                    )
                    if not once:
                        checks.append(f"{name} round {rep}: an epoch was not exactly once")
                    if name == "shared" and not same:
                        checks.append(f"shared round {rep}: the jobs' epochs differ")
                    if rep > 0:
                        runs[name].append((samples / wall, cpu / samples * 1000))
    print("\n### Results\n")
    rows = []
    for name, values in runs.items():
        rates = [v[0] for v in values]
        rate = statistics.median(rates)
        cpu_ms = statistics.median(v[1] for v in values)
        spread = f"{rate:,.0f} ({min(rates):,.0f}-{max(rates):,.0f})"
        rows.append([name, spread, f"{cpu_ms:.2f}", str(len(values))])
    print(
        markdown_table(
            [
                "config",
                "aggregate samples/s, median (min-max)",
                "server CPU ms/sample, median",
                "rounds",
            ],
            rows,
        )
    )
    shared = statistics.median(v[0] for v in runs["shared"])
    separate = statistics.median(v[0] for v in runs["separate"])
    measured = shared / separate
    print("\n### Target\n")
    print(
        markdown_table(
            ["target", "measured", "goal", "met"],
            [
                [
                    "shared vs separate, aggregate samples/s",
                    f"{measured:.2f}x",
                    f">= {TARGET_RATIO}x",
                    "yes" if measured >= TARGET_RATIO else "no",
                ],
                [
                    "each job's epoch exactly once; shared jobs' epochs identical",
                    "all rounds" if not checks else "; ".join(checks),
                    "all rounds",
                    "yes" if not checks else "no",
                ],
            ],
        )
    )
    print(f"\n{cores()} cores")
    print(closing_line(started, busy0, own0))


if __name__ == "__main__":
    with recorded("share"):
        main()
