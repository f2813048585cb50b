"""The pipeline and request values both sides check: limits, defaults and choices.

The client checks a spec when it is built (``batchd._pipelines``), the server checks every
request again (``batchd_server.pipelines``, ``sessions/options.py``); both read the bounds
from here so they cannot drift.
"""

from __future__ import annotations

from typing import Final

__all__ = [
    "AUDIO_CROPS",
    "AUDIO_DEFAULT_MAX_SECONDS",
    "AUDIO_DTYPES",
    "IMAGE_DECODERS",
    "IMAGE_DEFAULT_RATIO",
    "IMAGE_DEFAULT_SCALE",
    "IMAGE_DEFAULT_SIZE",
    "MAX_AUDIO_SECONDS",
    "MAX_IMAGE_SIZE",
    "MAX_SAMPLE_RATE",
    "MAX_TOKENS",
    "MAX_VIDEO_CLIPS",
    "MAX_VIDEO_FPS",
    "MAX_VIDEO_FRAMES",
    "ON_ERROR_CHOICES",
    "TRANSPORTS",
    "VIDEO_CLIPS",
]

MAX_IMAGE_SIZE: Final = 16384
"""Largest output side (and resize) of :class:`Image`, in pixels."""
IMAGE_DEFAULT_SIZE: Final = 224
IMAGE_DEFAULT_SCALE: Final = (0.08, 1.0)
"""Area fraction range of a random-resized crop (torchvision's ``RandomResizedCrop``)."""
IMAGE_DEFAULT_RATIO: Final = (3 / 4, 4 / 3)
"""Aspect ratio range of a random-resized crop (torchvision's ``RandomResizedCrop``)."""
IMAGE_DECODERS: Final = ("auto", "pillow")
MAX_TOKENS: Final = 1 << 20
"""Largest ``max_len`` of :class:`Tokens`."""

VIDEO_CLIPS: Final = ("random", "uniform", "center")
"""Where :class:`Video`'s clips start: drawn, evenly spread, or in the middle."""
MAX_VIDEO_FRAMES: Final = 1024
"""Most frames of one clip."""
MAX_VIDEO_CLIPS: Final = 64
"""Most clips of one video per sample."""
MAX_VIDEO_FPS: Final = 1000.0
AUDIO_CROPS: Final = ("random", "start")
AUDIO_DTYPES: Final = ("float32", "int16")
MAX_SAMPLE_RATE: Final = 384_000
MAX_AUDIO_SECONDS: Final = 3600.0
"""Longest audio row (``seconds`` or ``max_seconds``) of :class:`Audio`."""
AUDIO_DEFAULT_MAX_SECONDS: Final = 30.0
"""The row's room when :class:`Audio` keeps whole clips (``seconds=None``)."""

ON_ERROR_CHOICES: Final = ("skip", "raise", "replace")
"""What may happen to a bad sample."""
TRANSPORTS: Final = ("auto", "shm", "inline")
