"""batchd against ``torch.utils.data.DataLoader``: the same files, one run, the sides alternating.

Sections (each prints a markdown table; ratios are computed within this run):

1. **Images, same decode function.** JPEGs of 500x375 (deterministic, photo-like) to uint8
   ``[64, 3, 224, 224]``. The DataLoader's Dataset calls batchd's own
   ``ImagePipeline(size=224, decoder=D).decode_into`` per sample, so both sides run the very
   same decode and resize; once with ``D="pillow"``, once with ``D="auto"`` (simplejpeg).
2. **Images, each at its defaults.** The DataLoader with a Dataset written the way the
   tutorials write it (``Image.open(path).convert("RGB")``, torchvision-style resize of the
   shorter side + centre crop, ``PILToTensor``-style CHW uint8) against ``batchd.Image()``.
3. **Small samples.** 32 float32 per sample, fixed-size records in one shard file read
   through byte ranges, batch 256; the DataLoader reads each record with ``os.pread``.

The DataLoader runs every ``num_workers`` in 0..cores (with ``persistent_workers=True`` and
``prefetch_factor`` 2 and 4 when it has workers, ``pin_memory`` only with CUDA); its best
median is the reference. batchd runs at its default (tensors that own their slot; a copy
only past the batches a loop may hold, which this loop never reaches) and with
``zero_copy=True`` (views valid until the next batch), at
each ``--prefetch`` depth (the first, the Loader's default 4, is the one the targets use).
Every configuration gets one warm-up pass, then ``--reps`` rounds in which each runs once,
the order alternating DataLoader and batchd and rotating per round, the process quiet
before each run (see ``quiesce``). Neither side caches
decoded samples: each epoch decodes every file again (the files are in the page cache for
both). The loop only counts each batch's rows unless ``--touch`` makes it read every byte.

Run: ``python bench/loader_vs_dataloader.py`` (about 7 minutes on 2 cores; ``--quick``: 30 s)
"""

from __future__ import annotations

import argparse
import io
import json
import multiprocessing
import os
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch
from _common import (
    Contender,
    ServerProcess,
    batchd_server,
    best,
    closing_line,
    compete,
    cores,
    machine_busy_s,
    machine_lines,
    markdown_table,
    own_cpu_s,
    pids_cpu_s,
    ratio,
    results_table,
)
from PIL import Image, ImageDraw
from plots import recorded
from torch.utils.data import DataLoader, Dataset

import batchd
from batchd_server.catalog import migrate
from batchd_server.catalog.db import make_engine
from batchd_server.catalog.ingest import ingest_imagefolder, ingest_manifest
from batchd_server.pipelines.base import SampleInfo
from batchd_server.pipelines.image import ImagePipeline

SIZE = 224
IMAGE_W, IMAGE_H = 500, 375
CLASSES = 10
RECORD_FLOATS = 32
RECORD_BYTES = RECORD_FLOATS * 4
CUDA = torch.cuda.is_available()
LEASE_TIMEOUT_S = 3600
"""A session expires after this long without a stream (default 30 s), and a batchd Loader
here waits through every other configuration's epoch of a round between two of its own."""
RATE, CPU = "samples_per_s", "train_cpu_ms_per_batch"
Target = tuple[str, str, str, str]
"""A row of the targets table: what, measured ratio, goal, met."""


# ---------------------------------------------------------------------------------- data


