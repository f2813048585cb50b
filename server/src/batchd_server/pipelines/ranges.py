"""Gather fixed-width byte ranges out of one buffer in one numpy call (a batch's records,
once read: ``storage/ranges.py`` plans the reads)."""

from __future__ import annotations

import numpy as np
import numpy.typing as npt

__all__ = ["take_ranges"]

Int64Array = npt.NDArray[np.int64]


def take_ranges(
    buffer: npt.NDArray[np.uint8], starts: Int64Array, width: int
) -> npt.NDArray[np.void]:
    """``buffer[starts[i]:starts[i] + width]`` for every ``i``: one ``(n,)`` array of
    ``V{width}`` elements, a copy.

    One numpy fancy index over a view of ``buffer`` whose elements are ``width`` bytes with a
    stride of one byte, so the whole gather is one C loop of memcpys. The caller checks that
    every range lies inside ``buffer`` and that ``width >= 1``.
    """
    assert width >= 1 and len(buffer) >= width, "a range of at least one byte inside buffer"
    kind = np.dtype((np.void, width))
    every = np.ndarray((len(buffer) - width + 1,), kind, buffer, 0, (1,))
    # Fancy indexing, not np.take: take first makes its input contiguous, which for this
    # overlapping view means copying ``width`` times the buffer.
    return every[starts]
