"""How far past the tutorial DataLoader can ``batchd.Image()`` go on this machine? The floor.

``loader_vs_dataloader.py`` measures batchd at its defaults against the tutorial Pillow
``Dataset``; this script says what bounds that ratio. With every core busy, the throughput
ratio of two loaders is the inverse ratio of the CPU each spends per image, in all of its
processes. batchd's recipe cannot spend less than its *floor*: the accurate JPEG decode, the
antialiased resize and the copy of the crop into the batch, which it must do to give Pillow's
pixels (``batchd_server.pipelines.image``). So the best ratio it could reach, with every other
cost (file reads, the worker's batch loop, the server, the client) at zero, is the tutorial
DataLoader's CPU per image over that floor: the *ceiling*.

A small VM's speed drifts from minute to minute (shared caches, a neighbour on the host), and a
step costs more with the other cores busy than on an idle machine. So the run is ``--reps``
rounds after a warm-up round, and each round measures everything at once:

1. **Each step alone**, in one process per core at the same time (``torch`` single-threaded,
   the cores as busy as in the loaders' runs): CPU ms per image over the first
   ``--step-images`` of ``--images`` photo-like 500x375 JPEGs (the generator of
   ``loader_vs_dataloader.py``), the order of the steps rotating per round. The tutorial
   ``__getitem__`` and its steps; batchd's ``ImagePipeline(size=224).decode_into`` (what a
   worker runs per sample) and its steps; and the cheaper decode batchd does not use,
   simplejpeg's fast IDCT and upsampling (how far its pixels stray from the accurate decode's
   is printed below the table).
2. **One epoch of each loader** at its settings in ``loader_vs_dataloader.py``: the tutorial
   DataLoader at ``num_workers`` = cores, ``prefetch_factor=4``, persistent workers (its best
   there) and a ``batchd.Loader`` with ``Image()`` against ``batchd-server serve --workers``
   cores, batch 64: samples/s and CPU ms per image of every process each side runs (the
   training process and the DataLoader's workers; the training process, the server and its
   workers).

The bound is taken per round (ratio, ceiling, batchd's CPU above its floor), then summarised
as median (min-max) over the rounds.

Run: ``python bench/image_floor.py`` (about 3 minutes on 2 cores; ``--quick``: 20 s).
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import simplejpeg
import torch
from _common import (
    batchd_server,
    closing_line,
    cores,
    descendants,
    machine_busy_s,
    machine_lines,
    markdown_table,
    own_cpu_s,
    pids_cpu_s,
    self_cpu_s,
    spread,
)
from loader_vs_dataloader import IMAGE_H, IMAGE_W, SIZE, TutorialImages, write_images
from PIL import Image
from plots import recorded
from torch.utils.data import DataLoader

import batchd
from batchd_server.catalog import migrate
from batchd_server.catalog.db import make_engine
from batchd_server.catalog.ingest import ingest_imagefolder
from batchd_server.pipelines.base import SampleInfo
from batchd_server.pipelines.image import ImagePipeline

BATCH = 64
FLOOR_STEPS = (
    "batchd: simplejpeg decode (accurate)",
    "batchd: torch antialiased resize to 298x224",
    "batchd: crop copied into the CHW row",
)
"""The steps of batchd's floor: what the recipe cannot do without."""
GOAL = 2.0
"""The ratio issue 14 asks of ``batchd.Image()`` against the tutorial DataLoader."""
LEASE_TIMEOUT_S = 600


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="a smoke run: few images, 1 round")
    p.add_argument("--images", type=int, default=1000, help="JPEGs in the image set")
    p.add_argument("--step-images", type=int, default=300, help="images each step runs over")
    p.add_argument("--reps", type=int, default=5, help="timed rounds after the warm-up round")
    args = p.parse_args()
    if args.quick:
        args.images, args.step_images, args.reps = 128, 64, 1
    args.step_images = min(args.step_images, args.images)
    return args