def photo_jpeg(index: int) -> bytes:
    """A photo-like 500x375 JPEG (quality 90, 4:2:0) that depends only on ``index``.

    Smooth colour field, gradient, mid and fine texture, 3-7 hard-edged shapes and sigma=14
    noise, like perf-baselines.md section 2 (about 83 KiB each; there 87 KiB), so the decode cost
    is a photo's, not a flat card's.
    """
    rng = np.random.default_rng(index)
    coarse = Image.fromarray(rng.integers(0, 256, (4, 5, 3), dtype=np.uint8))
    pixels = np.asarray(coarse.resize((IMAGE_W, IMAGE_H), Image.Resampling.BICUBIC), np.float32)
    yy, xx = np.mgrid[0:IMAGE_H, 0:IMAGE_W].astype(np.float32)
    pixels = pixels + (xx * rng.uniform(-0.12, 0.12) + yy * rng.uniform(-0.16, 0.16))[..., None]
    for period_px, amplitude in ((rng.uniform(12, 40), 18.0), (rng.uniform(2.5, 5), 12.0)):
        angle = rng.uniform(0, np.pi)
        wave = np.sin((xx * np.cos(angle) + yy * np.sin(angle)) * 2 * np.pi / period_px)
        pixels += (amplitude * wave)[..., None] * rng.uniform(0.5, 1.0, 3)
    image = Image.fromarray(np.clip(pixels, 0, 255).astype(np.uint8))
    draw = ImageDraw.Draw(image)
    for _ in range(int(rng.integers(3, 8))):
        x0, y0 = rng.uniform(0, IMAGE_W - 40), rng.uniform(0, IMAGE_H - 40)
        box = (x0, y0, x0 + rng.uniform(30, 200), y0 + rng.uniform(30, 160))
        fill = tuple(int(c) for c in rng.integers(0, 256, 3))
        (draw.ellipse if rng.random() < 0.5 else draw.rectangle)(box, fill=fill)
    noisy = np.asarray(image, np.float32) + rng.normal(0, 14, (IMAGE_H, IMAGE_W, 3))
    out = io.BytesIO()
    Image.fromarray(np.clip(noisy, 0, 255).astype(np.uint8)).save(out, "JPEG", quality=90)
    return out.getvalue()


def write_images(root: Path, n: int) -> list[tuple[str, int]]:
    """``n`` JPEGs as ``root/cNN/IIIII.jpg`` (label ``i % CLASSES``); (path, label) sorted."""
    for k in range(CLASSES):
        (root / f"c{k:02d}").mkdir(parents=True)
    with multiprocessing.Pool(cores()) as pool:
        for i, data in enumerate(pool.imap(photo_jpeg, range(n), chunksize=16)):
            (root / f"c{i % CLASSES:02d}" / f"{i:05d}.jpg").write_bytes(data)
    return [(str(p), int(p.parent.name[1:])) for p in sorted(root.glob("c*/*.jpg"))]


def write_records(root: Path, n: int) -> tuple[Path, Path]:
    """One shard of ``n`` records of 32 float32 and a JSONL manifest of their byte ranges."""
    root.mkdir(parents=True)
    shard = root / "shard-00000.bin"
    rng = np.random.default_rng(0)
    rng.standard_normal((n, RECORD_FLOATS), dtype=np.float32).tofile(shard)
    manifest = root.parent / "records.jsonl"
    with manifest.open("w", encoding="utf-8") as out:
        out.writelines(
            json.dumps(
                {
                    "key": f"r{i:07d}",
                    "path": shard.name,
                    "byte_offset": i * RECORD_BYTES,
                    "byte_length": RECORD_BYTES,
                    "label": i % 1000,
                    "split": "train",
                }
            )
            + "\n"
            for i in range(n)
        )
    return shard, manifest


# ------------------------------------------------------------------- DataLoader datasets


class SameDecodeImages(Dataset[dict[str, Any]]):
    """Per sample: read the file, then batchd's own ``ImagePipeline.decode_into``."""

    def __init__(self, files: list[tuple[str, int]], decoder: str) -> None:
        self.files = files
        self.pipeline = ImagePipeline(size=SIZE, decoder=decoder)

    def __len__(self) -> int:
        return len(self.files)

    def __getitem__(self, i: int) -> dict[str, Any]:
        path, label = self.files[i]
        with open(path, "rb") as f:
            data = f.read()
        image = np.empty((3, SIZE, SIZE), np.uint8)
        info = SampleInfo(sample_id=i, label=label, path=path, length=-1, seed=0, epoch=0)
        self.pipeline.decode_into(memoryview(data), info, {"image": image})
        return {"image": torch.from_numpy(image), "label": label, "sample_id": i}


class TutorialImages(Dataset[dict[str, Any]]):
    """The tutorials' Pillow Dataset: ``Resize(224)`` + ``CenterCrop(224)`` + ``PILToTensor``
    as torchvision computes them, written with Pillow alone (torchvision is not installed)."""

    def __init__(self, files: list[tuple[str, int]]) -> None:
        self.files = files

    def __len__(self) -> int:
        return len(self.files)

    def __getitem__(self, i: int) -> dict[str, Any]:
        path, label = self.files[i]
        img = Image.open(path).convert("RGB")
        w, h = img.size
        short, long = min(w, h), max(w, h)
        new_long = int(SIZE * long / short)  # torchvision's _compute_resized_output_size
        img = img.resize(
            (SIZE, new_long) if w <= h else (new_long, SIZE), Image.Resampling.BILINEAR
        )
        left, top = round((img.width - SIZE) / 2), round((img.height - SIZE) / 2)
        img = img.crop((left, top, left + SIZE, top + SIZE))
        tensor = torch.from_numpy(np.array(img, copy=True)).permute(2, 0, 1)
        return {"image": tensor, "label": label, "sample_id": i}


