"""Video clips and audio through batchd beside a tutorial-style ``DataLoader`` with the same
decoder (PyAV) and the same number of worker processes, at its best settings (persistent
workers, ``pin_memory`` where there is CUDA, ``prefetch_factor`` 4).

Media are encoded in the run with PyAV (``_media_data.py``): H.264 clips with a keyframe a
second, and stereo FLAC tones of 2-8 s at 44.1 kHz. Then, per section:

- (a) **video**: ``batchd.Video(frames=16, size=112)`` (a random clip, resized by FFmpeg's
  scaler) over ``ingest videofolder``, beside ``_media_peers.VideoClips`` in a DataLoader;
- (b) **audio**: ``batchd.Audio(sample_rate=16000, seconds=4.0)`` (mono, a random crop) over
  ``ingest audiofolder``, beside ``_media_peers.AudioCrops``;
- (c) **image + caption**: a multi-field sample, added beside these once a Loader can serve
  one (``SECTIONS`` is where it goes).

Reported per configuration (``_common.compete``: warm-up, then rounds with the sides
interleaved): samples/s, the training process's CPU per batch, and the peak proportional
set size (PSS: shared pages split between the processes mapping them, so shared memory is
counted once) summed over every process of that side (the trainer with its DataLoader
workers, or the trainer with the batchd server and its workers), sampled every 0.1 s by a
separate process. The peers that decode media (SPDL 0.8, LitData's Video/Audio) are tried
and, where they cannot run, the reason is printed.

    .venv/bin/python bench/multimodal.py             # 256 videos, 512 tones, 3 rounds
    .venv/bin/python bench/multimodal.py --quick     # 16 videos, 32 tones, 1 round
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import DataLoader

import batchd
from batchd_server.catalog import migrate
from batchd_server.catalog.db import make_engine
from batchd_server.catalog.ingest import ingest_audiofolder, ingest_videofolder

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import (
    Contender,
    Run,
    batchd_server,
    compete,
    cores,
    descendants,
    machine_lines,
    markdown_table,
    spread,
)
from _media_data import audio_tree, video_codec, video_tree
from _media_peers import AudioCrops, VideoClips, litdata_status, spdl_status
from plots import recorded

BATCH = 8
FRAMES, SIZE = 16, 112
RATE, SECONDS = 16000, 4.0

_SAMPLER = """
import os, sys, time, signal
pids, root = [int(p) for p in sys.argv[1].split(",") if p], int(sys.argv[2])
def tree(pid):
    found, todo = [], [pid]
    while todo:
        p = todo.pop()
        try:
            for t in os.listdir(f"/proc/{p}/task"):
                kids = [int(k) for k in open(f"/proc/{p}/task/{t}/children").read().split()]
                found += kids; todo += kids
        except OSError:
            pass
    return found
def pss(pid):
    try:
        for line in open(f"/proc/{pid}/smaps_rollup"):
            if line.startswith("Pss:"):
                return int(line.split()[1]) * 1024
    except OSError:
        return 0
    return 0
peak, stop = 0, []
signal.signal(signal.SIGTERM, lambda *a: stop.append(1))
while not stop:
    every = pids + ([root, *tree(root)] if root else [])
    peak = max(peak, sum(pss(p) for p in set(every)))
    time.sleep(0.1)
print(peak, flush=True)
"""


class Measured(Contender):
    """A contender whose runs also record the peak PSS of its side's processes."""

    def __init__(self, *args: Any, pids: Callable[[], tuple[list[int], int]], **kw: Any) -> None:
        super().__init__(*args, **kw)
        self.pids = pids
        self.peaks: list[int] = []

    def run(self, *, batches: int | None, warmup_batches: int, touch: bool = False) -> Run:
        listed, root = self.pids()
        sampler = subprocess.Popen(
            [sys.executable, "-c", _SAMPLER, ",".join(map(str, listed)), str(root)],
            stdout=subprocess.PIPE,
            text=True,
        )
        try:
            return super().run(batches=batches, warmup_batches=warmup_batches, touch=touch)
        finally:
            sampler.terminate()
            out, _ = sampler.communicate(timeout=30)
            self.peaks.append(int(out.strip() or 0))


