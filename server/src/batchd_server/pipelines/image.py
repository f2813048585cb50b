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
4. **Deterministic** (``random_crop=False``): with ``W x H`` the decoded size and ``k``
   chosen for ``short = min(W, H)``, ``target = resize``, the shorter side is resized to
   ``resize`` and the longer to ``round(long * resize / short)`` (Python ``round``), giving
   ``W' x H'``; the centre crop starts at ``ox = (W' - size) // 2``, ``oy = (H' - size) // 2``.
   Only the kept pixels are computed::

       box = (ox * W / W', oy * H / H', (ox + size) * W / W', (oy + size) * H / H')
       image.resize((size, size), Image.Resampling.BILINEAR, box=box)

5. **Random** (``random_crop=True``): torchvision's ``RandomResizedCrop`` on the full-size
   ``W x H`` (see :func:`random_resized_crop`) gives a box ``(i, j, h, w)``; ``k`` is chosen
   for ``short = min(w, h)``, ``target = size``; then, with ``s = 2**k``,
   ``image.resize((size, size), BILINEAR, box=(j / s, i / s, (j + w) / s, (i + h) / s))``.
6. **Flip** (``flip=True``, either path): after the crop's draws, one more
   ``rng.random() < 0.5`` flips the result left-right.
7. The ``(size, size, 3)`` result is written transposed to the row's ``(3, size, size)``.

All randomness comes from ``SampleInfo.rng()``, so every worker decodes a sample the same
way in a given epoch.
"""

from __future__ import annotations

import io
import math
from collections.abc import Sequence
from typing import Final

import numpy as np
from PIL import Image

from batchd_server.errors import InvalidArgument
from batchd_server.pipelines.base import BadSample, Block, FieldSpec, Pipeline, SampleInfo
from batchd_server.pipelines.files import MAX_CACHED_BUFFER_BYTES

try:
    import simplejpeg
except ImportError:  # pragma: no cover - simplejpeg is an optional speed-up
    simplejpeg = None

__all__ = ["DECODERS", "MAX_SIZE", "ImagePipeline", "dct_shift", "random_resized_crop", "sniff"]

DECODERS: Final = ("auto", "pillow")
MAX_SIZE: Final = 16384
"""Largest ``size`` and ``resize``, as the client's ``batchd.Image`` allows."""
_MIN_DCT_TARGET: Final = 8
_MAX_DCT_SHIFT: Final = 3
_BILINEAR: Final = Image.Resampling.BILINEAR
_PILLOW_CMYK: Final = ("CMYK", "YCCK")

Box = tuple[float, float, float, float]
_Rng = np.random.Generator | None
_Decoded = tuple[Image.Image, _Rng]


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


def _centre_box(width: int, height: int, resize: int, size: int) -> Box:
    if width <= height:
        new_w, new_h = resize, round(height * resize / width)
    else:
        new_w, new_h = round(width * resize / height), resize
    ox, oy = (new_w - size) // 2, (new_h - size) // 2
    return (
        ox * width / new_w,
        oy * height / new_h,
        (ox + size) * width / new_w,
        (oy + size) * height / new_h,
    )


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
        scale: Sequence[float] = (0.08, 1.0),
        ratio: Sequence[float] = (3 / 4, 4 / 3),
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
        fmt = sniff(data)
        if fmt is None:
            raise BadSample(
                "corrupt",
                f"{sample.path}: not a JPEG, PNG or WebP image (starts {bytes(data[:8])!r})",
            )
        try:
            decoded = None
            if fmt == "JPEG" and self._simplejpeg:
                decoded = self._simplejpeg_crop(data, sample)
            if decoded is None:
                decoded = self._pillow_crop(data, fmt, sample)
        # Third-party parsers of untrusted bytes raise more than OSError/ValueError (Pillow's
        # PNG plugin raises SyntaxError, bombs raise DecompressionBombError); a bad file must
        # become a BadSample, never a dead worker.
        except Exception as e:
            raise BadSample("corrupt", f"{sample.path}: {fmt} does not decode: {e}") from e
        image, rng = decoded
        flip = rng is not None and self.flip and rng.random() < 0.5
        out = row["image"]
        # One band at a time: Pillow packs a band contiguously in C, and the plane copy is
        # contiguous too; this is 2.5x faster than assigning np.asarray(image).transpose(2, 0,
        # 1), whose 3-byte inner stride numpy copies one byte at a time.
        for c, band in enumerate("RGB"):
            plane = np.frombuffer(image.tobytes("raw", band), np.uint8).reshape(out.shape[1:])
            out[c] = plane[:, ::-1] if flip else plane

    def _plan(self, width: int, height: int, jpeg: bool, rng: _Rng) -> tuple[int, Box | None]:
        """``(k, box)``: box in decoded coordinates, or None for the centre crop of step 4."""
        if not self.random_crop:
            return (dct_shift(min(width, height), self.resize) if jpeg else 0), None
        assert rng is not None, "random_crop draws from the sample's rng"
        i, j, h, w = random_resized_crop(width, height, self.scale, self.ratio, rng)
        k = dct_shift(min(w, h), self.size) if jpeg else 0
        s = 1 << k
        return k, (j / s, i / s, (j + w) / s, (i + h) / s)

    def _finish(self, image: Image.Image, box: Box | None) -> Image.Image:
        if box is None:
            box = _centre_box(image.width, image.height, self.resize, self.size)
        return image.resize((self.size, self.size), _BILINEAR, box=box)

    def _rng(self, sample: SampleInfo) -> _Rng:
        # A fresh stream per decode attempt, so a Pillow fallback draws the same crop.
        return sample.rng() if self.random_crop or self.flip else None

    def _simplejpeg_crop(self, data: memoryview, sample: SampleInfo) -> _Decoded | None:
        """The cropped image, or None where Pillow must decode instead (see step 2)."""
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
        rng = self._rng(sample)
        k, box = self._plan(width, height, True, rng)
        s = 1 << k
        out_h, out_w = -(-height // s), -(-width // s)
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
        return self._finish(Image.fromarray(pixels), box), rng

    def _pillow_crop(self, data: memoryview, fmt: str, sample: SampleInfo) -> _Decoded:
        image: Image.Image = Image.open(io.BytesIO(data), formats=[fmt])
        width, height = image.size
        rng = self._rng(sample)
        k, box = self._plan(width, height, fmt == "JPEG", rng)
        if k:
            image.draft("RGB", (width >> k, height >> k))
        image.load()
        if image.mode != "RGB":
            image = image.convert("RGB")
        return self._finish(image, box), rng
