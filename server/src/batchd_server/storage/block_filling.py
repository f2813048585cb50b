"""One block of a run being streamed from the store into the node cache (NOTE [ Cache
files ] in ``blocks.py``): its file's writer and a reader's copies of the spans it asked."""

from __future__ import annotations

from batchd_server.storage.blocks import BlockKey, BlockRead, BlockStore

__all__ = ["Filling"]


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
    ) -> None:
        b = store.block_bytes
        self.index = index
        self.size = min((index + 1) * b, start + length) - index * b
        self.at = 0
        self.writer = store.writer(BlockKey(h, index), self.size)
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