def _dataloader(dataset: Any, workers: int, server_pid: int) -> Measured:
    loader = DataLoader(
        dataset,
        batch_size=BATCH,
        shuffle=True,
        num_workers=workers,
        persistent_workers=True,
        pin_memory=torch.cuda.is_available(),
        prefetch_factor=4,
        drop_last=True,
    )
    me = os.getpid()
    server = {server_pid, *descendants(server_pid)}

    def workers_now() -> list[int]:
        return [p for p in descendants(me) if p not in server]

    def pids() -> tuple[list[int], int]:
        return [me, *workers_now()], 0

    label = f"DataLoader + {type(dataset).__name__} (PyAV), {workers} workers, prefetch 4"
    return Measured(label, "DataLoader", loader, lambda: _cpu(workers_now()), pids=pids)


def _cpu(pids: list[int]) -> float:
    from _common import pids_cpu_s

    return pids_cpu_s(pids)


def _batchd(target: str, dataset: str, pipeline: Any, server: Any, label: str) -> Measured:
    loader = batchd.Loader(
        target, dataset=dataset, batch_size=BATCH, pipeline=pipeline, device="cpu", seed=0
    )
    me, pid = os.getpid(), server.process.pid
    return Measured(label, "batchd", loader, server.cpu_s, pids=lambda: ([me], pid))


def _table(contenders: list[Measured]) -> str:
    ref = max(
        (c for c in contenders if c.side == "DataLoader"), key=lambda c: c.median("samples_per_s")
    )
    rows = []
    for c in contenders:
        rows.append(
            [
                c.label,
                spread([r.samples_per_s for r in c.runs]),
                f"{c.median('samples_per_s') / ref.median('samples_per_s'):.2f}x",
                spread([r.train_cpu_ms_per_batch for r in c.runs], ".2f"),
                f"{c.median('train_cpu_ms_per_batch') / ref.median('train_cpu_ms_per_batch'):.2f}x",
                f"{max(c.peaks) / 2**20:,.0f}",
            ]
        )
    head = ["config", "samples/s median (min-max)", "ratio vs DataLoader"]
    head += ["train-process CPU ms/batch", "CPU ratio vs DataLoader", "peak PSS all procs MiB"]
    return markdown_table(head, rows)


def section(
    name: str,
    server: Any,
    dataset: Any,
    pipeline: Any,
    label: str,
    args: argparse.Namespace,
) -> None:
    catalog_name = "videos" if isinstance(pipeline, batchd.Video) else "audio"

    def second() -> list[Contender]:
        return [_batchd(server.target, catalog_name, pipeline, server, label)]

    first: list[Contender] = [_dataloader(dataset, args.workers, server.process.pid)]
    done = compete(first, second, args.rounds)
    print(f"\n### ({name}) one epoch per run, batch {BATCH}, {args.workers} workers each\n")
    print(_table([c for c in done if isinstance(c, Measured)]))


