"""Which cache blocks a session's plan reads, and when.

batchd's epoch order is a pure function of the plan (``planning/``), and the catalog says
where each sample's bytes are (path, offset, length), so the server knows exactly which
blocks (NOTE [ Cache files ] in ``storage/blocks.py``) each session will read, batch by batch. This
module turns a source's catalog rows into each row's object and block span (once per
catalog entry: :class:`SourceBlocks`), and a session's upcoming batches into ``(block, when)``
pairs (:func:`upcoming_uses`), ``when`` counted in batches from the session's cursor.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from batchd_server.catalog.types import SampleColumns
from batchd_server.pipelines.base import BadSample
from batchd_server.storage.blocks import object_hash
from batchd_server.storage.cache import object_url

__all__ = ["SourceBlocks", "Uses", "hashes64", "upcoming_uses"]

Int64Array = npt.NDArray[np.int64]


def hashes64(hashes: Sequence[str]) -> npt.NDArray[np.uint64]:
    """The last 64 bits of each object hash (hex), as the eviction's arrays name objects."""
    return np.fromiter((int(h[-16:], 16) for h in hashes), np.uint64, len(hashes))


@dataclass(frozen=True)
class SourceBlocks:
    """Each row of one source: its object and the blocks its bytes lie in.

    Attributes:
        urls: Every object the source reads, by the index ``objects`` holds.
        hashes: Each URL's :func:`~batchd_server.storage.blocks.object_hash`.
        hashes64: The last 64 bits of each (:func:`hashes64`).
        objects: Row -> index into ``urls``.
        first, last: Row -> the first and last block its bytes touch (``last < first``: none).
        offsets, lengths: Row -> its byte range; length -1 for a whole object of unknown size.
    """

    urls: list[str]
    hashes: list[str]
    hashes64: npt.NDArray[np.uint64]
    objects: npt.NDArray[np.int32]
    first: Int64Array
    last: Int64Array
    offsets: Int64Array
    lengths: Int64Array

    @classmethod
    def of(
        cls,
        columns: SampleColumns,
        root: str,
        block_bytes: int,
        size_of: Callable[[str], int] | None = None,
    ) -> SourceBlocks:
        """The rows of ``columns`` under ``root``; ``size_of(url)`` gives an object's size
        (-1: unknown) for the rows that are whole objects; without it every whole object's
        size is unknown, and its rows read its first block (the only one of an image)."""
        n = len(columns.ids)
        index: dict[bytes, int] = {}
        raw = columns.path_bytes
        bounds = columns.path_offsets.tolist()
        paths = (raw[bounds[i] : bounds[i + 1]].tobytes() for i in range(n))
        objects = np.fromiter((index.setdefault(p, len(index)) for p in paths), np.int32, n)
        urls, unsafe = _urls(root, index)
        offsets = columns.byte_offsets.astype(np.int64, copy=True)
        lengths = columns.byte_lengths.astype(np.int64, copy=True)
        whole = offsets < 0
        if whole.any():
            offsets[whole] = 0
            if size_of is None:
                lengths[whole] = -1
            else:
                sizes = np.array([-1 if u is None else size_of(u) for u in urls], np.int64)
                lengths[whole] = sizes[objects[whole]]
        # A row "to the end of the object" reads its first block at least.
        known = np.where(lengths < 0, 1, lengths)
        first = offsets // block_bytes
        last = np.where(known > 0, (offsets + known - 1) // block_bytes, first - 1)
        if unsafe:  # no reader reads them (``unsafe_path``): nothing of them is planned
            none = np.isin(objects, unsafe)
            last[none] = first[none] - 1
        named = [f"{root}\x00{j}" if u is None else u for j, u in enumerate(urls)]
        hashes = [object_hash(u) for u in named]
        return cls(named, hashes, hashes64(hashes), objects, first, last, offsets, lengths)


def _urls(root: str, index: dict[bytes, int]) -> tuple[list[str | None], list[int]]:
    """Each catalog path's URL by the reader's rule (``storage/paths.py``), None for one the
    reader refuses; and the indices of those."""
    urls: list[str | None] = []
    unsafe: list[int] = []
    for j, path in enumerate(index):
        try:
            urls.append(object_url(root, path.decode("utf-8", "replace")))
        except BadSample:
            urls.append(None)
            unsafe.append(j)
    return urls, unsafe


@dataclass(frozen=True)
class Uses:
    """Reads of blocks ahead of a session: block ``(hashes[objects[i]], blocks[i])`` is read
    ``when[i]`` batches from now."""

    hashes: Sequence[str]
    hashes64: npt.NDArray[np.uint64]
    objects: npt.NDArray[np.int32]
    blocks: Int64Array
    when: Int64Array


def upcoming_uses(source: SourceBlocks, rows: npt.NDArray[np.int64], when: Int64Array) -> Uses:
    """The blocks read by ``rows`` of ``source`` (read ``when[i]`` batches from now)."""
    first = source.first[rows]
    spans = source.last[rows] - first + 1
    spans = np.maximum(spans, 0)
    total = int(spans.sum())
    repeated = np.repeat(np.arange(len(rows)), spans)
    step = np.arange(total) - np.repeat(np.cumsum(spans) - spans, spans)
    return Uses(
        source.hashes,
        source.hashes64,
        source.objects[rows][repeated],
        first[repeated] + step,
        when[repeated],
    )