class ShardRecords(Dataset[dict[str, Any]]):
    """Per sample: ``os.pread`` of one fixed-size record; the fd opens lazily per worker."""

    def __init__(self, shard: Path, n: int) -> None:
        self.shard, self.n = str(shard), n
        self.labels = np.arange(n, dtype=np.int64) % 1000
        self._fd: int | None = None
        self._pid = -1

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> dict[str, Any]:
        if self._pid != os.getpid():  # a forked worker must not share the parent's fd offset
            self._fd, self._pid = os.open(self.shard, os.O_RDONLY), os.getpid()
        assert self._fd is not None
        data = bytearray(os.pread(self._fd, RECORD_BYTES, i * RECORD_BYTES))
        array = torch.frombuffer(data, dtype=torch.float32)
        return {"array": array, "label": int(self.labels[i]), "sample_id": i}


# ------------------------------------------------------------------------------ sections


def check(what: str, a: Contender, b: Contender, metric: str, goal: str) -> Target:
    """The ratio of ``a`` to ``b`` in ``metric`` against ``goal`` (``">= 1"``, ``"<= 0.3"``)."""
    value, (op, bound) = ratio(a, b, metric), goal.split()
    met = value >= float(bound) if op == ">=" else value <= float(bound)
    return what, f"{value:.2f}x", f"{goal}x", "yes" if met else "**no**"


def worker_counts() -> list[int]:
    """0..cores (at least 0..2, for the issue's 2-worker reference); on big machines
    0, 1, 2, 4, 8, ... and cores."""
    n = cores()
    if n <= 4:
        return list(range(max(n, 2) + 1))
    return sorted({0, n, *(1 << k for k in range(n.bit_length()) if 1 << k < n)})


def dataloaders(dataset: Dataset[Any], batch_size: int) -> list[Contender]:
    """The DataLoader at every worker count and prefetch factor of the sweep."""
    found = []
    for workers in worker_counts():
        for prefetch in (2, 4) if workers else (None,):
            loader = DataLoader(
                dataset,
                batch_size=batch_size,
                shuffle=True,
                num_workers=workers,
                persistent_workers=workers > 0,
                prefetch_factor=prefetch,
                pin_memory=CUDA,
            )
            label = f"DataLoader, {workers} workers" + (f", prefetch {prefetch}" if workers else "")
            cpu = _worker_cpu(loader) if workers else None
            found.append(
                Contender(label, "DataLoader", loader, cpu, "cuda" if CUDA else None, CUDA)
            )
    return found


def _worker_cpu(loader: DataLoader[Any]) -> Callable[[], float]:
    # The persistent iterator's worker processes, which torch keeps in a private attribute.
    return lambda: pids_cpu_s(w.pid for w in getattr(loader._iterator, "_workers", ()))


def batchd_loaders(
    server: ServerProcess, variants: list[tuple[str, dict[str, Any]]], **common: Any
) -> Callable[[], list[Contender]]:
    """Builds one batchd Loader per (label, options) variant, on the CPU unless they say."""

    def make() -> list[Contender]:
        found = []
        for label, options in variants:
            options = {"device": "cpu", **common, **options}
            loader = batchd.Loader(server.target, shuffle=True, seed=0, **options)
            cuda = options["device"] == "cuda" or (options["device"] is None and CUDA)
            found.append(Contender(label, "batchd", loader, server.cpu_s, cuda=cuda))
        return found

    return make


