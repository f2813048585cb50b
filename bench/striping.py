"""Striping one Loader over two ``batchd-server`` replicas against one server, in one run.

DESIGN §7: a client stripes one session's batches over several replicas (batch k from
replica k mod R) to draw on more CPUs than one replica has. Here each replica is
``batchd-server serve --workers 1`` as its own process on a unix socket, over one SQLite
catalog, and the decode is CPU-heavy (photo-like 500x375 JPEGs to ``[B, 3, 224, 224]``
uint8, ``batchd.Image()``), so the servers are the bottleneck and the loop only counts rows:

- **one server**: ``batchd.Loader(target_a)``, one decode worker in all;
- **striped**: ``batchd.Loader([target_a, target_b])``, two decode workers, one per replica.

On a 2-core machine one 1-worker server leaves a core idle and two of them use both: the
ratio is what a second replica's CPU buys, less what the training process and the servers'
own threads take of the same two cores (the CPU columns say how much). Every configuration
warms up for one epoch, then ``--reps`` rounds run each once, the order rotating; whole
epochs are timed from ``iter()``. Target (issue 13): striped >= 1.6x one server's samples/s.

Run: ``python bench/striping.py`` (about 1 minute on 2 cores), ``--quick`` (a smoke run).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

from _common import (
    Contender,
    batchd_server,
    closing_line,
    compete,
    cores,
    machine_busy_s,
    machine_lines,
    markdown_table,
    own_cpu_s,
    ratio,
    results_table,
)
from loader_vs_dataloader import IMAGE_H, IMAGE_W, write_images
from plots import recorded

import batchd
from batchd_server.catalog import migrate
from batchd_server.catalog.db import make_engine
from batchd_server.catalog.ingest import ingest_imagefolder

LEASE_TIMEOUT_S = 3600
TARGET_RATIO = 1.6


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add = parser.add_argument
    add("--quick", action="store_true", help="a smoke run: 192 images, 1 rep")
    add("--images", type=int, default=1000, help="JPEGs in the image set")
    add("--batch-size", type=int, default=32, help="samples per batch")
    add("--reps", type=int, default=4, help="timed epochs per config")
    add("--prefetch", type=int, default=4, help="Loader prefetch (per replica when striped)")
    args = parser.parse_args()
    if args.quick:
        args.images, args.reps = 192, 1
    return args


def print_settings(args: argparse.Namespace) -> None:
    print("## Striping over two batchd-server replicas vs one\n")
    print(f"command: {Path(sys.executable).name} {' '.join(sys.argv)}")
    for line in machine_lines():
        print(line)
    print(
        f"servers: 2 x batchd-server serve --workers 1 --lease-timeout-s {LEASE_TIMEOUT_S}, "
        "each its own process on a unix socket, one SQLite catalog; 'one server' uses the "
        f"first only. On this {cores()}-core machine two 1-worker servers use "
        f"{'both cores' if cores() == 2 else f'2 of the {cores()} cores'}, one server 1"
    )
    print(
        f"data: {args.images} JPEGs {IMAGE_W}x{IMAGE_H} quality 90 4:2:0; Loader "
        f"batch_size={args.batch_size}, pipeline batchd.Image() (224, centre crop), "
        f"prefetch {args.prefetch}, shuffle=True, transport auto (shm), device cpu; the loop "
        f"counts rows only; 1 warm-up + {args.reps} timed epochs per config, order rotating"
    )
    print(
        "CPU: train = getrusage(RUSAGE_SELF) of the loop's process, all threads; loader "
        "procs = /proc utime+stime of the server processes and their decode workers"
    )


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
        ingest_imagefolder(engine, dataset="bench-images", root=root / "images", split="train")
        engine.dispose()
        (root / "a").mkdir()
        (root / "b").mkdir()
        print(f"data ready after {time.perf_counter() - started:.0f} s", file=sys.stderr)
        options = {
            "dataset": "bench-images",
            "batch_size": args.batch_size,
            "pipeline": batchd.Image(),
            "prefetch": args.prefetch,
            "device": "cpu",
        }
        server = {"workers": 1, "lease_timeout_s": LEASE_TIMEOUT_S}
        with (
            batchd_server(url, root / "a", **server) as a,  # type: ignore[arg-type]
            batchd_server(url, root / "b", **server) as b,  # type: ignore[arg-type]
        ):
            one = Contender(
                "one server, 1 worker", "one", batchd.Loader(a.target, **options), a.cpu_s
            )

            def striped() -> list[Contender]:
                loader = batchd.Loader([a.target, b.target], **options)
                return [
                    Contender(
                        "striped over 2 servers, 1 worker each",
                        "striped",
                        loader,
                        lambda: a.cpu_s() + b.cpu_s(),
                    )
                ]

            contenders = compete([one], striped, args.reps)
    single, both = contenders
    print("\n### Results\n")
    print(results_table(contenders, {"one server": single}))
    measured = ratio(both, single, "samples_per_s")
    met = "yes" if measured >= TARGET_RATIO else "no"
    print("\n### Target (issue 13)\n")
    print(
        markdown_table(
            ["target", "measured", "goal", "met"],
            [["striped over 2 vs one server, samples/s", f"{measured:.2f}x", ">= 1.6x", met]],
        )
    )
    print(closing_line(started, busy0, own0))


if __name__ == "__main__":
    with recorded("striping"):
        main()
