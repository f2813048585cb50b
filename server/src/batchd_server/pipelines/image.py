"""The image pipeline: JPEG, PNG or WebP bytes to one ``uint8`` ``(3, size, size)`` RGB row.

The recipe, exactly (a test reimplements it and demands equal bytes):

1. **Format** from the magic bytes, never the file name: ``FF D8 FF`` JPEG,
   ``89 50 4E 47 0D 0A 1A 0A`` PNG, ``RIFF????WEBP`` WebP. Anything else is ``corrupt``.
2. **Decode** to RGB (grayscale, palette, RGBA, CMYK are converted with Pillow's
   ``convert("RGB")``, which drops alpha; EXIF orientation is ignored, as torchvision's
   ``pil_loader`` does). JPEG uses simplejpeg (libjpeg-turbo, accurate DCT, fancy upsampling)
   when ``decoder="auto"`` and it is importable, Pillow otherwise; the two give identical
   pixels. If simplejpeg refuses a file (it is strict about libjpeg warnings) or the file is
   CMYK/YCCK, Pillow decodes it, so the decoder choice changes speed, not which files pass.
   Images over twice Pillow's ``Image.MAX_IMAGE_PIXELS`` are ``corrupt`` (decompression
   bombs), whichever decoder is used.
3. **DCT scaling** (JPEG only): the decoder may decode at ``1 / 2**k`` of the size, which is
   much cheaper than decoding at full size and shrinking afterwards. ``k`` is the largest of
   0, 1, 2, 3 with ``short >= target << k``, where ``target`` is the side the step below
   shrinks ``short`` to, and ``k = 0`` when ``target < 8``. The decoded image is
   ``ceil(W / 2**k) x ceil(H / 2**k)`` (simplejpeg ``min_width``/``min_height`` at those
   sizes, or Pillow ``draft("RGB", (W >> k, H >> k))``). Other fractions are never used:
   libjpeg-turbo has no SIMD path for them, so 5/8 is slower than a full decode.
4. **Resize** is torch's antialiased bilinear on ``uint8``:
   ``torch.nn.functional.interpolate(x, size=(h, w), mode="bilinear", antialias=True)``
   with ``x`` the ``(1, 3, H, W)`` image, which is what torchvision's ``Resize`` does to a
   ``uint8`` tensor. It agrees with Pillow's ``BILINEAR`` to within one level and is 2-3x
   faster on this kind of input (``bench/README.md``).
5. **Deterministic** (``random_crop=False``), torchvision's ``Resize(resize)`` then
   ``CenterCrop(size)``: with ``W x H`` the decoded size and ``k`` chosen for
   ``short = min(W, H)``, ``target = resize``, the shorter side becomes ``resize`` and the
   longer ``int(resize * long / short)``, giving ``W' x H'``; the crop starts at
   ``left = round((W' - size) / 2)``, ``top = round((H' - size) / 2)`` (Python ``round``).
   Very long images (``W' > 4 H'``, or ``H' > 4 W'``) would make that resized image huge
   (a 1 x 50,000 banner: gigabytes), so for them only the kept span of the long side is
   resized: for a wide one, columns ``left * W // W'`` up to ``ceil((left + size) * W / W')``
   of the decoded image become the ``size`` columns (likewise rows for a tall one). That is
   within a few levels of the full resize, and the memory stays that of the crop.
6. **Random** (``random_crop=True``): torchvision's ``RandomResizedCrop`` on the full-size
   ``W x H`` (see :func:`random_resized_crop`) gives a box ``(i, j, h, w)``; ``k`` is chosen
   for ``short = min(w, h)``, ``target = size``; the decoded image is cut to rows
   ``i >> k`` up to ``ceil((i + h) / 2**k)`` and columns ``j >> k`` up to
   ``ceil((j + w) / 2**k)`` (the whole box at ``k = 0``, at most one decoded pixel more on a
   side otherwise), and that is resized to ``size x size``.
7. **Flip** (``flip=True``, either path): after the crop's draws, one more
   ``rng.random() < 0.5`` flips the result left-right.
8. The result is written to the row as ``(3, size, size)``.

All randomness comes from ``SampleInfo.rng()``, so every worker decodes a sample the same
way in a given epoch. torch is imported where the resize runs, not with this module: the
server's own process builds pipelines to check a session's options and never needs it. Workers
import it in the background as soon as they are ready and run it single-threaded (see
``workers/worker.py``).
"""

from __future__ import annotations

import io
import math
from collections.abc import Sequence
from typing import TYPE_CHECKING, Final, NamedTuple

import numpy as np
from PIL import Image