def image_sections(
    args: argparse.Namespace, server: ServerProcess, files: list[Any]
) -> list[Target]:
    """Same decode (Pillow, then simplejpeg), then each side at its defaults.

    The targets use batchd at its default ``prefetch`` (the first of ``--prefetch``); the
    other prefetch depths are extra rows.
    """
    targets: list[Target] = []
    common = {"dataset": "bench-images", "batch_size": 64}
    for decoder, title in (("pillow", "Pillow"), ("auto", "simplejpeg")):
        print(f"images, same decode ({title}) ...", file=sys.stderr)
        spec = batchd.Image(size=SIZE, decoder=decoder)
        variants = [
            (f"batchd, {how}, prefetch {depth}", {"pipeline": spec, "prefetch": depth, **extra})
            for depth in args.prefetch
            for how, extra in (("default", {}), ("zero_copy=True", {"zero_copy": True}))
        ]
        if CUDA:
            cuda_options = {"pipeline": spec, "prefetch": args.prefetch[0], "device": "cuda"}
            variants.append(("batchd, device='cuda'", cuda_options))
        dls = dataloaders(SameDecodeImages(files, decoder), 64)
        done = compete(dls, batchd_loaders(server, variants, **common), args.reps, touch=args.touch)
        ref = best(done, "DataLoader")
        print(
            f"\n### Images, same decode function ({title}, decoder={decoder!r} on both sides): "
            f"{len(files)} JPEGs {IMAGE_W}x{IMAGE_H} to {SIZE}x{SIZE}, batch 64, {args.reps} "
            "timed epochs per config\n"
        )
        print(results_table(done, {"best": ref}))
        default, zero = done[len(dls)], done[len(dls) + 1]
        what = f"same decode ({title}):"
        targets += [
            check(
                f"{what} samples/s, batchd default vs DataLoader best", default, ref, RATE, ">= 1"
            ),
            check(f"{what} samples/s, zero_copy vs DataLoader best", zero, ref, RATE, ">= 1"),
            check(f"{what} train CPU/batch, default vs DataLoader best", default, ref, CPU, "<= 1"),
            check(f"{what} train CPU/batch, zero_copy vs DataLoader", zero, ref, CPU, "<= 0.3"),
        ]
        if CUDA:
            what += " train CPU/batch, batchd cuda vs DataLoader pin_memory"
            targets.append(check(what, done[-1], ref, CPU, "<= 0.3"))

    print("images, defaults ...", file=sys.stderr)
    dls = dataloaders(TutorialImages(files), 64)
    options = {"pipeline": batchd.Image(), "device": None}
    variants = [
        (f"batchd, Image(), prefetch {d}", {**options, "prefetch": d}) for d in args.prefetch
    ]
    done = compete(dls, batchd_loaders(server, variants, **common), args.reps, touch=args.touch)
    ref = best(done, "DataLoader")
    print(
        "\n### Images, each side at its defaults: the tutorial Pillow Dataset vs batchd.Image(), "
        f"batch 64, {args.reps} timed epochs per config\n"
    )
    print(results_table(done, {"best": ref}))
    what = "defaults: samples/s, batchd Image() vs tutorial DataLoader best"
    return [*targets, check(what, done[len(dls)], ref, RATE, ">= 1.4")]


def small_section(args: argparse.Namespace, server: ServerProcess, shard: Path) -> list[Target]:
    """32 float32 per sample through byte ranges of one shard, batch 256."""
    print("small samples ...", file=sys.stderr)
    spec = batchd.Array((RECORD_FLOATS,), "float32", raw=True)
    variants: list[tuple[str, dict[str, Any]]] = [
        ("batchd, default", {}),
        ("batchd, zero_copy=True", {"zero_copy": True}),
    ]
    make = batchd_loaders(
        server,
        variants,
        dataset="bench-records",
        batch_size=256,
        prefetch=args.prefetch[0],
        pipeline=spec,
    )
    dls = dataloaders(ShardRecords(shard, args.records), 256)
    done = compete(
        dls,
        make,
        args.reps_small,
        batches=args.small_batches,
        warmup_batches=args.small_warmup,
        touch=args.touch,
    )
    ref = best(done, "DataLoader")
    two = next(c for c in dls if c.label == "DataLoader, 2 workers, prefetch 2")
    print(
        f"\n### Small samples: {RECORD_FLOATS} float32 records in one shard, batch 256, "
        f"{args.small_warmup} untimed + {args.small_batches} timed batches per run, "
        f"{args.reps_small} runs per config\n"
    )
    print(results_table(done, {"best": ref, "2 workers": two}))
    default = done[len(dls)]
    return [
        check(
            "small: samples/s, batchd default vs DataLoader 2 workers", default, two, RATE, ">= 3"
        ),
        check("small: samples/s, batchd default vs DataLoader best", default, ref, RATE, ">= 1"),
    ]


