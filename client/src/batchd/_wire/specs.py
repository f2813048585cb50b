"""The pipeline and request values both sides check: limits, defaults and choices.

The client checks a spec when it is built (``batchd._pipelines``), the server checks every
request again (``batchd_server.pipelines``, ``sessions/options.py``); both read the bounds
from here so they cannot drift.
"""

from __future__ import annotations

from typing import Final

__all__ = [
    "IMAGE_DECODERS",
    "IMAGE_DEFAULT_RATIO",
    "IMAGE_DEFAULT_SCALE",
    "IMAGE_DEFAULT_SIZE",
    "MAX_IMAGE_SIZE",
    "MAX_TOKENS",
    "ON_ERROR_CHOICES",
    "TRANSPORTS",
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

ON_ERROR_CHOICES: Final = ("skip", "raise", "replace")
"""What may happen to a bad sample."""
TRANSPORTS: Final = ("auto", "shm", "inline")
