"""The seam every sample byte comes through: :class:`SampleReader`.

A worker reads a source's bytes through one reader chosen by the root's scheme
(``storage/open.py``): local files (``storage/files.py``) or an object store
(``storage/objects.py``). Everything above (byte-range rows, Parquet rows, packing) talks to
this Protocol only. What a reader can do beyond reading is declared as attributes
(:attr:`SampleReader.fresh_buffers`, :attr:`SampleReader.fetches_ahead`,
:attr:`SampleReader.cached`), never asked with ``isinstance``; the batch hooks a store needs
(:meth:`~SampleReader.stage`, :meth:`~SampleReader.prefetch`, :meth:`~SampleReader.warm`)
are no-ops where there is nothing to fetch ahead.

The checks every reader makes before it reads are here too, so that a sample too large or a
range that wraps is refused with the same words wherever it lives.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Final, Protocol

import numpy as np
import numpy.typing as npt

from batchd_server.limits import INT64_MAX
from batchd_server.pipelines.base import BadSample
from batchd_server.shm.space import format_bytes
from batchd_server.storage.ranges import Ranges, ends_past_int64

__all__ = [
    "LocalHooks",
    "SampleReader",
    "bad_range",
    "check_ranges",
    "check_read",
    "too_large",
]

MAX_SAMPLE_HINT: Final = (
    "If it is right, raise the server's --max-sample-bytes (BATCHD_MAX_SAMPLE_BYTES)"
)


class SampleReader(Protocol):
    """Confined reads of the samples under one dataset root (a worker holds one per source).

    Paths are relative to the root, as the catalog records them; every failure is a
    :class:`~batchd_server.pipelines.base.BadSample` whose kind says what went wrong.
    """

    @property
    def fresh_buffers(self) -> bool:
        """What :meth:`read` and :meth:`read_ranges` return is memory of its own (a caller
        may keep a view of it), not a buffer the next read reuses."""
        ...

    @property
    def fetches_ahead(self) -> bool:
        """Fetching a batch's bytes together ahead of its reads pays (:meth:`stage`,
        :meth:`prefetch`): a read costs a round trip, not a ``pread``."""
        ...

    @property
    def cached(self) -> bool:
        """Reads go through the node cache: a small read is a file read, after
        :meth:`warm`."""
        ...

    def read(self, path: str, offset: int = -1, length: int = -1) -> memoryview:
        """The bytes of one sample (``offset``/``length`` -1: the whole file, or to its
        end)."""
        ...

    def read_ranges(self, ranges: Ranges) -> tuple[npt.NDArray[np.uint8], npt.NDArray[np.int64]]:
        """Many samples' byte ranges in as few reads as their layout allows: sample ``i`` is
        ``data[starts[i]:starts[i] + lengths[i]]``. Which sample is at fault when one is
        bad is not said: read each with :meth:`read` to find out."""
        ...

    def size(self, path: str) -> int:
        """The size in bytes of the file ``path`` names (a Parquet footer is read from its
        end)."""
        ...

    def map_whole(self, path: str) -> npt.NDArray[np.uint8]:
        """A whole file as a read-only array, cached."""
        ...

    def begin_batch(self) -> None:
        """A new batch begins: what was checked, staged or given up on in the last is not
        trusted any more."""
        ...

    def stage(self, ranges: Ranges) -> None:
        """Fetch a batch's byte ranges together for :meth:`read` to serve until the next
        :meth:`begin_batch`; failures are left for :meth:`read` to meet and report."""
        ...

    def prefetch(self, paths: Sequence[str]) -> None:
        """Start fetching these whole files, about to be read one by one."""
        ...

    def warm(self, ranges: Ranges) -> None:
        """Bring these ranges into the node cache, for many small reads inside them."""
        ...

    def close(self) -> None:
        """Drop every handle, buffer and fetch in flight. Idempotent."""
        ...


class LocalHooks:
    """The capabilities and batch hooks of a reader with nothing to fetch ahead."""

    fresh_buffers: Final = False
    fetches_ahead: Final = False
    cached: Final = False

    def stage(self, ranges: Ranges) -> None:
        """Nothing: a ``pread`` of each is as quick as a staged copy."""

    def prefetch(self, paths: Sequence[str]) -> None:
        """Nothing: opening a file costs no round trip."""

    def warm(self, ranges: Ranges) -> None:
        """Nothing: the page cache is the cache."""


def too_large(where: str, count: int, max_bytes: int, why: str = "") -> BadSample:
    """A ``too_large`` bad sample: reading ``where`` means ``count`` bytes, over the bound."""
    return BadSample(
        "too_large",
        f"{where}: reading this sample means reading {format_bytes(count)} ({count} bytes), "
        f"more than the {format_bytes(max_bytes)} a sample may have{why}. {MAX_SAMPLE_HINT}",
    )


def bad_range(where: str, offset: int, length: int) -> BadSample:
    """A ``bad_range`` bad sample: the catalog's range ends past any file."""
    return BadSample(
        "bad_range",
        f"{where}: byte range offset={offset}, length={length} ends past 2**63 - 1, beyond any "
        "file; the catalog row is wrong (ingested with --no-verify?): fix its byte_offset "
        "and byte_length and re-ingest",
    )


def check_read(where: str, offset: int, length: int) -> None:
    """Refuse a single read's range before anything is asked of the file or store.

    Raises:
        BadSample: a negative offset or length other than -1 (``unreadable``), or a range
            that ends past 2**63 - 1 (``bad_range``).
    """
    if offset < -1 or length < -1:
        raise BadSample(
            "unreadable", f"{where}: byte range offset={offset}, length={length} is invalid"
        )
    if offset >= 0 and length >= 0 and offset > INT64_MAX - length:
        raise bad_range(where, offset, length)


def check_ranges(ranges: Ranges, where: Sequence[str], max_bytes: int, why: str = "") -> None:
    """Refuse a batch of ranges before any is read: ``where[k]`` names ``ranges.paths[k]``
    in messages (a path, or its URL).

    Raises:
        BadSample: a negative offset or length, a range that ends past 2**63 - 1, or one
            larger than ``max_bytes``.
    """
    offsets, lengths, files = ranges.offsets, ranges.lengths, ranges.files
    if not len(offsets):
        return
    if offsets.min() < 0 or lengths.min() < 0:
        raise BadSample("unreadable", "a byte range has a negative offset or length")
    wraps = ends_past_int64(offsets, lengths)
    if len(wraps):
        i = int(wraps[0])
        raise bad_range(where[int(files[i])], int(offsets[i]), int(lengths[i]))
    longest = int(lengths.argmax())
    if int(lengths[longest]) > max_bytes:
        raise too_large(where[int(files[longest])], int(lengths[longest]), max_bytes, why)