# ----------------------------------------------------------------------------- the steps

_steps: dict[str, Callable[[int], Any]] = {}
"""A step process's steps (set by :func:`_start_steps` after the fork)."""
_step_images = 0


def _start_steps(files: list[tuple[str, int]]) -> None:
    global _step_images
    torch.set_num_threads(1)
    _steps.update(build_steps(files))
    _step_images = len(files)


def _one_round(rotation: int) -> dict[str, float]:
    """CPU ms per image of each step in this process, the order rotated by ``rotation``."""
    names = list(_steps)
    k = rotation % len(names)
    found = {}
    for name in names[k:] + names[:k]:
        step = _steps[name]
        start = time.process_time()
        for i in range(_step_images):
            step(i)
        found[name] = 1e3 * (time.process_time() - start) / _step_images
    return {name: found[name] for name in names}  # the table's order, whatever the rotation


def build_steps(files: list[tuple[str, int]]) -> dict[str, Callable[[int], Any]]:
    """Every step of both recipes as ``step(i)`` for image ``i``, its inputs prepared."""
    data = [Path(path).read_bytes() for path, _ in files]
    pipeline = ImagePipeline(size=SIZE)
    tutorial = TutorialImages(files)
    row = np.empty((3, SIZE, SIZE), np.uint8)
    info = [
        SampleInfo(sample_id=i, label=0, path=p, length=-1, seed=0, epoch=0)
        for i, (p, _) in enumerate(files)
    ]
    buffer = np.empty(IMAGE_W * IMAGE_H * 3, np.uint8)
    decoded = [simplejpeg.decode_jpeg(d, colorspace="RGB") for d in data]
    pil = [Image.open(path).convert("RGB") for path, _ in files]
    new_w = int(SIZE * IMAGE_W / IMAGE_H)  # torchvision's shorter-side resize: 298 x 224
    left = round((new_w - SIZE) / 2)
    resized = torch.nn.functional.interpolate(
        torch.from_numpy(decoded[0]).permute(2, 0, 1).unsqueeze(0),
        size=(SIZE, new_w),
        mode="bilinear",
        antialias=True,
    )
    pil_resized = pil[0].resize((new_w, SIZE), Image.Resampling.BILINEAR)

    def resize(i: int) -> None:
        torch.nn.functional.interpolate(
            torch.from_numpy(decoded[i]).permute(2, 0, 1).unsqueeze(0),
            size=(SIZE, new_w),
            mode="bilinear",
            antialias=True,
        )

    def tutorial_tensor(i: int) -> None:
        crop = pil_resized.crop((left, 0, left + SIZE, SIZE))
        torch.from_numpy(np.array(crop, copy=True)).permute(2, 0, 1)

    steps: dict[str, Callable[[int], Any]] = {
        "tutorial: __getitem__, all": tutorial.__getitem__,
        "tutorial: open + Pillow decode to RGB": lambda i: Image.open(files[i][0]).convert("RGB"),
        "tutorial: Pillow bilinear resize to 298x224": lambda i: pil[i].resize(
            (new_w, SIZE), Image.Resampling.BILINEAR
        ),
        "tutorial: crop + tensor": tutorial_tensor,
        "batchd: decode_into, all": lambda i: pipeline.decode_into(
            memoryview(data[i]), info[i], {"image": row}
        ),
        FLOOR_STEPS[0]: lambda i: simplejpeg.decode_jpeg(data[i], colorspace="RGB", buffer=buffer),
        FLOOR_STEPS[1]: resize,
        FLOOR_STEPS[2]: lambda i: torch.from_numpy(row).copy_(resized[0, :, :, left : left + SIZE]),
        "not used: simplejpeg fastdct + fastupsample": lambda i: simplejpeg.decode_jpeg(
            data[i], colorspace="RGB", buffer=buffer, fastdct=True, fastupsample=True
        ),
    }
    return steps


