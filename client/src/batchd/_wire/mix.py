"""The values of a mix both sides check: how many sources, how long an epoch, what a weight is."""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Final

__all__ = ["MAX_MIX_SOURCES", "MAX_STOP", "finite_sum", "valid_weight"]

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


def finite_sum(weights: Iterable[float]) -> bool:
    """Whether ``weights`` (each finite) add up to a finite float: two weights near the
    largest float do not, and the shares of such a mix cannot be computed. The client checks
    it when a ``Mix`` (or a schedule point) is built, the server again for any request."""
    try:
        return math.isfinite(math.fsum(weights))
    except OverflowError:
        return False