from batchd._wire.ring import ceil_div
from batchd._wire.specs import (
    IMAGE_DECODERS,
    IMAGE_DEFAULT_RATIO,
    IMAGE_DEFAULT_SCALE,
    MAX_IMAGE_SIZE,
)
from batchd_server.errors import InvalidArgument
from batchd_server.limits import MAX_CACHED_BUFFER_BYTES
from batchd_server.pipelines.base import BadSample, Block, FieldSpec, Pipeline, SampleInfo

try:
    import simplejpeg
except ImportError:  # pragma: no cover - simplejpeg is an optional speed-up
    simplejpeg = None

if TYPE_CHECKING:
    import torch

__all__ = [
    "DECODERS",
    "MAX_SIZE",
    "Decoded",
    "ImagePipeline",
    "dct_shift",
    "random_resized_crop",
    "sniff",
]

DECODERS: Final = IMAGE_DECODERS
MAX_SIZE: Final = MAX_IMAGE_SIZE
"""Largest ``size`` and ``resize``, as the client's ``batchd.Image`` allows."""
_MIN_DCT_TARGET: Final = 8
_MAX_DCT_SHIFT: Final = 3
_PILLOW_CMYK: Final = ("CMYK", "YCCK")
_MAX_RESIZED_ASPECT: Final = 4
"""Longer than this times the short side after the resize: only the kept span is resized."""

_Rng = np.random.Generator | None
Crop = tuple[int, int, int, int]
"""``(i, j, h, w)``: top, left, height and width of a random crop on the full-size image."""


class Decoded(NamedTuple):
    """An image decoded and planned (:meth:`ImagePipeline.decode_pixels`)."""

    pixels: np.ndarray
    """HWC RGB, decoded at 1 / 2**k of the full size."""
    k: int
    """The DCT shift (step 3)."""
    crop: Crop | None
    """The random crop on the full-size image, None for the centre crop."""
    rng: _Rng
    """The sample's rng after the crop's draws (None when nothing is random)."""
    width: int
    height: int
    """The full-size image's, as its header says."""
    fmt: str
    """``"JPEG"``, ``"PNG"`` or ``"WEBP"``."""


def sniff(data: memoryview | bytes) -> str | None:
    """``"JPEG"``, ``"PNG"`` or ``"WEBP"`` from the first bytes, else ``None``."""
    head = bytes(data[:12])
    if head.startswith(b"\xff\xd8\xff"):
        return "JPEG"
    if head.startswith(b"\x89PNG\r\n\x1a\n"):
        return "PNG"
    if head[:4] == b"RIFF" and head[8:12] == b"WEBP":
        return "WEBP"
    return None


def dct_shift(short_px: int, target_px: int) -> int:
    """The ``k`` of step 3: decode at ``1 / 2**k`` while the short side stays >= target."""
    if target_px < _MIN_DCT_TARGET:
        return 0
    k = 0
    while k < _MAX_DCT_SHIFT and short_px >= target_px << (k + 1):
        k += 1
    return k


def random_resized_crop(
    width: int,
    height: int,
    scale: tuple[float, float],
    ratio: tuple[float, float],
    rng: np.random.Generator,
) -> tuple[int, int, int, int]:
    """torchvision's ``RandomResizedCrop.get_params``, drawing from ``rng``.

    Up to 10 attempts, each drawing ``rng.uniform(*scale)`` (area fraction), then
    ``exp(rng.uniform(log(ratio[0]), log(ratio[1])))`` (aspect ratio); ``w`` and ``h`` are
    rounded; if the crop fits, ``i = rng.integers(0, height - h + 1)`` then
    ``j = rng.integers(0, width - w + 1)``. Otherwise a centre crop of the whole image clamped
    to ``ratio``.

    Returns:
        ``(i, j, h, w)``: top, left, height and width of the crop.
    """
    area = width * height
    log_lo, log_hi = math.log(ratio[0]), math.log(ratio[1])
    for _ in range(10):
        target_area = area * rng.uniform(scale[0], scale[1])
        aspect = math.exp(rng.uniform(log_lo, log_hi))
        w = round(math.sqrt(target_area * aspect))
        h = round(math.sqrt(target_area / aspect))
        if 0 < w <= width and 0 < h <= height:
            i = int(rng.integers(0, height - h + 1))
            j = int(rng.integers(0, width - w + 1))
            return i, j, h, w
    in_ratio = width / height
    if in_ratio < ratio[0]:
        w, h = width, round(width / ratio[0])
    elif in_ratio > ratio[1]:
        w, h = round(height * ratio[1]), height
    else:
        w, h = width, height
    return (height - h) // 2, (width - w) // 2, h, w


def _centre_crop_plan(width: int, height: int, resize: int, size: int) -> tuple[int, int, int, int]:
    """Step 5 of the recipe: ``(new_w, new_h, left, top)`` for a ``width x height`` image."""
    short, long = min(width, height), max(width, height)
    new_long = int(resize * long / short)
    new_w, new_h = (resize, new_long) if width <= height else (new_long, resize)
    return new_w, new_h, round((new_w - size) / 2), round((new_h - size) / 2)


