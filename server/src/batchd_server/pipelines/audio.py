"""The audio pipeline: an audio (or video) file's bytes to a waveform at one sample rate,
decoded and resampled with PyAV (FFmpeg's decoders and ``swresample``) on the worker's CPU.

The recipe, exactly (a test reimplements it with PyAV and demands equal bytes):

1. **Stream**: the container's first audio stream, decoded from its start.
2. **Resample**: every decoded frame goes through one ``av.AudioResampler`` per sample, with
   ``format`` ``"flt"`` (float32) or ``"s16"`` (int16), ``layout`` ``"mono"`` or
   ``"stereo"`` (FFmpeg's default mix: a mono file is copied to both channels of a stereo
   row, more channels are mixed down), ``rate`` ``sample_rate``; the resampler is flushed at
   the end of the stream. The output samples are numbered from 0.
3. **Crop** of ``N`` output samples (``N = round(seconds * sample_rate)``, or
   ``round(max_seconds * sample_rate)`` when ``seconds`` is None): ``"start"`` keeps samples
   ``0 .. N-1``; ``"random"`` (with ``seconds`` set) starts at
   ``rng.integers(0, E - N + 1)`` from the sample's rng, ``E = floor(duration *
   sample_rate)`` with ``duration`` from the container's header, or at 0 when ``E <= N``.
   Decoding stops once the crop is complete, so a crop near the start of a long file costs
   only its own part; a crop near the end decodes what comes before it (the resampler's
   state makes the samples exact, where a seek would not be).
4. The row is ``(C, N)``; its ``audio_length`` is the samples kept (fewer than ``N`` for a
   shorter file). :meth:`AudioPipeline.finish` cuts the batch to its longest row ``L``: the
   fields become ``audio`` ``(B, C, L)`` zero-padded, ``audio_mask`` ``uint8`` ``(B, L)``
   (1 on real samples) and ``audio_length`` ``int32`` ``(B,)``.

An audio file that decodes to no samples is ``empty``; one whose stream ends before the crop's
start (its header claims more than it holds) is ``truncated``.
"""

from __future__ import annotations

import math
from typing import Any, Final

import numpy as np

from batchd._wire.specs import (
    AUDIO_CROPS,
    AUDIO_DEFAULT_MAX_SECONDS,
    AUDIO_DTYPES,
    MAX_AUDIO_SECONDS,
    MAX_SAMPLE_RATE,
)
from batchd_server.errors import InvalidArgument
from batchd_server.pipelines.base import BadSample, Block, FieldSpec, Pipeline, SampleInfo
from batchd_server.pipelines.media import decode_error, open_media, stream_of, unexpected

__all__ = ["CROPS", "DTYPES", "AudioPipeline", "probe_seconds"]

CROPS: Final = AUDIO_CROPS
DTYPES: Final = AUDIO_DTYPES
_FORMATS: Final[dict[str, tuple[str, np.dtype[Any]]]] = {
    "float32": ("flt", np.dtype("<f4")),
    "int16": ("s16", np.dtype("<i2")),
}


def probe_seconds(container: Any, stream: Any) -> float:
    """A stream's duration from the container's header, 0.0 when it has none."""
    if stream.duration is not None and stream.time_base:
        return max(0.0, float(stream.duration * stream.time_base))
    return max(0.0, (container.duration or 0) / 1e6)


def _seconds(name: str, value: float) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise InvalidArgument(f"audio {name}={value!r} must be a number of seconds")
    if not 0 < value <= MAX_AUDIO_SECONDS:
        raise InvalidArgument(f"audio {name}={value!r} must be in (0, {MAX_AUDIO_SECONDS:g}]")
    return float(value)


