"""Test support: short synthetic videos and tones encoded with PyAV (its bundled FFmpeg), and
folder trees of them; never downloaded. Also a reference decode of a clip written with PyAV
directly, the way ``pipelines/video.py``'s recipe says, to compare served frames with.
"""

from __future__ import annotations

import io
import wave
from pathlib import Path
from typing import Any

import av
import numpy as np

FPS = 25


def encode_video(
    n: int = 40,
    width: int = 96,
    height: int = 64,
    *,
    codec: str = "mpeg4",
    fmt: str = "mp4",
    gop: int = 8,
    seed: int = 0,
) -> bytes:
    """``n`` frames at 25 fps: each a distinct shade with a moving bar, so frames differ."""
    buf = io.BytesIO()
    with av.open(buf, "w", format=fmt) as container:
        stream: Any = container.add_stream(codec, rate=FPS)
        stream.width, stream.height, stream.pix_fmt = width, height, "yuv420p"
        stream.codec_context.gop_size = gop
        for i in range(n):
            img = np.full((height, width, 3), (seed * 37 + i * 6) % 256, np.uint8)
            img[:, (i * 3) % width] = 255
            img[(i * 2) % height, :, 1] = 0
            for packet in stream.encode(av.VideoFrame.from_ndarray(img, format="rgb24")):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)
    return buf.getvalue()


def encode_tone(
    seconds: float, rate: int = 22050, *, fmt: str = "wav", codec: str = "pcm_s16le", hz: int = 440
) -> bytes:
    """A stereo sine of ``hz`` (left) and ``2 * hz`` (right) lasting ``seconds``."""
    buf = io.BytesIO()
    with av.open(buf, "w", format=fmt) as container:
        stream: Any = container.add_stream(codec, rate=rate, layout="stereo")
        ctx = stream.codec_context
        n = int(seconds * rate)
        t = np.arange(n) / rate
        wave_ = np.stack([np.sin(2 * np.pi * hz * t), np.sin(2 * np.pi * 2 * hz * t)]) * 0.5
        step = ctx.frame_size or 1024
        name = ctx.format.name
        for i in range(0, n, step):
            chunk = wave_[:, i : i + step]
            if name.startswith("s16"):
                chunk = (chunk * 32767).astype(np.int16)
            elif name.startswith("s32"):
                chunk = (chunk * 2**31 * 0.99).astype(np.int32)
            else:
                chunk = chunk.astype(np.float32)
            if not name.endswith("p"):
                chunk = chunk.T.reshape(1, -1)
            frame = av.AudioFrame.from_ndarray(
                np.ascontiguousarray(chunk), format=name, layout="stereo"
            )
            frame.sample_rate = rate
            for packet in stream.encode(frame):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)
    return buf.getvalue()


def empty_wav() -> bytes:
    """A valid WAV header with zero samples."""
    buf = io.BytesIO()
    with wave.open(buf, "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(16000)
        w.writeframes(b"")
    return buf.getvalue()


def write_tree(root: Path, files: dict[str, bytes]) -> None:
    """``files`` (paths relative to ``root``) written under it."""
    for rel, data in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)


def video_tree(root: Path, n: int, *, frames: int = 40) -> dict[str, bytes]:
    """``n`` videos of two classes under ``root/train/<class>/``, lengths varying by 7s."""
    files = {
        f"train/{'ab'[i % 2]}/v{i:03d}.mp4": encode_video(frames + 7 * (i % 3), seed=i)
        for i in range(n)
    }
    write_tree(root, files)
    return files


def reference_clip(data: bytes, indices: list[int], size: int) -> np.ndarray:
    """The ``(T, 3, size, size)`` frames ``indices`` of a video, decoded from its start with
    PyAV and resized with FFmpeg's bilinear scaler as the recipe says (no seeking)."""
    frames: dict[int, np.ndarray] = {}
    with av.open(io.BytesIO(data)) as container:
        stream = container.streams.video[0]
        rate = float(stream.average_rate)
        start = stream.start_time or 0
        for frame in container.decode(stream):
            index = round(float((frame.pts - start) * stream.time_base) * rate)
            if index not in indices:
                continue
            short, long = min(frame.width, frame.height), max(frame.width, frame.height)
            new_long = max(size, int(size * long / short))
            w, h = (size, new_long) if frame.width <= frame.height else (new_long, size)
            rgb = frame.reformat(
                width=w, height=h, format="rgb24", interpolation="BILINEAR"
            ).to_ndarray()
            left, top = round((w - size) / 2), round((h - size) / 2)
            frames[index] = rgb[top : top + size, left : left + size].transpose(2, 0, 1)
    return np.stack([frames[i] for i in indices])


def reference_audio(
    data: bytes, rate: int, start: int, count: int, *, mono: bool = True, fmt: str = "flt"
) -> np.ndarray:
    """Output samples ``start .. start + count`` of a file resampled from its start with one
    ``av.AudioResampler``, ``(C, n)``."""
    channels = 1 if mono else 2
    parts = []
    with av.open(io.BytesIO(data)) as container:
        resampler = av.AudioResampler(format=fmt, layout="mono" if mono else "stereo", rate=rate)
        stream = container.streams.audio[0]
        for frame in [*container.decode(stream), None]:
            for out in resampler.resample(frame):
                parts.append(out.to_ndarray().reshape(-1, channels))
    whole = np.concatenate(parts)
    return whole[start : start + count].T
