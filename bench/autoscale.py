"""``--workers 1..N`` (sized by demand) against fixed counts, on a load that steps from light
to heavy, in one run.

Each configuration is its own ``batchd-server serve`` process on a unix socket over one
SQLite catalog of photo-like JPEGs, decoded by ``batchd.Image()`` (224, centre crop: the
CPU-heavy recipe of ``loader_vs_dataloader.py``). One Loader reads it continuously through
two phases:

- **light**: the training loop "steps" for a fixed time per batch (a sleep standing in for
  the GPU), chosen so that the trainer needs about half of what one worker decodes: one
  worker is enough, and the range should stay at (or shrink to) its minimum;
- **heavy**: no step at all (decode-bound), so every worker the machine affords helps.

Reported per configuration and phase: samples/s, the decode workers alive on average
(counted from the server's child processes every 0.25 s) and the server's CPU (server +
workers). For the range, also how long after the heavy phase began the pool reached its
largest size, and the heavy phase's samples/s from then on ("steady"). The target: the
range's heavy-phase samples/s within 10% of the fixed maximum's.

Calibration first: one epoch on a 1-worker server gives one worker's samples/s, from which
the light phase's step time is set. Phases are timed from the first batch of the phase.

Run: ``python bench/autoscale.py`` (about 3 minutes on 2 cores), ``--quick`` (a smoke run).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from _common import (
    ServerProcess,
    batchd_server,
    closing_line,
    cores,
    descendants,
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
TARGET = 0.9
"""The range's heavy-phase samples/s over the fixed maximum's, at least."""
LIGHT_SHARE = 0.5
"""The light phase asks for this share of one worker's decode rate."""


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add = parser.add_argument
    add("--quick", action="store_true", help="a smoke run: 200 images, 6 s phases")
    add("--images", type=int, default=600, help="JPEGs in the image set")
    add("--batch-size", type=int, default=16, help="samples per batch")
    add("--light-s", type=float, default=20.0, help="seconds of the light phase")
    add("--heavy-s", type=float, default=30.0, help="seconds of the heavy phase")
    add("--max-workers", type=int, default=cores(), help="N of --workers 1..N and fixed N")
    args = parser.parse_args()
    if args.quick:
        args.images, args.light_s, args.heavy_s = 200, 6.0, 6.0
    return args


@dataclass
class Phase:
    samples: int = 0
    seconds: float = 0.0
    server_cpu_s: float = 0.0
    workers: list[tuple[float, int]] = field(default_factory=list)
    """(seconds into the phase, workers alive) samples."""

    @property
    def rate(self) -> float:
        return self.samples / self.seconds if self.seconds else 0.0

    @property
    def mean_workers(self) -> float:
        return sum(w for _, w in self.workers) / len(self.workers) if self.workers else 0.0


