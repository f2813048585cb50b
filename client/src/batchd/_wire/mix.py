"""The values of a mix both sides check: how many sources, how long an epoch, what a weight is."""

from __future__ import annotations

import math
from typing import Final

__all__ = ["MAX_MIX_SOURCES", "MAX_STOP", "valid_weight"]

MAX_MIX_SOURCES: Final = 64
MAX_STOP: Final = 1 << 36
"""The largest ``stop``: samples per epoch of a mix."""


def valid_weight(weight: object) -> bool:
    """A mix weight: a finite int or float > 0 (a bool is not a weight). The client checks
    it when a ``Mix`` is built, the server again for any request."""
    return (
        not isinstance(weight, bool)
        and isinstance(weight, int | float)
        and math.isfinite(weight)
        and weight > 0
    )
