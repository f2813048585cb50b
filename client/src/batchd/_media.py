"""Media pipeline specs: ``batchd.Video`` and ``batchd.Audio``.

Both decode on the server with PyAV (FFmpeg) in its decode workers, on CPU. Like every spec
they are frozen dataclasses that validate themselves when built; ``_to_proto()`` gives the
wire's ``Pipeline`` message.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Final

from batchd._checks import check_choice, check_int
from batchd._proto.batchd.v1 import loader_pb2
from batchd._wire.specs import (
    AUDIO_CROPS,
    AUDIO_DEFAULT_MAX_SECONDS,
    AUDIO_DTYPES,
    MAX_AUDIO_SECONDS,
    MAX_IMAGE_SIZE,
    MAX_SAMPLE_RATE,
    MAX_VIDEO_CLIPS,
    MAX_VIDEO_FPS,
    MAX_VIDEO_FRAMES,
    VIDEO_CLIPS,
)
from batchd.errors import InvalidArgument

__all__ = ["Audio", "Video"]

_MIN_SAMPLE_RATE: Final = 1000


def _positive(name: str, value: object, upper: float) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise InvalidArgument(f"{name}={value!r} must be a number")
    if not (0 < float(value) <= upper and math.isfinite(value)):
        raise InvalidArgument(f"{name}={value!r} must be in (0, {upper:g}]")
    return float(value)


@dataclass(frozen=True)
class Video:
    """Decode clips of video files (MP4, MKV, WebM, AVI...: what FFmpeg reads).

    Args:
        frames: Frames per clip (``T``).
        size: Output height and width: the shorter side is resized to ``size`` and the
            centre ``size x size`` kept.
        fps: Sample the clip at this many frames per second; None keeps the video's rate.
        clip: Where a clip starts: ``"random"`` (a draw from (seed, epoch, sample id)),
            ``"uniform"`` (``clips_per_video`` clips spread evenly) or ``"center"``.
        clips_per_video: Clips per sample (``K``).

    Fields: ``video`` uint8 ``[B, T, 3, size, size]`` RGB (``[B, K, T, 3, size, size]`` when
    ``clips_per_video > 1``), ``clip_start`` float64 seconds ``[B]`` (``[B, K]``) and
    ``frame_index`` int32 ``[B, T]`` (``[B, K, T]``), the source frames each clip holds.
    Only the frames a clip needs are decoded (a seek to the keyframe before it).
    """

    frames: int = 16
    size: int = 224
    fps: float | None = None
    clip: str = "random"
    clips_per_video: int = 1

    def __post_init__(self) -> None:
        object.__setattr__(
            self, "frames", check_int("Video frames", self.frames, 1, MAX_VIDEO_FRAMES)
        )
        object.__setattr__(self, "size", check_int("Video size", self.size, 1, MAX_IMAGE_SIZE))
        if self.fps is not None:
            object.__setattr__(self, "fps", _positive("Video fps", self.fps, MAX_VIDEO_FPS))
        check_choice("Video clip", self.clip, VIDEO_CLIPS)
        clips = check_int("Video clips_per_video", self.clips_per_video, 1, MAX_VIDEO_CLIPS)
        object.__setattr__(self, "clips_per_video", clips)

    def _to_proto(self) -> loader_pb2.Pipeline:
        return loader_pb2.Pipeline(
            video=loader_pb2.VideoPipeline(
                frames=self.frames,
                size=self.size,
                fps=self.fps or 0.0,
                clip=self.clip,
                clips_per_video=self.clips_per_video,
            )
        )


@dataclass(frozen=True)
class Audio:
    """Decode and resample audio (WAV, FLAC, MP3, AAC, Opus, a video's sound: what FFmpeg
    reads).

    Args:
        sample_rate: Output samples per second.
        seconds: Crop every row to this many seconds; None keeps whole files (up to
            ``max_seconds``).
        mono: One channel; else two (stereo). FFmpeg mixes the file's channels to these.
        crop: ``"random"`` (a start drawn from (seed, epoch, sample id)) or ``"start"``.
        dtype: ``"float32"`` (in [-1, 1]) or ``"int16"``.
        max_seconds: With ``seconds=None``, the longest row: longer files are cut to it. It
            sizes the server's shared-memory slots, so keep it near your longest clip.

    Fields: ``audio`` ``[B, C, L]`` of ``dtype``, zero-padded to ``L``, the batch's longest
    row; ``audio_length`` int32 ``[B]``, the real samples of each row; ``audio_mask`` uint8
    ``[B, L]``, 1 on real samples. Sampling ``"bucketed"`` groups files of similar duration
    (ingest records it as each sample's length), so batches carry little padding.
    """

    sample_rate: int = 16000
    seconds: float | None = None
    mono: bool = True
    crop: str = "random"
    dtype: str = "float32"
    max_seconds: float = AUDIO_DEFAULT_MAX_SECONDS

    def __post_init__(self) -> None:
        rate = check_int("Audio sample_rate", self.sample_rate, _MIN_SAMPLE_RATE, MAX_SAMPLE_RATE)
        object.__setattr__(self, "sample_rate", rate)
        if self.seconds is not None:
            seconds = _positive("Audio seconds", self.seconds, MAX_AUDIO_SECONDS)
            object.__setattr__(self, "seconds", seconds)
        longest = _positive("Audio max_seconds", self.max_seconds, MAX_AUDIO_SECONDS)
        object.__setattr__(self, "max_seconds", longest)
        object.__setattr__(self, "mono", bool(self.mono))
        check_choice("Audio crop", self.crop, AUDIO_CROPS)
        check_choice("Audio dtype", self.dtype, AUDIO_DTYPES)

    def _to_proto(self) -> loader_pb2.Pipeline:
        return loader_pb2.Pipeline(
            audio=loader_pb2.AudioPipeline(
                sample_rate=self.sample_rate,
                seconds=self.seconds or 0.0,
                stereo=not self.mono,
                crop=self.crop,
                dtype=self.dtype,
                max_seconds=self.max_seconds,
            )
        )
