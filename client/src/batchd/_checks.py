"""The checks every spec and option of the client runs on what a user passes: one place, so
each refusal reads the same."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from batchd.errors import InvalidArgument

__all__ = ["check_choice", "check_int"]


def check_choice(name: str, value: object, choices: Sequence[str]) -> str:
    """``value`` if it is one of ``choices``, else InvalidArgument listing them."""
    if not isinstance(value, str) or value not in choices:
        listed = ", ".join(repr(c) for c in choices)
        raise InvalidArgument(f"{name}={value!r} is not valid; choose one of {listed}")
    return value


def check_int(name: str, value: object, low: int, high: int) -> int:
    """``value`` as an int if it is an integer in ``[low, high]``, else InvalidArgument."""
    # bool is an int to Python, never what a user means by a count.
    if isinstance(value, bool) or not isinstance(value, int | np.integer):
        raise InvalidArgument(f"{name}={value!r} must be an integer between {low} and {high}")
    if not low <= int(value) <= high:
        raise InvalidArgument(f"{name}={value} must be between {low} and {high}")
    return int(value)