# ---------------------------------------------------------------------------------- main


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add = parser.add_argument
    add("--quick", action="store_true", help="a smoke run: little data, 1 rep (about 1 min)")
    add("--only", choices=("images", "small"), help="run one section only")
    add("--images", type=int, default=1000, help="JPEGs in the image set")
    add("--records", type=int, default=1_000_000, help="records in the small-sample shard")
    add("--reps", type=int, default=5, help="timed epochs per image config")
    add("--reps-small", type=int, default=3, help="timed runs per small-sample config")
    add("--small-batches", type=int, default=2000, help="timed batches per small-sample run")
    add("--small-warmup", type=int, default=100, help="untimed batches before them")
    add(
        "--prefetch",
        type=int,
        nargs="+",
        default=[4, 8],
        help="batchd Loader prefetch "
        "depths to run; the first (default 4, the Loader's default) is the one in the targets",
    )
    add("--touch", action="store_true", help="the loop reads every byte of each batch once")
    add("--server-workers", type=int, default=cores(), help="batchd-server --workers")
    args = parser.parse_args()
    if args.quick:
        args.images, args.records, args.reps, args.reps_small = 128, 100_000, 1, 1
        args.small_batches, args.small_warmup = 200, 20
    return args


def print_settings(args: argparse.Namespace) -> None:
    print("## batchd vs torch.utils.data.DataLoader\n")
    print(f"command: {Path(sys.executable).name} {' '.join(sys.argv)}")
    for line in machine_lines():
        print(line)
    method = torch.multiprocessing.get_start_method()
    print(
        f"DataLoader: num_workers in {worker_counts()}; with workers persistent_workers=True "
        f"and prefetch_factor 2 or 4; pin_memory={CUDA}; shuffle=True; default collate; "
        f"start method {method}; CUDA {'available: batches go to cuda' if CUDA else 'absent'}"
    )
    print(
        f"batchd: batchd-server serve --workers {args.server_workers} --lease-timeout-s "
        f"{LEASE_TIMEOUT_S} as its own process on a unix socket, SQLite catalog; Loader "
        f"prefetch {' and '.join(map(str, args.prefetch))} (small samples: "
        f"{args.prefetch[0]}), shuffle=True, transport auto (shm), device cpu unless a row "
        "says otherwise"
    )
    print(
        f"images: {args.images} JPEGs {IMAGE_W}x{IMAGE_H} quality 90 4:2:0 (~{CLASSES} "
        f"classes), batch 64, 1 warm-up + {args.reps} timed epochs per config"
    )
    print(
        f"small: {args.records:,} records of {RECORD_BYTES} B in one shard, batch 256, 1 "
        f"warm-up run + {args.reps_small} runs per config of {args.small_warmup} untimed + "
        f"{args.small_batches} timed batches"
    )
    print(
        "CPU: train = getrusage(RUSAGE_SELF) of the loop's process, all threads; loader procs "
        "= /proc utime+stime of the DataLoader's workers, or of batchd-server and its workers"
    )
    print(
        "ratios: median over median of the reference, measured in this run; the loop "
        + (
            "reads every byte of each batch once (--touch)"
            if args.touch
            else "counts rows and touches no data (DataLoader's page faults on its shared memory "
            "stay unpaid; see --touch)"
        )
    )


def main() -> None:
    args = parse_args()
    print_settings(args)
    started, busy0, own0 = time.perf_counter(), machine_busy_s(), own_cpu_s()
    targets: list[Target] = []
    with tempfile.TemporaryDirectory(prefix="batchd-bench-") as tmp:
        root = Path(tmp)
        url = f"sqlite:///{root / 'catalog.db'}"
        engine = make_engine(url)
        migrate.upgrade(engine)
        files: list[tuple[str, int]] = []
        shard = manifest = Path()
        if args.only in (None, "images"):
            files = write_images(root / "images", args.images)
            ingest_imagefolder(engine, dataset="bench-images", root=root / "images", split="train")
        if args.only in (None, "small"):
            shard, manifest = write_records(root / "records", args.records)
            ingest_manifest(
                engine, dataset="bench-records", root=shard.parent, manifest=manifest, verify=False
            )
        engine.dispose()
        print(f"data ready after {time.perf_counter() - started:.0f} s", file=sys.stderr)
        with batchd_server(
            url, root, workers=args.server_workers, lease_timeout_s=LEASE_TIMEOUT_S
        ) as server:
            if files:
                targets += image_sections(args, server, files)
            if args.only in (None, "small"):
                targets += small_section(args, server, shard)
    print("\n### Targets (issue 3)\n")
    print(markdown_table(["target", "measured", "goal", "met"], [list(t) for t in targets]))
    print(closing_line(started, busy0, own0))


if __name__ == "__main__":
    with recorded("loader_vs_dataloader"):
        main()