def fast_decode_line(files: list[tuple[str, int]]) -> str:
    """How far simplejpeg's fast IDCT and upsampling stray from its accurate decode."""
    worst, means = 0, list[float]()
    for path, _ in files:
        data = Path(path).read_bytes()
        accurate = simplejpeg.decode_jpeg(data, colorspace="RGB").astype(np.int16)
        fast = simplejpeg.decode_jpeg(data, colorspace="RGB", fastdct=True, fastupsample=True)
        diff = np.abs(accurate - fast)
        worst, means = max(worst, int(diff.max())), [*means, float(diff.mean())]
    return (
        f"simplejpeg's fast decode against the accurate one over {len(files)} images: pixels "
        f"differ by up to {worst} levels (mean {np.mean(means):.2f}), so batchd does not use "
        "it: it promises Pillow's pixels"
    )


# ------------------------------------------------------------------------------ the loaders


def cpu_of(pids: Callable[[], list[int]]) -> Callable[[], float]:
    """CPU seconds of this process plus the live processes ``pids()`` names."""
    return lambda: self_cpu_s() + pids_cpu_s(pids())


def timed_epoch(loader: Any, cpu: Callable[[], float]) -> tuple[float, float]:
    """One epoch: (samples/s, CPU ms per image)."""
    samples, cpu0, start = 0, cpu(), time.perf_counter()
    for batch in loader:
        samples += len(batch["label"])
    wall, spent = time.perf_counter() - start, cpu() - cpu0
    return samples / wall, 1e3 * spent / samples


@dataclass
class Rounds:
    """What every timed round measured."""

    steps: dict[str, list[float]] = field(default_factory=dict)
    """Step name -> CPU ms per image, one value per step process and round."""
    floors: list[float] = field(default_factory=list)
    rates: dict[str, list[float]] = field(default_factory=dict)
    cpu_ms: dict[str, list[float]] = field(default_factory=dict)


def run_rounds(
    files: list[tuple[str, int]], url: str, root: Path, args: argparse.Namespace
) -> Rounds:
    """The warm-up round and ``args.reps`` timed rounds: the steps, then an epoch of each loader."""
    n = cores()
    found = Rounds()
    # The step processes fork first, before any loader has a worker, socket or thread.
    context = multiprocessing.get_context("fork")
    with context.Pool(n, _start_steps, (files[: args.step_images],)) as pool:
        torch.set_num_threads(n)
        tutorial = DataLoader(
            TutorialImages(files),
            batch_size=BATCH,
            shuffle=True,
            num_workers=n,
            persistent_workers=True,
            prefetch_factor=4,
        )
        me = os.getpid()
        steppers = {child.pid for child in context.active_children()}
        with batchd_server(url, root, workers=n, lease_timeout_s=LEASE_TIMEOUT_S) as server:

            def server_pids() -> list[int]:
                return [server.process.pid, *descendants(server.process.pid)]

            def dataloader_pids() -> list[int]:
                return sorted(set(descendants(me)) - set(server_pids()) - steppers)

            loader = batchd.Loader(
                server.target,
                dataset="floor-images",
                batch_size=BATCH,
                pipeline=batchd.Image(),
                shuffle=True,
                seed=0,
                device=None,
            )
            sides: dict[str, tuple[Any, Callable[[], float]]] = {
                f"tutorial DataLoader, {n} workers, prefetch 4": (
                    tutorial,
                    cpu_of(dataloader_pids),
                ),
                "batchd.Loader, Image()": (loader, cpu_of(server_pids)),
            }
            try:
                for r in range(args.reps + 1):
                    what = "warm-up round" if r == 0 else f"round {r}/{args.reps}"
                    print(f"{what}: steps ...", file=sys.stderr)
                    per_process = pool.map(_one_round, [r] * n)
                    for name, (it, cpu) in sides.items():
                        print(f"{what}: {name} ...", file=sys.stderr)
                        if it is loader:
                            loader.set_epoch(r)
                        rate, ms = timed_epoch(it, cpu)
                        if r:
                            found.rates.setdefault(name, []).append(rate)
                            found.cpu_ms.setdefault(name, []).append(ms)
                    if r:
                        for step in per_process[0]:
                            found.steps.setdefault(step, []).extend(p[step] for p in per_process)
                        found.floors.append(
                            sum(statistics.median(p[s] for p in per_process) for s in FLOOR_STEPS)
                        )
            finally:
                loader.close()
    return found


