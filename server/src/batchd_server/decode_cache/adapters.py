"""What each pipeline caches and how a cached entry becomes the row the pipeline would write.

NOTE [ Exact from the cache ]
A row served from the cache must be, byte for byte, the row the pipeline writes without it.
Each adapter caches the output of a prefix of its pipeline that depends on nothing random,
and on a hit redoes exactly the rest, with the same code on the same input:

* ``Image(random_crop=False)``: the finished row, before the flip. Without ``flip`` the row is
  copied back as it is; with it, the sample's rng draws the flip as
  :meth:`ImagePipeline.finish_pixels` does (the only draw in that mode), and the row is
  reversed along its width when it says so, which is what torch's ``flip(-1)`` writes.
* ``Image(random_crop=True)``: the decoded pixels (:meth:`ImagePipeline.decode_pixels`), with
  the full-size width and height, the format and the DCT shift ``k`` they were decoded at.
  On a hit the crop is drawn from a fresh rng for this epoch (:meth:`ImagePipeline.plan` on
  the stored size), and if it wants the same ``k``, :meth:`ImagePipeline.finish_pixels` crops,
  resizes and flips the stored pixels. A crop that wants another ``k`` (a decode at another
  scale gives other pixels) looks up the sample's entry for that ``k`` (a variant, whose key
  adds ``k``); without one the sample is decoded as without the cache, and that entry added.
* ``Array``: the finished row. ``Tokens``: the row's tokens (up to its length) and the
  length; padding and the mask are the batch's ``finish``, which runs as always.
* Custom decoders are not cached: nothing says they are deterministic.

Rows decoded a batch at a time from byte-range records (``Pipeline.decode_batch``) do not
go through the cache at all: their decode is one vectorised copy of bytes already read.
"""

from __future__ import annotations

import json
from abc import ABC, abstractmethod
from typing import Any

import numpy as np

from batchd_server.decode_cache.entry import Entry
from batchd_server.pipelines.array import ArrayPipeline
from batchd_server.pipelines.base import Block, Pipeline, SampleInfo
from batchd_server.pipelines.image import ImagePipeline
from batchd_server.pipelines.tokens import TokensPipeline

__all__ = ["Adapter", "adapter_for"]


class Adapter(ABC):
    """How one pipeline's samples are cached; NOTE [ Exact from the cache ]."""

    recipe: str
    """What shapes the cached arrays, for the key (``keys.py``)."""

    @abstractmethod
    def decode(self, data: memoryview, sample: SampleInfo, row: Block) -> Entry:
        """Decode as the pipeline does, into ``row``; return what to cache.

        Raises:
            BadSample: As the pipeline's ``decode_into``.
        """

    def variant(self, entry: Entry, sample: SampleInfo) -> str:
        """ "" when ``entry`` (under the sample's first key) serves this decode; else the
        variant of the entry that would, whose key adds this string."""
        return ""

    @abstractmethod
    def load(self, entry: Entry, sample: SampleInfo, row: Block) -> bool:
        """Write ``row`` from a cached entry; False when the entry does not serve this
        sample's decode (nothing usable was written: decode it)."""


def _recipe(**parts: Any) -> str:
    return json.dumps(parts, sort_keys=True)


def _same(array: Any, like: np.ndarray) -> bool:
    return isinstance(array, np.ndarray) and array.shape == like.shape and array.dtype == like.dtype


class _ImageRows(Adapter):
    """``Image(random_crop=False)``: the row before the flip."""

    def __init__(self, pipeline: ImagePipeline) -> None:
        self.pipeline = pipeline
        self.recipe = _recipe(
            stage="image-row", size=pipeline.size, resize=pipeline.resize, decoder=pipeline.decoder
        )

    def _flipped(self, sample: SampleInfo) -> bool:
        rng = self.pipeline.rng_of(sample)
        return rng is not None and self.pipeline.flip and rng.random() < 0.5

    def decode(self, data: memoryview, sample: SampleInfo, row: Block) -> Entry:
        self.pipeline.decode_into(data, sample, row)
        out = row["image"]
        return {}, {"image": out[..., ::-1] if self._flipped(sample) else out}

    def load(self, entry: Entry, sample: SampleInfo, row: Block) -> bool:
        out = row["image"]
        image = entry[1].get("image")
        if not _same(image, out):
            return False
        assert image is not None
        np.copyto(out, image[..., ::-1] if self._flipped(sample) else image)
        return True


