"""One block of a run being streamed from the store into the node cache (NOTE [ Cache
files ] in ``blocks.py``): its file's writer and a reader's copies of the spans it asked."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Sequence

from batchd_server.pipelines.base import BadSample
from batchd_server.storage.blocks import BlockKey, BlockRead, BlockStore, object_hash
from batchd_server.storage.cache_stats import CacheStats

__all__ = ["Filling", "fetch_unkept", "fill_run", "short_answer"]


class Filling:
    """Block ``index`` of a run being streamed: its file's writer (None when the cache has
    no room for it: the block is then only served) and a reader's copies of its spans."""

    def __init__(
        self,
        store: BlockStore,
        h: str,
        index: int,
        start: int,
        length: int,
        need: dict[int, list[tuple[int, int]]],
        prefetch: bool,
        version: int = 0,
    ) -> None:
        b = store.block_bytes
        self.index = index
        self.size = min((index + 1) * b, start + length) - index * b
        self.at = 0
        self.writer = store.writer(BlockKey(h, index), self.size, version)
        merged: list[list[int]] = []
        for lo, hi in sorted(() if prefetch else need.get(index, ())):
            if merged and lo <= merged[-1][1]:
                merged[-1][1] = max(merged[-1][1], hi)
            else:
                merged.append([lo, hi])
        self.spans = [(lo, bytearray(hi - lo)) for lo, hi in merged]

    @property
    def full(self) -> bool:
        return self.at == self.size

    def add(self, view: memoryview) -> memoryview:
        """Take what of ``view`` belongs to this block; returns the rest."""
        piece, rest = view[: self.size - self.at], view[self.size - self.at :]
        lo, hi = self.at, self.at + len(piece)
        for start, copy in self.spans:
            a, z = max(lo, start), min(hi, start + len(copy))
            if a < z:
                copy[a - start : z - start] = piece[a - lo : z - lo]
        if self.writer is not None:
            try:
                self.writer.add(piece)
            except OSError:  # the disk refused: the block is served, not kept
                self.writer.abort()
                self.writer = None
        self.at = hi
        return rest

    def finish(self, *, replace: bool) -> BlockRead:
        if self.writer is not None:
            self.writer.finish(replace=replace)
            self.writer = None
        return BlockRead(self.size, [(lo, memoryview(copy)) for lo, copy in self.spans])

    def abort(self) -> None:
        if self.writer is not None:
            self.writer.abort()
            self.writer = None


def fill_run(
    store: BlockStore,
    stats: CacheStats,
    pieces: Iterable[bytes | memoryview],
    url: str,
    run: list[int],
    span: tuple[int, int],
    need: dict[int, list[tuple[int, int]]],
    short: set[int],
    *,
    prefetch: bool,
    version: int,
) -> dict[int, BlockRead]:
    """The blocks of ``run`` (neighbours, bytes ``span``: start, length), from ``pieces`` of
    the store's answer as they arrive, each written to its file (``replace`` for those in
    ``short``) with the object's ``version`` (``version_tag``); a reader's spans of each.

    Raises:
        BadSample: ``unreadable`` when the store answered more or fewer bytes than asked;
            and what iterating ``pieces`` raises (nothing is kept of an unfinished block).
    """
    start, length = span
    h = object_hash(url)
    got: dict[int, BlockRead] = {}
    block = Filling(store, h, run[0], start, length, need, prefetch, version)
    received = 0
    started = time.perf_counter()
    try:
        for piece in pieces:
            view = memoryview(piece).cast("B")
            received += len(view)
            if received > length:
                raise BadSample(
                    "unreadable",
                    f"{url}: the store answered more than the {length} bytes asked at {start}",
                )
            while len(view):
                view = block.add(view)
                if block.full:
                    got[block.index] = block.finish(replace=block.index in short)
                    if block.index < run[-1]:
                        i = block.index + 1
                        block = Filling(store, h, i, start, length, need, prefetch, version)
    except BaseException:
        block.abort()
        raise
    finally:
        stats.latency(time.perf_counter() - started)
        stats.add(fetched_bytes=received, prefetched_bytes=received if prefetch else 0)
    if received != length:
        block.abort()
        raise short_answer(url, received, length, start)
    return got


def fetch_unkept(
    get: Callable[[list[tuple[int, int]]], Sequence[bytes | memoryview]],
    stats: CacheStats,
    url: str,
    block_bytes: int,
    need: dict[int, list[tuple[int, int]]],
    missing: list[int],
) -> dict[int, BlockRead]:
    """The asked spans of ``missing`` blocks, in one request (``get``), none kept: the cache
    has no room for the blocks (a working set larger than it), and fetching a whole block per
    record would multiply the bytes asked of the store by the block's size."""
    b = block_bytes
    merged: dict[int, list[list[int]]] = {}
    for i in missing:
        runs = merged[i] = []
        for lo, hi in sorted(need[i]):
            if runs and lo <= runs[-1][1]:
                runs[-1][1] = max(runs[-1][1], hi)
            else:
                runs.append([lo, hi])
    spans = [(i * b + lo, hi - lo) for i in missing for lo, hi in merged[i]]
    started = time.perf_counter()
    datas = iter(get(spans))
    stats.latency(time.perf_counter() - started)
    stats.add(unkept=len(missing), fetched_bytes=sum(n for _, n in spans))
    got: dict[int, BlockRead] = {}
    for i in missing:
        parts: list[tuple[int, bytes | memoryview]] = []
        for lo, hi in merged[i]:
            data = next(datas)
            if len(data) != hi - lo:
                raise short_answer(url, len(data), hi - lo, i * b + lo)
            parts.append((lo, data))
        got[i] = BlockRead(merged[i][-1][1], parts)
    return got


def short_answer(url: str, received: int, length: int, start: int) -> BadSample:
    """The bad sample of a store's answer of fewer bytes than asked."""
    return BadSample(
        "unreadable",
        f"{url}: the store answered {received} bytes for the {length} at {start}; the object "
        "may have changed or been truncated",
    )