def _kept_span(start: int, size: int, full: int, resized: int) -> slice:
    """The decoded pixels behind ``[start, start + size)`` of a side resized ``full -> resized``."""
    first = start * full // resized
    return slice(first, max(first + 1, min(full, ceil_div((start + size) * full, resized))))


def _pair(name: str, value: Sequence[float], upper: float | None) -> tuple[float, float]:
    try:
        lo, hi = (float(v) for v in value)
    except (TypeError, ValueError):
        raise InvalidArgument(f"{name}={value!r} must be a pair of numbers (low, high)") from None
    if not (0 < lo <= hi and (upper is None or hi <= upper)) or not math.isfinite(hi):
        bound = f" <= {upper}" if upper is not None else ""
        raise InvalidArgument(f"{name}=({lo}, {hi}) must satisfy 0 < low <= high{bound}")
    return lo, hi


class ImagePipeline(Pipeline):
    """Images to ``image``: ``uint8`` ``(3, size, size)``, RGB, following the module recipe.

    Args:
        size: Output side in pixels.
        resize: Deterministic path: the shorter side before the centre crop; 0 means
            ``size``. Must be >= ``size``. Ignored with ``random_crop``.
        random_crop: torchvision-style random-resized crop instead of resize + centre crop.
        flip: Flip left-right with probability 0.5.
        decoder: ``"auto"`` (simplejpeg for JPEG when installed) or ``"pillow"``.
        scale: Random crop's area fraction range.
        ratio: Random crop's aspect ratio (width / height) range.

    Raises:
        InvalidArgument: An argument is out of range.
    """

    def __init__(
        self,
        size: int,
        resize: int = 0,
        random_crop: bool = False,
        flip: bool = False,
        decoder: str = "auto",
        scale: Sequence[float] = IMAGE_DEFAULT_SCALE,
        ratio: Sequence[float] = IMAGE_DEFAULT_RATIO,
    ) -> None:
        if not isinstance(size, int) or not 1 <= size <= MAX_SIZE:
            raise InvalidArgument(f"image size={size!r} must be an integer in 1..{MAX_SIZE}")
        resize = resize or size
        if not isinstance(resize, int) or not size <= resize <= MAX_SIZE:
            raise InvalidArgument(
                f"image resize={resize!r} must be an integer in size={size}..{MAX_SIZE} (the "
                "centre crop is taken from the resized image), or 0 for size"
            )
        if decoder not in DECODERS:
            raise InvalidArgument(f"image decoder={decoder!r} must be one of {DECODERS}")
        self.size = size
        self.resize = resize
        self.random_crop = bool(random_crop)
        self.flip = bool(flip)
        self.decoder = decoder
        self.scale = _pair("scale", scale, upper=1.0)
        self.ratio = _pair("ratio", ratio, upper=None)
        self._simplejpeg = decoder == "auto" and simplejpeg is not None
        self._pixels = np.empty(0, np.uint8)
        """simplejpeg's reused output buffer (see files.py on allocation churn)."""

    def fields(self) -> list[FieldSpec]:
        return [FieldSpec("image", np.dtype(np.uint8), (3, self.size, self.size))]

    def decode_into(self, data: memoryview, sample: SampleInfo, row: Block) -> None:
        decoded = self.decode_pixels(data, sample)
        self.finish_pixels(decoded.pixels, decoded.k, decoded.crop, decoded.rng, row["image"])

    def decode_pixels(self, data: memoryview, sample: SampleInfo) -> Decoded:
        """Steps 1-3 and the crop's draws of step 6: the image decoded at its DCT shift.

        The decode cache (``decode_cache/``) keeps these pixels for a random crop and redoes
        only :meth:`finish_pixels`, so the two together must stay :meth:`decode_into`. The
        pixels may live in a buffer the next decode reuses.

        Raises:
            BadSample: ``corrupt``: not an image this pipeline decodes.
        """
        fmt = sniff(data)
        if fmt is None:
            raise BadSample(
                "corrupt",
                f"{sample.path}: not a JPEG, PNG or WebP image (starts {bytes(data[:8])!r})",
            )
        try:
            decoded = None
            if fmt == "JPEG" and self._simplejpeg:
                decoded = self._simplejpeg_decode(data, sample)
            if decoded is None:
                decoded = self._pillow_decode(data, fmt, sample)
        # Third-party parsers of untrusted bytes raise more than OSError/ValueError (Pillow's
        # PNG plugin raises SyntaxError, bombs raise DecompressionBombError); a bad file must
        # become a BadSample, never a dead worker.
        except Exception as e:
            raise BadSample("corrupt", f"{sample.path}: {fmt} does not decode: {e}") from e
        return decoded

    def finish_pixels(
        self, pixels: np.ndarray, k: int, crop: Crop | None, rng: _Rng, out: np.ndarray
    ) -> None:
        """Steps 4-8 on what :meth:`decode_pixels` gave: the flip's draw, resize, crop."""
        flip = rng is not None and self.flip and rng.random() < 0.5
        self._resize_into(pixels, k, crop, flip, out)

    def _resize_into(
        self, pixels: np.ndarray, k: int, crop: Crop | None, flip: bool, out: np.ndarray
    ) -> None:
        """Steps 4-8: resize and crop ``pixels`` (HWC) into ``out`` (CHW)."""
        import torch  # here, not at module level: see the module docstring

        image = torch.from_numpy(pixels)
        size = self.size
        if crop is None:
            height, width = pixels.shape[:2]
            new_w, new_h, left, top = _centre_crop_plan(width, height, self.resize, size)
            if new_w > _MAX_RESIZED_ASPECT * new_h:
                image = image[:, _kept_span(left, size, width, new_w)]
                new_w, left = size, 0
            elif new_h > _MAX_RESIZED_ASPECT * new_w:
                image = image[_kept_span(top, size, height, new_h)]
                new_h, top = size, 0
        else:
            i, j, h, w = crop
            s = 1 << k
            image = image[i >> k : ceil_div(i + h, s), j >> k : ceil_div(j + w, s)]
            new_w = new_h = size
            left = top = 0
        # (1, 3, H, W) over the HWC pixels without a copy; torch's uint8 antialiased kernel
        # reads this channels-last layout directly.
        resized = torch.nn.functional.interpolate(
            image.permute(2, 0, 1).unsqueeze(0),
            size=(new_h, new_w),
            mode="bilinear",
            antialias=True,
        )
        kept: torch.Tensor = resized[0, :, top : top + size, left : left + size]
        torch.from_numpy(out).copy_(kept.flip(-1) if flip else kept)

    def plan(self, width: int, height: int, jpeg: bool, rng: _Rng) -> tuple[int, Crop | None]:
        """``(k, crop)``: the DCT shift, and the random crop or None for the centre crop."""
        if not self.random_crop:
            return (dct_shift(min(width, height), self.resize) if jpeg else 0), None
        assert rng is not None, "random_crop draws from the sample's rng"
        crop = random_resized_crop(width, height, self.scale, self.ratio, rng)
        _, _, h, w = crop
        return (dct_shift(min(w, h), self.size) if jpeg else 0), crop

    def rng_of(self, sample: SampleInfo) -> _Rng:
        # A fresh stream per decode attempt, so a Pillow fallback draws the same crop.
        return sample.rng() if self.random_crop or self.flip else None

    def _simplejpeg_decode(self, data: memoryview, sample: SampleInfo) -> Decoded | None:
        """The decoded image and its plan, or None where Pillow must decode (see step 2)."""
        assert simplejpeg is not None
        try:
            height, width, colorspace, _ = simplejpeg.decode_jpeg_header(data)
        except ValueError:
            return None
        limit = Image.MAX_IMAGE_PIXELS
        if colorspace in _PILLOW_CMYK or (limit and width * height > 2 * limit):
            # Pillow converts CMYK its own way, and refuses decompression bombs (images over
            # twice MAX_IMAGE_PIXELS) before allocating them; simplejpeg has no such limit.
            return None
        rng = self.rng_of(sample)
        k, crop = self.plan(width, height, True, rng)
        s = 1 << k
        out_h, out_w = ceil_div(height, s), ceil_div(width, s)
        needed = out_h * out_w * 3
        if self._pixels.size < needed <= MAX_CACHED_BUFFER_BYTES:
            self._pixels = np.empty(needed, np.uint8)
        try:
            pixels = simplejpeg.decode_jpeg(
                data,
                colorspace="RGB",
                min_height=out_h if k else 0,
                min_width=out_w if k else 0,
                # A huge image gets a buffer of its own rather than pinning its size.
                buffer=self._pixels if needed <= self._pixels.size else None,
            )
        except ValueError:
            return None
        if pixels.shape != (out_h, out_w, 3):
            return None  # a scale other than 1/2**k: let Pillow follow the recipe exactly
        return Decoded(pixels, k, crop, rng, width, height, "JPEG")

    def _pillow_decode(self, data: memoryview, fmt: str, sample: SampleInfo) -> Decoded:
        image: Image.Image = Image.open(io.BytesIO(data), formats=[fmt])
        width, height = image.size
        rng = self.rng_of(sample)
        k, crop = self.plan(width, height, fmt == "JPEG", rng)
        if k:
            image.draft("RGB", (width >> k, height >> k))
        image.load()
        if image.mode != "RGB":
            image = image.convert("RGB")
        # np.array, not asarray: torch wants writable memory, and asarray's is read-only.
        return Decoded(np.array(image), k, crop, rng, width, height, fmt)