# --------------------------------------------------------------------------------- report


def main() -> None:
    args = parse_args()
    print("## How far past the tutorial DataLoader batchd.Image() can go here: the floor\n")
    for line in machine_lines():
        print(f"- {line}")
    print(
        f"- settings: {args.images} JPEGs {IMAGE_W}x{IMAGE_H} (quality 90, 4:2:0) to "
        f"{SIZE}x{SIZE}, files in the page cache; {args.reps} rounds after a warm-up round, "
        f"each: every step over {args.step_images} images in {cores()} processes at once "
        f"(torch 1 thread each), then one epoch of each loader, batch {BATCH}"
    )
    started, busy0, own0 = time.perf_counter(), machine_busy_s(), own_cpu_s()
    with tempfile.TemporaryDirectory(prefix="batchd-floor-") as tmp:
        root = Path(tmp)
        files = write_images(root / "images", args.images)
        url = f"sqlite:///{root / 'catalog.db'}"
        engine = make_engine(url)
        migrate.upgrade(engine)
        ingest_imagefolder(engine, dataset="floor-images", root=root / "images", split="train")
        engine.dispose()
        found = run_rounds(files, url, root, args)
        fast = fast_decode_line(files[: args.step_images])

    print(
        f"\n### Each step alone, in {cores()} processes at once: CPU ms per image, median "
        "(min-max) over the processes and rounds\n"
    )
    rows = [[name, spread(values, ".3f")] for name, values in found.steps.items()]
    rows.insert(-1, ["batchd floor: decode + resize + copy", spread(found.floors, ".3f")])
    print(markdown_table(["step", "CPU ms per image"], rows))
    print(f"\n{fast}.")

    print("\n### The loaders, one epoch each per round\n")
    table = [
        [name, spread(found.rates[name]), spread(found.cpu_ms[name], ".3f")] for name in found.rates
    ]
    print(markdown_table(["loader", "samples/s", "CPU ms per image, all its processes"], table))

    (tut_rates, bd_rates) = found.rates.values()
    (tut_ms, bd_ms) = found.cpu_ms.values()
    rounds = range(len(found.floors))
    ratio = [bd_rates[r] / tut_rates[r] for r in rounds]
    ceiling = [tut_ms[r] / found.floors[r] for r in rounds]
    above = [bd_ms[r] - found.floors[r] for r in rounds]
    room = [tut_ms[r] / GOAL - found.floors[r] for r in rounds]
    print("\n### The bound, per round: median (min-max) over the rounds\n")
    bound = [
        ["measured: batchd samples/s over the tutorial DataLoader's", spread(ratio, ".2f") + "x"],
        [
            "ceiling: the DataLoader's CPU per image over batchd's floor",
            spread(ceiling, ".2f") + "x",
        ],
        [
            f"room for {GOAL:g}x: the DataLoader's CPU per image / {GOAL:g} - the floor",
            spread(room, ".3f") + " ms",
        ],
        ["batchd's CPU per image above its floor, now", spread(above, ".3f") + " ms"],
    ]
    print(markdown_table(["per image", "value"], bound))
    print(
        f"\nAbove its floor batchd reads the file, runs the worker's batch loop, the server and "
        f"the client; {GOAL:g}x needs all of that to fit in the room above (negative: not even "
        "the floor fits)."
    )
    print(closing_line(started, busy0, own0))


if __name__ == "__main__":
    with recorded("image_floor"):
        main()