class _ImagePixels(Adapter):
    """``Image(random_crop=True)``: the decoded pixels; the crop, resize and flip are redone."""

    def __init__(self, pipeline: ImagePipeline) -> None:
        self.pipeline = pipeline
        # The pixels depend on the decoder and k only (k is in the entry and checked).
        self.recipe = _recipe(stage="image-pixels", decoder=pipeline.decoder)

    def decode(self, data: memoryview, sample: SampleInfo, row: Block) -> Entry:
        d = self.pipeline.decode_pixels(data, sample)
        self.pipeline.finish_pixels(d.pixels, d.k, d.crop, d.rng, row["image"])
        return {"w": d.width, "h": d.height, "k": d.k, "fmt": d.fmt}, {"pixels": d.pixels}

    def _want(self, entry: Entry, sample: SampleInfo) -> int | None:
        """The DCT shift this epoch's crop of the sample wants; None for a bad entry."""
        meta = entry[0]
        try:
            width, height, jpeg = int(meta["w"]), int(meta["h"]), meta["fmt"] == "JPEG"
        except (KeyError, TypeError, ValueError):
            return None
        if min(width, height) < 1:
            return None
        return self.pipeline.plan(width, height, jpeg, self.pipeline.rng_of(sample))[0]

    def variant(self, entry: Entry, sample: SampleInfo) -> str:
        # Pixels decoded at another scale are other pixels: each k has an entry of its own.
        want = self._want(entry, sample)
        return "" if want is None or want == entry[0].get("k") else f"k={want}"

    def load(self, entry: Entry, sample: SampleInfo, row: Block) -> bool:
        meta, arrays = entry
        pixels = arrays.get("pixels")
        try:
            width, height, k, jpeg = int(meta["w"]), int(meta["h"]), int(meta["k"]), meta["fmt"]
        except (KeyError, TypeError, ValueError):
            return False
        if (
            pixels is None
            or pixels.dtype != np.uint8
            or pixels.ndim != 3
            or pixels.shape[2] != 3
            or min(width, height) < 1
        ):
            return False
        rng = self.pipeline.rng_of(sample)
        want, crop = self.pipeline.plan(width, height, jpeg == "JPEG", rng)
        if want != k:
            return False
        self.pipeline.finish_pixels(pixels, k, crop, rng, row["image"])
        return True


class _Rows(Adapter):
    """``Array``: every field's finished row."""

    def __init__(self, pipeline: ArrayPipeline) -> None:
        self.pipeline = pipeline
        self.recipe = _recipe(
            stage="array-row",
            shape=list(pipeline.shape),
            dtype=pipeline.dtype.str,
            raw=pipeline.raw,
        )

    def decode(self, data: memoryview, sample: SampleInfo, row: Block) -> Entry:
        self.pipeline.decode_into(data, sample, row)
        return {}, {"array": row["array"]}

    def load(self, entry: Entry, sample: SampleInfo, row: Block) -> bool:
        out = row["array"]
        array = entry[1].get("array")
        if array is None or not _same(array, out):
            return False
        np.copyto(out, array)
        return True


class _Tokens(Adapter):
    """``Tokens``: the tokens kept and their count; ``finish`` pads as always."""

    def __init__(self, pipeline: TokensPipeline) -> None:
        self.pipeline = pipeline
        self.recipe = _recipe(stage="tokens", max_len=pipeline.max_len, dtype=pipeline.dtype.str)

    def decode(self, data: memoryview, sample: SampleInfo, row: Block) -> Entry:
        self.pipeline.decode_into(data, sample, row)
        n = int(row["length"])
        return {}, {"input_ids": row["input_ids"][:n]}

    def load(self, entry: Entry, sample: SampleInfo, row: Block) -> bool:
        ids = entry[1].get("input_ids")
        out = row["input_ids"]
        if ids is None or ids.dtype != out.dtype or ids.ndim != 1 or len(ids) > len(out):
            return False
        out[: len(ids)] = ids
        row["length"][...] = len(ids)
        return True


def adapter_for(pipeline: Pipeline) -> Adapter | None:
    """How ``pipeline``'s samples are cached; None for a pipeline that is not (custom)."""
    if type(pipeline) is ImagePipeline:
        return _ImagePixels(pipeline) if pipeline.random_crop else _ImageRows(pipeline)
    if type(pipeline) is ArrayPipeline:
        return _Rows(pipeline)
    if type(pipeline) is TokensPipeline:
        return _Tokens(pipeline)
    return None
