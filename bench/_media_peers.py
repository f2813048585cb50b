"""The other side of ``multimodal.py``: tutorial-style ``Dataset`` classes decoding the same
files with the same library (PyAV) for ``torch.utils.data.DataLoader``, and what keeps the
peers that decode media (SPDL, LitData) from running on this machine, found by trying them.

The datasets do what a PyTorch tutorial's would, written well: open the file, seek to a
clip's start (keyframe before it), decode forward until the clip is complete, resize with
FFmpeg's scaler through PyAV (the conversion batchd's workers use), stack; for audio, decode
and resample with ``av.AudioResampler``, crop, pad. Each sample's randomness comes from
``numpy.random.default_rng((seed, epoch, index))``, the careful way (no shared worker
seeds).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import av
import numpy as np
import torch
from torch.utils.data import Dataset


def _label(path: Path) -> int:
    return int(path.parent.name[1:])


class VideoClips(Dataset[dict[str, Any]]):
    """A random clip of ``frames`` consecutive frames per video, ``size`` x ``size`` RGB."""

    def __init__(self, paths: list[Path], frames: int, size: int, seed: int = 0) -> None:
        self.paths, self.frames, self.size, self.seed, self.epoch = paths, frames, size, seed, 0

    def __len__(self) -> int:
        return len(self.paths)

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __getitem__(self, i: int) -> dict[str, Any]:
        rng = np.random.default_rng((self.seed, self.epoch, i))
        size, out = self.size, []
        with av.open(str(self.paths[i])) as container:
            stream = container.streams.video[0]
            stream.codec_context.thread_count = 1
            rate = float(stream.average_rate)
            n = stream.frames
            start = int(rng.integers(0, max(0, n - self.frames) + 1))
            if start:
                container.seek(int(start / rate / stream.time_base), stream=stream)
            for frame in container.decode(stream):
                if round(float(frame.pts * stream.time_base) * rate) < start:
                    continue
                short = min(frame.width, frame.height)
                w, h = frame.width * size // short, frame.height * size // short
                rgb = frame.reformat(width=w, height=h, format="rgb24").to_ndarray()
                top, left = (h - size) // 2, (w - size) // 2
                out.append(rgb[top : top + size, left : left + size])
                if len(out) == self.frames:
                    break
        while len(out) < self.frames:
            out.append(out[-1])
        video = torch.from_numpy(np.stack(out)).permute(0, 3, 1, 2)
        return {"video": video, "label": _label(self.paths[i])}


class AudioCrops(Dataset[dict[str, Any]]):
    """A random ``seconds`` crop of each file, mono float32 at ``rate``, zero-padded."""

    def __init__(self, paths: list[Path], rate: int, seconds: float, seed: int = 0) -> None:
        self.paths, self.rate, self.seed, self.epoch = paths, rate, seed, 0
        self.samples = round(seconds * rate)

    def __len__(self) -> int:
        return len(self.paths)

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __getitem__(self, i: int) -> dict[str, Any]:
        rng = np.random.default_rng((self.seed, self.epoch, i))
        parts = []
        with av.open(str(self.paths[i])) as container:
            stream = container.streams.audio[0]
            resampler = av.AudioResampler(format="flt", layout="mono", rate=self.rate)
            for frame in [*container.decode(stream), None]:
                parts += [f.to_ndarray().reshape(-1) for f in resampler.resample(frame)]
        wave = np.concatenate(parts)
        start = int(rng.integers(0, max(0, len(wave) - self.samples) + 1))
        crop = np.zeros((1, self.samples), np.float32)
        kept = wave[start : start + self.samples]
        crop[0, : len(kept)] = kept
        return {
            "audio": torch.from_numpy(crop),
            "length": len(kept),
            "label": _label(self.paths[i]),
        }


def spdl_status() -> str:
    """Whether SPDL 0.8's media decode runs here, and if not, why (its own error)."""
    try:
        import spdl.io

        spdl.io.demux_video(b"")  # loads its FFmpeg binding first
    except Exception as e:
        text = str(e)
        if "libavutil" in text or "libspdl" in text:
            return (
                "SPDL 0.8 cannot decode here: its FFmpeg binding links the system's FFmpeg "
                "shared libraries (libavutil.so.5x-6x), which this machine lacks "
                f"({type(e).__name__}: {text[:120]}...)"
            )
        return "SPDL 0.8 loads its FFmpeg binding here (a media peer could run)"
    return "SPDL 0.8 loads its FFmpeg binding here (a media peer could run)"


def litdata_status() -> str:
    """Whether LitData's Video/Audio decode runs here (it decodes with torchcodec)."""
    try:
        import torchcodec  # noqa: F401
    except Exception as e:
        return (
            "LitData's Video/Audio decode through torchcodec, which is not installed here "
            "(and needs the system's FFmpeg shared libraries, which this machine lacks): "
            f"{type(e).__name__}: {e}"
        )
    return "torchcodec imports here: LitData's Video/Audio could run"
