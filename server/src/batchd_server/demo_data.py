"""A synthetic but realistic JPEG image-folder dataset, for the demo, tests and benchmarks.

Image ``i`` depends only on (seed, i, classes): its class is ``i % classes``, one image in
five of each class goes to ``val``, and its size, aspect ratio, colours, shape, texture and
noise come from a generator seeded with (seed, i). So the same call writes the same bytes, and
a larger ``n`` writes a superset of a smaller one. Each class has its own shape and dominant
hue, with enough jitter, clutter and noise that a tiny CNN has something to learn but cannot
read the label off one pixel.
"""

from __future__ import annotations

import colorsys
import io
import os
from pathlib import Path
from typing import Any

import numpy as np
from PIL import Image, ImageDraw

__all__ = ["class_names", "write_demo_images"]

_SHAPES = ("circle", "square", "triangle", "cross", "ring", "diamond", "bars", "star")
_MIN_SIDE, _MAX_SIDE = 160, 640
_JPEG_QUALITY = 90
_VAL_EVERY = 5  # one image in five of each class is in val: an 80/20 split


def class_names(classes: int) -> list[str]:
    """Directory names of the classes, in label order (their sort order is their index)."""
    if classes < 1:
        raise ValueError(f"classes={classes} must be >= 1")
    return [f"{k:02d}_{_SHAPES[k % len(_SHAPES)]}" for k in range(classes)]


def _rgb(hue: float, saturation: float, value: float) -> tuple[int, int, int]:
    r, g, b = colorsys.hsv_to_rgb(hue % 1.0, saturation, value)
    return int(r * 255), int(g * 255), int(b * 255)


def _shape(
    draw: ImageDraw.ImageDraw,
    kind: str,
    box: tuple[float, float, float, float],
    fill: tuple[int, int, int],
    rng: np.random.Generator,
) -> None:
    x0, y0, x1, y1 = box
    cx, cy, r = (x0 + x1) / 2, (y0 + y1) / 2, (x1 - x0) / 2
    if kind == "circle":
        draw.ellipse(box, fill=fill)
    elif kind == "square":
        draw.rectangle(box, fill=fill)
    elif kind == "triangle":
        draw.polygon([(cx, y0), (x1, y1), (x0, y1)], fill=fill)
    elif kind == "cross":
        w = r / 3
        draw.rectangle((cx - w, y0, cx + w, y1), fill=fill)
        draw.rectangle((x0, cy - w, x1, cy + w), fill=fill)
    elif kind == "ring":
        draw.ellipse(box, outline=fill, width=max(2, int(r / 3)))
    elif kind == "diamond":
        draw.polygon([(cx, y0), (x1, cy), (cx, y1), (x0, cy)], fill=fill)
    elif kind == "bars":
        step = (x1 - x0) / 5
        for j in range(0, 5, 2):
            draw.rectangle((x0 + j * step, y0, x0 + (j + 1) * step, y1), fill=fill)
    else:  # star
        angles = np.arange(10) * np.pi / 5 + rng.uniform(0, np.pi)
        radii = np.where(np.arange(10) % 2 == 0, r, r * 0.45)
        xs, ys = cx + radii * np.cos(angles), cy + radii * np.sin(angles)
        draw.polygon(list(zip(xs.tolist(), ys.tolist(), strict=True)), fill=fill)


def _render(seed: int, index: int, label: int, classes: int) -> bytes:
    """The JPEG bytes of image ``index``."""
    rng = np.random.default_rng([seed, index])
    width, height = (int(v) for v in rng.integers(_MIN_SIDE, _MAX_SIDE + 1, size=2))
    hue = label / classes + rng.normal(0, 0.02)

    # Background: a gradient between two unrelated colours, so colour alone is a weak cue.
    a = np.array(_rgb(rng.random(), rng.uniform(0.1, 0.5), rng.uniform(0.3, 0.9)), np.float32)
    b = np.array(_rgb(rng.random(), rng.uniform(0.1, 0.5), rng.uniform(0.3, 0.9)), np.float32)
    t = np.linspace(0.0, 1.0, width, dtype=np.float32)[None, :, None]
    if rng.random() < 0.5:
        t = np.linspace(0.0, 1.0, height, dtype=np.float32)[:, None, None]
    background = a + (b - a) * t
    img = Image.fromarray(np.broadcast_to(background, (height, width, 3)).astype(np.uint8))

    draw = ImageDraw.Draw(img)
    # Clutter: a few thin lines of random colours (texture that carries no label).
    for _ in range(int(rng.integers(2, 8))):
        pts = rng.uniform(0, 1, 4) * (width, height, width, height)
        draw.line(tuple(pts), fill=_rgb(rng.random(), 0.4, 0.8), width=int(rng.integers(1, 4)))
    # The class: its shape in its hue, at a random place and scale.
    side = min(width, height) * rng.uniform(0.35, 0.75)
    x0 = rng.uniform(0, width - side)
    y0 = rng.uniform(0, height - side)
    fill = _rgb(hue, rng.uniform(0.6, 1.0), rng.uniform(0.6, 1.0))
    _shape(draw, _SHAPES[label % len(_SHAPES)], (x0, y0, x0 + side, y0 + side), fill, rng)

    # Sensor-like noise, drawn at a quarter of the resolution and upscaled (cheaper, blotchy).
    small = rng.normal(0, 12, size=(height // 4 + 1, width // 4 + 1, 3)).astype(np.float32)
    noise = small.repeat(4, axis=0).repeat(4, axis=1)[:height, :width]
    pixels = np.asarray(img, dtype=np.float32) + noise
    out = Image.fromarray(np.clip(pixels, 0, 255).astype(np.uint8))
    buf = io.BytesIO()
    out.save(buf, format="JPEG", quality=_JPEG_QUALITY)
    return buf.getvalue()


def _write_if_changed(path: Path, data: bytes) -> bool:
    """Write ``data`` atomically unless the file already holds it; True when written."""
    try:
        if path.stat().st_size == len(data) and path.read_bytes() == data:
            return False
    except FileNotFoundError:
        pass
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    tmp.write_bytes(data)
    os.replace(tmp, path)
    return True


def write_demo_images(out: Path, n: int, *, seed: int = 0, classes: int = 4) -> dict[str, Any]:
    """Write ``n`` JPEGs as ``out/{train,val}/<class>/<index>.jpg`` (80/20, balanced classes).

    Deterministic given ``seed`` and idempotent: a re-run leaves identical files untouched.
    Sides are 160-640 px with varied aspect ratios, JPEG quality 90.

    Returns:
        ``root`` (str), ``images`` (n), ``written`` (files created or changed), ``bytes``
        (total JPEG bytes), ``classes`` (class names in label order) and ``splits``
        (images per split).
    """
    if n < 0:
        raise ValueError(f"n={n} must be >= 0")
    out = Path(out)
    names = class_names(classes)
    splits = {"train": 0, "val": 0}
    written = total_bytes = 0
    for index in range(n):
        label = index % classes
        # The second image of each class is in val, so even a tiny demo has both splits.
        split = "val" if (index // classes) % _VAL_EVERY == 1 else "train"
        splits[split] += 1
        folder = out / split / names[label]
        folder.mkdir(parents=True, exist_ok=True)
        data = _render(seed, index, label, classes)
        written += _write_if_changed(folder / f"{index:06d}.jpg", data)
        total_bytes += len(data)
    return {
        "root": str(out),
        "images": n,
        "written": written,
        "bytes": total_bytes,
        "classes": names,
        "splits": splits,
    }
