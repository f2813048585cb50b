"""Test support for decoder fuzzing: valid samples of every built-in format, and a seeded
mutator that truncates them and damages their bytes (headers especially).

Seeded, not random per run: a failure names the seed and the file, and the same run
reproduces it exactly.
"""

from __future__ import annotations

import io
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from PIL import Image

__all__ = ["FORMATS", "Fuzzed", "mutate", "valid_samples", "write_fuzzed"]

FORMATS = ("jpeg", "png", "npy", "tokens")
NPY_SHAPE = (8,)
MAX_TOKENS = 16


def _image(rng: np.random.Generator, width: int, height: int) -> np.ndarray:
    """Smooth gradients plus noise: compresses like a photo, not like pure noise."""
    y, x = np.mgrid[0:height, 0:width]
    base = np.stack([x * 255 // max(width - 1, 1), y * 255 // max(height - 1, 1), (x + y) % 256])
    noise = rng.integers(0, 40, (3, height, width))
    return np.clip(base + noise, 0, 255).astype(np.uint8).transpose(1, 2, 0)


def valid_samples(fmt: str, rng: np.random.Generator) -> list[bytes]:
    """A handful of valid, varied samples of ``fmt``."""
    out: list[bytes] = []
    if fmt in ("jpeg", "png"):
        for width, height in ((24, 24), (40, 17), (9, 33)):
            pixels = _image(rng, width, height)
            for mode in ("RGB", "L", "P", "RGBA"):
                if fmt == "jpeg" and mode in ("P", "RGBA"):
                    continue
                image = Image.fromarray(pixels).convert(mode)
                buffer = io.BytesIO()
                if fmt == "jpeg":
                    image.save(buffer, "JPEG", quality=80, progressive=mode == "L")
                else:
                    image.save(buffer, "PNG")
                out.append(buffer.getvalue())
    elif fmt == "npy":
        values = rng.standard_normal(NPY_SHAPE).astype(np.float32)
        for stored, version in ((values, (1, 0)), (values.astype(">f4"), (1, 0)), (values, (2, 0))):
            buffer = io.BytesIO()
            np.lib.format.write_array(buffer, stored, version=version)
            out.append(buffer.getvalue())
    elif fmt == "tokens":
        for n in (1, 5, MAX_TOKENS, MAX_TOKENS + 7):
            out.append(rng.integers(0, 50_000, n).astype("<i4").tobytes())
    else:
        raise ValueError(fmt)
    return out


def mutate(blob: bytes, rng: np.random.Generator) -> bytes:
    """``blob`` with one to three damages: a truncation, flipped bytes (anywhere, or in its
    first 64 bytes, where the headers are), a run overwritten with 0x00, 0xFF or noise, a run
    deleted, or noise inserted."""
    data = bytearray(blob)
    for _ in range(int(rng.integers(1, 4))):
        op = int(rng.integers(6))
        n = len(data)
        if op == 0 and n:
            del data[int(rng.integers(0, n)) :]
        elif op in (1, 2) and n:
            span = min(n, 64) if op == 2 else n
            for at in rng.integers(0, span, int(rng.integers(1, 9))).tolist():
                data[at] ^= int(rng.integers(1, 256))
        elif op == 3 and n:
            at, k = int(rng.integers(0, n)), int(rng.integers(1, 17))
            fill = [b"\x00" * k, b"\xff" * k, rng.bytes(k)][int(rng.integers(3))]
            data[at : at + k] = fill[: len(data[at : at + k])]
        elif op == 4 and n:
            at = int(rng.integers(0, n))
            del data[at : at + int(rng.integers(1, 33))]
        else:
            at = int(rng.integers(0, n + 1))
            data[at:at] = rng.bytes(int(rng.integers(1, 33)))
    return bytes(data)


@dataclass(frozen=True)
class Fuzzed:
    """Mutated samples of one format written as files under ``root``."""

    fmt: str
    root: Path
    paths: list[str]
    """Relative to ``root``, in order."""
    pipeline: tuple[str, dict[str, Any]]
    """The built-in pipeline that decodes the format: (kind, options)."""


def write_fuzzed(fmt: str, root: Path, count: int, seed: int) -> Fuzzed:
    """``count`` mutated samples of ``fmt`` (every fourth one left valid, so batches mix
    good and bad samples) as files ``root/<fmt>-<i>.bin``."""
    rng = np.random.default_rng(seed)
    bases = valid_samples(fmt, rng)
    root.mkdir(parents=True, exist_ok=True)
    paths = []
    for i in range(count):
        blob = bases[i % len(bases)]
        if i % 4:
            blob = mutate(blob, rng)
        path = f"{fmt}-{i:05d}.bin"
        (root / path).write_bytes(blob)
        paths.append(path)
    pipelines: dict[str, tuple[str, dict[str, Any]]] = {
        "jpeg": ("image", {"size": 16, "resize": 20}),
        "png": ("image", {"size": 16, "random_crop": True, "flip": True}),
        "npy": ("array", {"shape": NPY_SHAPE, "dtype": "float32"}),
        "tokens": ("tokens", {"max_len": MAX_TOKENS, "dtype": "int32"}),
    }
    return Fuzzed(fmt, root, paths, pipelines[fmt])


def manifest(fuzzed: Fuzzed, path: Path) -> Path:
    """A JSONL manifest of ``fuzzed``'s files (split train)."""
    rows = [{"path": p, "split": "train", "label": i % 3} for i, p in enumerate(fuzzed.paths)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path