class WorkerCounter:
    """Counts the server's child processes (its decode workers) every 0.25 s."""

    def __init__(self, server: ServerProcess) -> None:
        self.server = server
        self.samples: list[tuple[float, int]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> WorkerCounter:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        while not self._stop.wait(0.25):
            # The resource tracker of multiprocessing is a child too: count decode workers.
            kids = descendants(self.server.process.pid)
            workers = sum(1 for pid in kids if _is_worker(pid))
            self.samples.append((time.monotonic(), workers))

    def between(self, start: float, end: float) -> list[tuple[float, int]]:
        return [(t - start, n) for t, n in self.samples if start <= t <= end]


def _is_worker(pid: int) -> bool:
    try:
        return "spawn_main" in Path(f"/proc/{pid}/cmdline").read_text()
    except OSError:
        return False


def batches(loader: batchd.Loader) -> Iterator[int]:
    """Rows of each batch, epoch after epoch, forever."""
    while True:
        for batch in loader:
            yield len(batch["label"])


def run_phase(
    rows: Iterator[int], seconds: float, step_s: float, server: ServerProcess
) -> tuple[Phase, float, float]:
    """Read for ``seconds`` from the first batch on, stepping ``step_s`` per batch."""
    phase = Phase()
    phase.samples = next(rows)
    cpu0, start = server.cpu_s(), time.monotonic()
    while time.monotonic() - start < seconds:
        if step_s:
            time.sleep(step_s)  # the "GPU step" of the light phase
        phase.samples += next(rows)
    end = time.monotonic()
    phase.seconds, phase.server_cpu_s = end - start, server.cpu_s() - cpu0
    return phase, start, end


def measure(
    url: str,
    root: Path,
    workers: str,
    options: dict[str, object],
    args: argparse.Namespace,
    step_s: float,
) -> tuple[Phase, Phase]:
    root.mkdir()
    with batchd_server(url, root, workers=workers, lease_timeout_s=LEASE_TIMEOUT_S) as server:
        with WorkerCounter(server) as counter, batchd.Loader(server.target, **options) as loader:
            rows = batches(loader)
            light, l0, l1 = run_phase(rows, args.light_s, step_s, server)
            heavy, h0, h1 = run_phase(rows, args.heavy_s, 0.0, server)
        light.workers, heavy.workers = counter.between(l0, l1), counter.between(h0, h1)
    return light, heavy


def calibrate(url: str, root: Path, options: dict[str, object]) -> float:
    """One worker's samples/s: a warm-up epoch, then one timed epoch."""
    root.mkdir()
    with (
        batchd_server(url, root, workers="1", lease_timeout_s=LEASE_TIMEOUT_S) as server,
        batchd.Loader(server.target, **options) as loader,
    ):
        for _ in loader:
            pass
        start, samples = time.monotonic(), 0
        for batch in loader:
            samples += len(batch["label"])
        return samples / (time.monotonic() - start)


def main() -> None:
    args = parse_args()
    n = args.max_workers
    print(f"## Decode workers sized by demand (--workers 1..{n}) vs fixed counts\n")
    print(f"command: {Path(sys.executable).name} {' '.join(sys.argv)}")
    for line in machine_lines():
        print(line)
    print(
        f"data: {args.images} JPEGs {IMAGE_W}x{IMAGE_H} quality 90; Loader batch_size="
        f"{args.batch_size}, pipeline batchd.Image() (224, centre crop), shuffle=True, "
        "transport auto (shm), device cpu; each config its own batchd-server process "
        f"(--workers as named, --lease-timeout-s {LEASE_TIMEOUT_S}), unix socket, SQLite"
    )
    print(
        f"phases: light {args.light_s:g} s (the loop sleeps a step per batch sized for "
        f"{LIGHT_SHARE:.0%} of one worker's rate), then heavy {args.heavy_s:g} s (no step: "
        "decode-bound); workers = the server's spawned children, sampled every 0.25 s; "
        "server CPU = /proc utime+stime of the server and its workers"
    )
    started, busy0, own0 = time.perf_counter(), machine_busy_s(), own_cpu_s()
    configs = [f"1..{n}", "1", str(n)]
    results: dict[str, tuple[Phase, Phase]] = {}
    with tempfile.TemporaryDirectory(prefix="batchd-bench-") as tmp:
        root = Path(tmp)
        url = f"sqlite:///{root / 'catalog.db'}"
        engine = make_engine(url)
        migrate.upgrade(engine)
        write_images(root / "images", args.images)
        ingest_imagefolder(engine, dataset="bench-images", root=root / "images", split="train")
        engine.dispose()
        options: dict[str, object] = {
            "dataset": "bench-images",
            "batch_size": args.batch_size,
            "pipeline": batchd.Image(),
            "device": "cpu",
        }
        one = calibrate(url, root / "calibrate", options)
        step_s = args.batch_size / (LIGHT_SHARE * one)
        print(
            f"calibration: one worker decodes {one:,.0f} samples/s; light step "
            f"{1000 * step_s:.1f} ms per batch of {args.batch_size}"
        )
        for index, workers in enumerate(configs):
            results[workers] = measure(url, root / f"s{index}", workers, options, args, step_s)
            print(f"{workers}: done", file=sys.stderr)
    rows = []
    for workers, (light, heavy) in results.items():
        for name, phase in (("light", light), ("heavy", heavy)):
            rows.append(
                [
                    f"--workers {workers}",
                    name,
                    f"{phase.rate:,.0f}",
                    f"{phase.mean_workers:.2f}",
                    f"{phase.server_cpu_s / phase.seconds:.2f}",
                ]
            )
    print("\n### Results\n")
    print(markdown_table(["config", "phase", "samples/s", "workers (mean)", "server CPU/s"], rows))
    light, heavy = results[configs[0]]
    fixed = results[str(n)][1]
    peak = max((w for _, w in heavy.workers), default=0)
    reached = next((t for t, w in heavy.workers if w == peak), 0.0)
    print(
        f"\nrange: largest size {peak} reached {reached:.1f} s into the heavy phase; "
        f"light-phase workers {light.mean_workers:.2f} on average"
    )
    measured = heavy.rate / fixed.rate if fixed.rate else 0.0
    print("\n### Target\n")
    print(
        markdown_table(
            ["target", "measured", "goal", "met"],
            [
                [
                    f"--workers 1..{n} vs fixed {n}, heavy-phase samples/s",
                    f"{measured:.2f}x",
                    f">= {TARGET:.2f}x",
                    "yes" if measured >= TARGET else "no",
                ]
            ],
        )
    )
    print(closing_line(started, busy0, own0))


if __name__ == "__main__":
    with recorded("autoscale"):
        main()
