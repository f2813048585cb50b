"""Synthetic media for ``multimodal.py``, encoded in the run with PyAV (never downloaded):
class-per-folder trees of short H.264 (or MPEG-4 part 2) clips and of FLAC tones."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import av
import numpy as np

FPS = 25
CLASSES = 4


def video_codec() -> str:
    """libx264 where the bundled FFmpeg has it (PyAV's wheels do), else mpeg4."""
    return "libx264" if "libx264" in av.codecs_available else "mpeg4"


def write_video(path: Path, frames: int, width: int, height: int, seed: int) -> None:
    """``frames`` frames at 25 fps, a keyframe every second: moving shapes over noise, so the
    encoder has real work and the decoder real bits."""
    rng = np.random.default_rng(seed)
    base = rng.integers(0, 256, (height, width, 3), dtype=np.uint8)
    codec = video_codec()
    with av.open(str(path), "w") as container:
        stream: Any = container.add_stream(codec, rate=FPS)
        stream.width, stream.height, stream.pix_fmt = width, height, "yuv420p"
        stream.codec_context.gop_size = FPS
        if codec == "libx264":
            stream.options = {"preset": "veryfast", "crf": "23"}
        for i in range(frames):
            img = np.roll(base, 3 * i, axis=1)
            img[(2 * i) % height : (2 * i) % height + 16, :, 0] = 255
            for packet in stream.encode(av.VideoFrame.from_ndarray(img, format="rgb24")):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)


def write_tone(path: Path, seconds: float, rate: int, seed: int) -> None:
    """A stereo FLAC of two sines and a little noise lasting ``seconds``."""
    rng = np.random.default_rng(seed)
    n = int(seconds * rate)
    t = np.arange(n) / rate
    hz = 200 + 50 * (seed % 16)
    wave = np.stack([np.sin(2 * np.pi * hz * t), np.sin(2 * np.pi * 1.5 * hz * t)]) * 0.4
    wave += rng.normal(0, 0.02, wave.shape)
    pcm = (np.clip(wave, -1, 1) * 32767).astype(np.int16)
    with av.open(str(path), "w") as container:
        stream: Any = container.add_stream("flac", rate=rate, layout="stereo")
        fmt = stream.codec_context.format.name
        step = 4096
        for i in range(0, n, step):
            chunk = pcm[:, i : i + step]
            if not fmt.endswith("p"):
                chunk = chunk.T.reshape(1, -1)
            frame = av.AudioFrame.from_ndarray(
                np.ascontiguousarray(chunk), format=fmt, layout="stereo"
            )
            frame.sample_rate = rate
            for packet in stream.encode(frame):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)


def video_tree(root: Path, n: int, seconds: float, width: int, height: int) -> list[Path]:
    """``n`` videos under ``root/train/c<k>/``; returns their paths."""
    paths = []
    for i in range(n):
        path = root / "train" / f"c{i % CLASSES}" / f"v{i:05d}.mp4"
        path.parent.mkdir(parents=True, exist_ok=True)
        write_video(path, round(seconds * FPS), width, height, i)
        paths.append(path)
    return paths


def audio_tree(root: Path, n: int, low_s: float, high_s: float, rate: int) -> list[Path]:
    """``n`` tones of ``low_s``..``high_s`` seconds under ``root/train/c<k>/``."""
    rng = np.random.default_rng(0)
    paths = []
    for i in range(n):
        path = root / "train" / f"c{i % CLASSES}" / f"t{i:05d}.flac"
        path.parent.mkdir(parents=True, exist_ok=True)
        write_tone(path, float(rng.uniform(low_s, high_s)), rate, i)
        paths.append(path)
    return paths