class AudioPipeline(Pipeline):
    """Audio to ``audio``, ``audio_length`` and ``audio_mask``, following the module's recipe.

    Args:
        sample_rate: Output samples per second.
        seconds: The crop's length; None keeps whole files, up to ``max_seconds``.
        mono: One channel; else two (stereo).
        crop: ``"random"`` or ``"start"`` (step 3).
        dtype: ``"float32"`` (in [-1, 1]) or ``"int16"``.
        max_seconds: With ``seconds`` None: the longest row (longer files are cut to it),
            which sizes the batch's shared-memory slot.

    Raises:
        InvalidArgument: An argument is out of range.
    """

    def __init__(
        self,
        sample_rate: int = 16000,
        seconds: float | None = None,
        mono: bool = True,
        crop: str = "random",
        dtype: str = "float32",
        max_seconds: float = AUDIO_DEFAULT_MAX_SECONDS,
    ) -> None:
        if not isinstance(sample_rate, int) or not 1000 <= sample_rate <= MAX_SAMPLE_RATE:
            raise InvalidArgument(
                f"audio sample_rate={sample_rate!r} must be an integer in 1000..{MAX_SAMPLE_RATE}"
            )
        if crop not in CROPS:
            raise InvalidArgument(f"audio crop={crop!r} must be one of {CROPS}")
        if dtype not in _FORMATS:
            raise InvalidArgument(f"audio dtype={dtype!r} must be one of {DTYPES}")
        self.seconds = None if seconds is None else _seconds("seconds", seconds)
        self.max_seconds = _seconds("max_seconds", max_seconds)
        self.sample_rate = sample_rate
        self.mono = bool(mono)
        self.crop = crop
        self.dtype = dtype
        self.channels = 1 if self.mono else 2
        self.samples = round((self.seconds or self.max_seconds) * sample_rate)
        self._format, self._dtype = _FORMATS[dtype]

    def fields(self) -> list[FieldSpec]:
        return [
            FieldSpec("audio", self._dtype, (self.channels, self.samples)),
            FieldSpec("audio_length", np.dtype("<i4"), ()),
            FieldSpec("audio_mask", np.dtype(np.uint8), (self.samples,)),
        ]

    def decode_into(self, data: memoryview, sample: SampleInfo, row: Block) -> None:
        import av  # here, not at module level: see media.py

        container = open_media(data, sample)
        try:
            stream = stream_of(container, "audio", sample)
            start = self._crop_start(container, stream, sample)
            end = start + self.samples
            resampler = av.AudioResampler(
                format=self._format, layout="mono" if self.mono else "stereo", rate=self.sample_rate
            )
            out = row["audio"]
            position = 0
            try:
                for frame in container.decode(stream):
                    position = self._take(resampler.resample(frame), position, start, end, out)
                    if position >= end:
                        break
                else:
                    position = self._take(resampler.resample(None), position, start, end, out)
            except Exception as e:
                raise decode_error(e, sample, f"samples {start}..{end}") from e
        except BadSample:
            raise
        except Exception as e:  # hostile bytes: see media.unexpected
            raise unexpected(e, sample) from e
        finally:
            container.close()
        if position == 0:
            raise BadSample("empty", f"{sample.path}: the audio stream has no samples")
        if position <= start:
            raise BadSample(
                "truncated",
                f"{sample.path}: the audio stream ends after {position} samples at "
                f"{self.sample_rate} Hz, before the crop at {start} its header's duration allows",
            )
        row["audio_length"][...] = min(position, end) - start

    def _crop_start(self, container: Any, stream: Any, sample: SampleInfo) -> int:
        """Step 3's start, in output samples."""
        if self.crop != "random" or self.seconds is None:
            return 0
        seconds = min(probe_seconds(container, stream), MAX_AUDIO_SECONDS)
        whole = math.floor(seconds * self.sample_rate)
        if whole <= self.samples:
            return 0
        return int(sample.rng().integers(0, whole - self.samples + 1))

    def _take(self, frames: list[Any], position: int, start: int, end: int, out: Any) -> int:
        """Copy the part of ``frames`` inside ``[start, end)`` into ``out``; the new position."""
        channels = self.channels
        for frame in frames:
            count = frame.samples
            lo, hi = max(start, position), min(end, position + count)
            if lo < hi:
                # Packed formats: one plane of interleaved channels.
                samples = frame.to_ndarray().reshape(count, channels)
                out[:, lo - start : hi - start] = samples[lo - position : hi - position].T
            position += count
            if position >= end:
                break
        return position

    def finish(self, block: Block, rows: int) -> dict[str, tuple[int, ...]]:
        lengths = block["audio_length"][:rows]
        longest = int(lengths.max()) if rows else 0
        audio, mask = block["audio"], block["audio_mask"]
        assert audio.flags.c_contiguous and mask.flags.c_contiguous, "fields are slot views"
        real = np.arange(longest) < lengths[:, None]
        channels = self.channels
        # The (rows, C, longest) result overlaps the (rows, C, N) rows it is made from.
        kept = audio[:rows, :, :longest].copy()
        kept *= real[:, None, :]
        audio.reshape(-1)[: rows * channels * longest].reshape(rows, channels, longest)[...] = kept
        mask.reshape(-1)[: rows * longest].reshape(rows, longest)[...] = real
        return {
            "audio": (rows, channels, longest),
            "audio_length": (rows,),
            "audio_mask": (rows, longest),
        }
