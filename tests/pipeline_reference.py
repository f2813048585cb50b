"""Independent implementations of the image pipeline's documented recipe, and helpers to run
one sample through any pipeline.

The recipe is in ``batchd_server/pipelines/image.py``'s docstring; the functions here follow it
step by step with simplejpeg, Pillow and torch directly, so that server unit tests and end-to-end
tests can compare what batchd serves with an independent decode of the same bytes.
"""

from __future__ import annotations

import io
import math
from fractions import Fraction
from typing import Any

import numpy as np
import pytest
import simplejpeg
import torch
from PIL import Image

from batchd_server.pipelines import BadSample, Pipeline, SampleInfo, sample_rng


def photo(width: int, height: int, seed: int = 0) -> np.ndarray:
    """A photo-like RGB array: gradients, a hard-edged shape and noise."""
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:height, 0:width].astype(np.float32)
    base = np.stack([255 * x / width, 255 * y / height, 128 + 100 * np.sin(x / 7 + y / 11)], -1)
    base[height // 4 : height // 2, width // 3 : width // 2] = (250, 20, 60)
    noisy = base + rng.normal(0, 10, base.shape)
    return noisy.clip(0, 255).astype(np.uint8)


def encode(pixels: np.ndarray, fmt: str, mode: str = "RGB", **save: Any) -> bytes:
    out = io.BytesIO()
    Image.fromarray(pixels).convert(mode).save(out, format=fmt, **save)
    return out.getvalue()


def info(sample_id: int = 7, epoch: int = 0, seed: int = 1, path: str = "x") -> SampleInfo:
    return SampleInfo(sample_id=sample_id, label=0, path=path, length=-1, seed=seed, epoch=epoch)


def decode_row(pipeline: Pipeline, data: bytes, sample: SampleInfo | None = None) -> Any:
    """One sample through ``pipeline``; the row dict, or the single field's array."""
    row = {f.name: np.zeros(f.shape, f.dtype) for f in pipeline.fields()}
    pipeline.decode_into(memoryview(data), sample or info(), row)
    return row.get("image", row)


def bad_kind(pipeline: Pipeline, data: bytes) -> str:
    with pytest.raises(BadSample) as caught:
        decode_row(pipeline, data)
    return caught.value.kind


def reference_shift(short: int, target: int) -> int:
    """Step 3 of the recipe: the largest k <= 3 with short >= target * 2**k (0 below 8)."""
    if target < 8:
        return 0
    return max(k for k in range(4) if short >= target * 2**k)


def reference_decode(data: bytes, shift: Any) -> np.ndarray:
    """Steps 1-3 without the pipeline: simplejpeg for JPEG, Pillow for the rest; HWC RGB."""
    image = Image.open(io.BytesIO(data))
    width, height = image.size
    if image.format != "JPEG":
        return np.asarray(image.convert("RGB"))
    k = shift(width, height)
    if k == 0:
        return simplejpeg.decode_jpeg(data)
    scaled_w, scaled_h = math.ceil(width / 2**k), math.ceil(height / 2**k)
    pixels = simplejpeg.decode_jpeg(data, min_width=scaled_w, min_height=scaled_h)
    assert pixels.shape == (scaled_h, scaled_w, 3)
    return pixels


def resize(pixels: np.ndarray, height: int, width: int) -> np.ndarray:
    """Step 4: torch's antialiased bilinear, HWC uint8 in, CHW uint8 out."""
    chw = torch.from_numpy(np.array(pixels)).permute(2, 0, 1).contiguous()
    out = torch.nn.functional.interpolate(
        chw[None], size=(height, width), mode="bilinear", antialias=True
    )
    return out[0].numpy()


def resize_centre(
    pixels: np.ndarray, size: int, resize_to: int, *, long_span: bool = True
) -> np.ndarray:
    """Steps 4, 5 and 8, as torchvision's Resize(resize_to) + CenterCrop(size) compute them;
    ``long_span=False`` resizes very long images in full too (for comparison only)."""
    height, width = pixels.shape[:2]
    short, long = min(width, height), max(width, height)
    long_resized = int(resize_to * long / short)
    new_w, new_h = (resize_to, long_resized) if width <= height else (long_resized, resize_to)
    top, left = round((new_h - size) / 2.0), round((new_w - size) / 2.0)
    # Very long images: only the kept span of the long side is resized.
    if long_span and new_w > 4 * new_h:
        first = left * width // new_w
        last = max(first + 1, min(width, math.ceil(Fraction((left + size) * width, new_w))))
        return resize(pixels[:, first:last], new_h, size)[:, top : top + size]
    if long_span and new_h > 4 * new_w:
        first = top * height // new_h
        last = max(first + 1, min(height, math.ceil(Fraction((top + size) * height, new_h))))
        return resize(pixels[first:last], size, new_w)[:, :, left : left + size]
    return resize(pixels, new_h, new_w)[:, top : top + size, left : left + size]


def reference_centre(data: bytes, size: int, resize_to: int) -> np.ndarray:
    """Steps 1-5 and 8: DCT-scaled decode, resize the shorter side, centre crop, CHW."""
    pixels = reference_decode(data, lambda w, h: reference_shift(min(w, h), resize_to))
    return resize_centre(pixels, size, resize_to)


def reference_random(data: bytes, size: int, sample: SampleInfo, flip: bool) -> np.ndarray:
    """Steps 1-4 and 6-8: torchvision's RandomResizedCrop drawn from the sample's rng."""
    original = Image.open(io.BytesIO(data))
    width, height = original.size
    rng = sample_rng(sample.seed, sample.epoch, sample.sample_id)
    for _ in range(10):
        area = width * height * rng.uniform(0.08, 1.0)
        aspect = math.exp(rng.uniform(math.log(3 / 4), math.log(4 / 3)))
        w, h = round(math.sqrt(area * aspect)), round(math.sqrt(area / aspect))
        if 0 < w <= width and 0 < h <= height:
            i, j = int(rng.integers(0, height - h + 1)), int(rng.integers(0, width - w + 1))
            break
    else:
        raise AssertionError("these tests use images where a crop is always found")
    k = reference_shift(min(w, h), size) if original.format == "JPEG" else 0
    pixels = reference_decode(data, lambda _w, _h: k)
    s = 2**k
    cut = pixels[i // s : math.ceil((i + h) / s), j // s : math.ceil((j + w) / s)]
    out = resize(cut, size, size)
    if flip and rng.random() < 0.5:
        out = out[:, :, ::-1]
    return out
