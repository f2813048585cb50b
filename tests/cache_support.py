"""A RangeFetcher over a local directory, for the node cache's tests: it reads real files,
counts its requests, and can be stopped like a store that went away."""

from __future__ import annotations

import threading
from collections.abc import Iterator, Sequence
from pathlib import Path

from batchd_server.pipelines.base import BadSample
from batchd_server.storage.blocks import BlockStore

BLOCK = 1024
CHUNK = 256
"""The node cache's tests use small blocks of four checksummed chunks, so that a few KiB of
data cross many block and chunk edges."""
ROOT_URL = "file+test://bucket"
"""The root URL of a DirFetcher's objects (as a dataset root ``s3://bucket`` would be)."""


def small_store(directory: Path, capacity: int = 1 << 30) -> BlockStore:
    """A block store on ``directory`` with :data:`BLOCK` blocks of :data:`CHUNK` chunks."""
    return BlockStore(directory, capacity_bytes=capacity, block_bytes=BLOCK, chunk_bytes=CHUNK)


def being_written(directory: Path) -> list[str]:
    """The files being written (or left half-written) in a cache directory."""
    return [p.name for p in (directory / "blocks").glob("*/.tmp-*")]


class DirFetcher:
    """Objects are the files under ``root``; ``file+test://bucket/<relative path>`` names one."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.requests: list[tuple[str, list[tuple[int, int]]]] = []
        self.stats = 0
        self.stopped = False
        self._lock = threading.Lock()

    def url(self, relative: str) -> str:
        return f"{ROOT_URL}/{relative}"

    def _path(self, url: str) -> Path:
        assert url.startswith(ROOT_URL + "/"), url
        if self.stopped:
            raise BadSample("transient", f"{url}: the store is stopped")
        path = self.root / url[len(ROOT_URL) + 1 :]
        if not path.is_file():
            raise BadSample("missing", f"{url}: no such object")
        return path

    def fetch(self, url: str, ranges: Sequence[tuple[int, int]]) -> list[bytes]:
        path = self._path(url)
        with self._lock:
            self.requests.append((url, list(ranges)))
        data = path.read_bytes()
        out = []
        for offset, length in ranges:
            if offset + length > len(data):
                raise BadSample("unreadable", f"{url}: range past the end")
            out.append(data[offset : offset + length])
        return out

    def fetched_bytes(self) -> int:
        return sum(length for _, ranges in self.requests for _, length in ranges)


class StatDirFetcher(DirFetcher):
    """A DirFetcher that can also say an object's size (a HEAD)."""

    def size(self, url: str) -> int:
        path = self._path(url)
        with self._lock:
            self.stats += 1
        return path.stat().st_size


class StreamDirFetcher(DirFetcher):
    """A DirFetcher that also streams a range (``StreamsRanges``), in pieces of ``piece``
    bytes that fall across the cache's chunk and block edges; like an S3 store, a range that
    runs past the object's end streams what there is."""

    def __init__(self, root: Path, piece: int = 100) -> None:
        super().__init__(root)
        self.piece = piece

    def stream(self, url: str, offset: int, length: int) -> Iterator[bytes]:
        path = self._path(url)
        with self._lock:
            self.requests.append((url, [(offset, length)]))
        data = path.read_bytes()
        if offset >= len(data):
            raise BadSample("unreadable", f"{url}: range past the end")
        data = data[offset : offset + length]
        for at in range(0, len(data), self.piece):
            yield data[at : at + self.piece]


class StreamStatDirFetcher(StreamDirFetcher, StatDirFetcher):
    """A StreamDirFetcher that can also say an object's size."""
