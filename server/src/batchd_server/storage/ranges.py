"""Which reads fetch a batch's byte ranges of one file: sorted, neighbours coalesced.

A batch of small records (a few hundred bytes each, inside shard files) costs a system call
per read, and a Python call around it, far more than the bytes. So the ranges are sorted by
offset and every range that starts within :data:`MAX_GAP_BYTES` of the end of the one before
joins its *run*: one ``pread`` fetches a run, gap bytes included. Reading 4 KiB more from the
page cache costs about what one more system call does, so records laid out in sampling order
(sequential sampling, or sorted shards) cost one read per batch and shuffled ones one read
per record at worst. Overlapping and repeated ranges (sampling with replacement) share a run.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Final

import numpy as np
import numpy.typing as npt

from batchd_server.limits import INT64_MAX

__all__ = ["MAX_GAP_BYTES", "Ranges", "ReadPlan", "ends_past_int64", "plan_reads"]

MAX_GAP_BYTES: Final = 4096
"""Ranges closer than this are read together, the bytes between them included."""

Int64Array = npt.NDArray[np.int64]


@dataclass(frozen=True)
class ReadPlan:
    """The runs that cover some ranges of one file, laid out back to back in a buffer."""

    run_offsets: Int64Array
    """File offset of each run, ascending."""
    run_lengths: Int64Array
    run_starts: Int64Array
    """Where each run lands in the buffer."""
    starts: Int64Array
    """Where each range begins in the buffer, in the order the ranges were given."""
    total_bytes: int
    """The buffer's size: the runs' lengths added up."""
    end: int
    """The furthest file byte any range reaches (0 for no ranges)."""


def ends_past_int64(offsets: Int64Array, lengths: Int64Array) -> Int64Array:
    """Indices of the ranges whose end, ``offsets[i] + lengths[i]``, is past 2**63 - 1 (an
    int64 sum would wrap to a negative end). ``lengths`` must be non-negative."""
    return np.flatnonzero(offsets > INT64_MAX - lengths)


def plan_reads(
    offsets: Int64Array,
    lengths: Int64Array,
    max_gap_bytes: int = MAX_GAP_BYTES,
    max_extra_bytes: int | None = None,
) -> ReadPlan:
    """Group ranges ``[offsets[i], offsets[i] + lengths[i])`` into as few runs as allowed.

    Args:
        offsets: Non-negative byte offsets, in any order.
        lengths: Non-negative byte counts, one per offset.
        max_gap_bytes: Largest gap between ranges that one run spans.
        max_extra_bytes: With it, the gaps the runs span add up to at most the larger of
            this and the bytes the ranges ask (the smallest gaps are spanned first); None:
            no bound but ``max_gap_bytes``.

    Raises:
        ValueError: A range ends past 2**63 - 1 (its callers refuse those first).
    """
    n = len(offsets)
    assert len(lengths) == n and not (n and (offsets.min() < 0 or lengths.min() < 0)), "ranges"
    wraps = ends_past_int64(offsets, lengths)
    if len(wraps):
        i = int(wraps[0])
        raise ValueError(
            f"the byte range at offset {int(offsets[i])} of {int(lengths[i])} bytes ends past "
            "2**63 - 1"
        )
    if n == 0:
        empty = np.zeros(0, np.int64)
        return ReadPlan(empty, empty, empty, empty, 0, 0)
    order = np.argsort(offsets, kind="stable")
    begin = offsets[order]
    end = begin + lengths[order]
    reach = np.maximum.accumulate(end)
    new_run = np.empty(n, np.bool_)
    new_run[0] = True
    np.greater(begin[1:], reach[:-1] + max_gap_bytes, out=new_run[1:])
    if max_extra_bytes is not None and n > 1:
        _bound_gaps(new_run, begin[1:] - reach[:-1], max(max_extra_bytes, int(lengths.sum())))
    firsts = np.flatnonzero(new_run)
    lasts = np.append(firsts[1:] - 1, n - 1)
    run_offsets = begin[firsts]
    run_lengths = reach[lasts] - run_offsets
    run_starts = np.zeros(len(firsts), np.int64)
    np.cumsum(run_lengths[:-1], out=run_starts[1:])
    run_of = np.cumsum(new_run) - 1
    starts = np.empty(n, np.int64)
    starts[order] = run_starts[run_of] + (begin - run_offsets[run_of])
    return ReadPlan(
        run_offsets,
        run_lengths,
        run_starts,
        starts,
        int(run_starts[-1] + run_lengths[-1]),
        int(reach[-1]),
    )


def _bound_gaps(new_run: npt.NDArray[np.bool_], gaps: Int64Array, budget: int) -> None:
    """Start new runs (``new_run[1:]``) at the widest spanned gaps until the spanned ones
    add up to at most ``budget`` bytes (overlaps and touching ranges cost nothing)."""
    spanned = np.flatnonzero(~new_run[1:] & (gaps > 0))
    if int(gaps[spanned].sum()) <= budget:
        return
    by_width = spanned[np.argsort(gaps[spanned], kind="stable")]
    kept = np.cumsum(gaps[by_width]) <= budget
    new_run[1:][by_width[~kept]] = True


@dataclass(frozen=True)
class Ranges:
    """The byte ranges of many samples over a few files, as one value: sample ``i`` is
    ``lengths[i]`` bytes at ``offsets[i]`` of ``paths[files[i]]``. What every reader's
    batch calls take (``SampleReader.read_ranges``, ``stage``, ``warm``)."""

    paths: Sequence[str]
    files: npt.NDArray[np.intp]
    offsets: Int64Array
    lengths: Int64Array

    def __len__(self) -> int:
        return len(self.offsets)

    def take(self, rows: npt.NDArray[Any]) -> Ranges:
        """The ranges at ``rows`` (indices or a mask), over the same paths."""
        return Ranges(self.paths, self.files[rows], self.offsets[rows], self.lengths[rows])

    def by_file(self) -> list[npt.NDArray[np.intp]]:
        """The rows of each path, in the paths' order."""
        if len(self.paths) == 1:
            return [np.arange(len(self.offsets))]
        return [np.flatnonzero(self.files == k) for k in range(len(self.paths))]

    def plans(
        self, max_gap_bytes: int = MAX_GAP_BYTES, max_extra_bytes: int | None = None
    ) -> list[ReadPlan]:
        """Each path's read plan (:func:`plan_reads`), in the order of :meth:`by_file`."""
        return [
            plan_reads(self.offsets[rows], self.lengths[rows], max_gap_bytes, max_extra_bytes)
            for rows in self.by_file()
        ]