def resize_costs(video: Path, size: int) -> None:
    """CPU ms per frame of the two resizes the video pipeline could use, on decoded frames of
    ``video``: FFmpeg's scaler from YUV straight to the RGB size (what it uses) against the
    full-size RGB conversion plus torch's antialiased resize (the image pipeline's)."""
    import av

    with av.open(str(video)) as container:
        frames = list(container.decode(video=0))
    first = frames[0]
    short = min(first.width, first.height)
    w, h = first.width * size // short, first.height * size // short
    from av.video.reformatter import VideoReformatter

    scaler = VideoReformatter()

    def ffmpeg(frame: Any) -> Any:
        return scaler.reformat(frame, width=w, height=h, format="rgb24", interpolation="BILINEAR")

    def torch_resize(frame: Any) -> Any:
        rgb = torch.from_numpy(frame.to_ndarray(format="rgb24")).permute(2, 0, 1).unsqueeze(0)
        return torch.nn.functional.interpolate(rgb, size=(h, w), mode="bilinear", antialias=True)

    rows = []
    for name, step in (
        ("FFmpeg scaler, YUV -> RGB at size", ffmpeg),
        ("RGB + torch", torch_resize),
    ):
        step(first)  # warm: the scaler's context, torch's kernels
        cpu = time.process_time()
        for frame in frames:
            step(frame)
        rows.append([name, f"{(time.process_time() - cpu) / len(frames) * 1e3:.3f}"])
    print(f"\n### Resize of a {first.width}x{first.height} frame to {w}x{h}, one core\n")
    print(markdown_table(["resize", "CPU ms per frame"], rows))


SECTIONS = ("video", "audio")
"""(c) image + caption joins these once a Loader serves multi-field samples."""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add = parser.add_argument
    add("--quick", action="store_true", help="16 videos, 32 tones, 1 round: a smoke run")
    add("--videos", type=int, default=256)
    add("--tones", type=int, default=512)
    add("--rounds", type=int, default=3)
    add("--workers", type=int, default=cores(), help="batchd-server --workers and num_workers")
    add("--only", choices=SECTIONS, action="append", help="run these sections only")
    args = parser.parse_args()
    if args.quick:
        args.videos, args.tones, args.rounds = 16, 32, 1
    torch.set_num_threads(1)
    print("## Video and audio: batchd beside a DataLoader with the same decoder\n")
    print(f"command: {Path(sys.executable).name} {' '.join(sys.argv)}")
    for line in machine_lines():
        print(line)
    import av

    print(
        f"decoder: PyAV {av.__version__} (FFmpeg {av.ffmpeg_version_info}), video {video_codec()}"
    )
    print(f"peers: {spdl_status()}")
    print(f"peers: {litdata_status()}")
    sections = args.only or list(SECTIONS)
    with tempfile.TemporaryDirectory(prefix="batchd-media-") as tmp:
        root = Path(tmp)
        url = f"sqlite:///{root / 'catalog.db'}"
        engine = make_engine(url)
        migrate.upgrade(engine)
        start = time.perf_counter()
        videos = (
            video_tree(root / "videos", args.videos, 4.0, 320, 240) if "video" in sections else []
        )
        tones = (
            audio_tree(root / "audio", args.tones, 2.0, 8.0, 44100) if "audio" in sections else []
        )
        print(
            f"settings: {len(videos)} videos (4 s, 320x240, 25 fps), {len(tones)} FLAC tones "
            f"(2-8 s, 44.1 kHz stereo), encoded in {time.perf_counter() - start:.0f} s; "
            f"batch {BATCH}; {args.rounds} rounds of one epoch per configuration"
        )
        if videos:
            ingest_videofolder(engine, dataset="videos", root=root / "videos", workers=args.workers)
        if tones:
            ingest_audiofolder(engine, dataset="audio", root=root / "audio", workers=args.workers)
        engine.dispose()
        if videos:
            resize_costs(videos[0], SIZE)
        with batchd_server(url, root, workers=args.workers, lease_timeout_s=30) as server:
            if videos:
                section(
                    "a: video clips",
                    server,
                    VideoClips(videos, FRAMES, SIZE),
                    batchd.Video(frames=FRAMES, size=SIZE),
                    f"batchd Video(frames={FRAMES}, size={SIZE})",
                    args,
                )
            if tones:
                section(
                    "b: audio",
                    server,
                    AudioCrops(tones, RATE, SECONDS),
                    batchd.Audio(sample_rate=RATE, seconds=SECONDS),
                    f"batchd Audio(sample_rate={RATE}, seconds={SECONDS})",
                    args,
                )


if __name__ == "__main__":
    with recorded("multimodal"):
        main()
