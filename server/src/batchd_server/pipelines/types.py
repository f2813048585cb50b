"""Array types of a batch's bytes, shared by every pipeline's ``decode_batch``."""

from __future__ import annotations

import numpy as np
import numpy.typing as npt

__all__ = ["Bytes", "Offsets"]

Bytes = npt.NDArray[np.uint8]
"""A batch's sample bytes, read into one buffer."""
Offsets = npt.NDArray[np.int64]
"""Byte offsets or lengths, one per sample."""
