"""Misses streamed into the node cache (the path an S3 store takes): each block's file is
written from the pieces as they arrive, and a stream that ends early or breaks leaves no
block behind that it did not finish, nor room taken in the ledger."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from batchd_server.pipelines.base import BadSample
from batchd_server.storage.blocks import RECORD_BYTES, BlockKey, object_hash
from batchd_server.storage.cache import CacheStats, CachingFetcher
from tests.cache_support import BLOCK, StreamStatDirFetcher, being_written, small_store


@pytest.fixture
def data(tmp_path: Path) -> bytes:
    root = tmp_path / "objects"
    root.mkdir()
    content = np.random.default_rng(3).bytes(4 * BLOCK + 77)
    (root / "a.bin").write_bytes(content)
    return content


@pytest.mark.parametrize("piece", [1, 100, 256, 5000])
def test_a_block_written_in_pieces_is_the_file_written_at_once(tmp_path: Path, piece: int) -> None:
    """Pieces of any size, across chunk edges, make the same file, byte for byte, as one
    write of the whole content (header, chunk table and content), and it reads back."""
    content = np.random.default_rng(piece).bytes(BLOCK - 5)
    whole, pieces = small_store(tmp_path / "whole"), small_store(tmp_path / "pieces")
    key = BlockKey(object_hash("s3://b/k"), 2)
    assert whole.write(key, content)
    writer = pieces.writer(key, len(content))
    assert writer is not None
    view = memoryview(content)
    for at in range(0, len(content), piece):
        writer.add(view[at : at + piece])
    assert writer.finish()
    assert pieces.path(key).read_bytes() == whole.path(key).read_bytes()
    got = pieces.read(key, [(0, len(content))])
    assert got is not None and got.parts is not None
    assert bytes(got.cut(0, len(content))) == content
    assert pieces.used_bytes() == whole.used_bytes() == pieces.file_bytes(len(content))
    assert being_written(tmp_path / "pieces") == []


def test_an_aborted_writer_leaves_no_file_and_gives_its_room_back(tmp_path: Path) -> None:
    store = small_store(tmp_path)
    writer = store.writer(BlockKey(object_hash("s3://b/k"), 0), BLOCK)
    assert writer is not None and store.used_bytes() == store.file_bytes(BLOCK)
    writer.add(memoryview(b"x" * 10))
    writer.abort()
    writer.abort()
    assert store.used_bytes() == 0
    assert being_written(tmp_path) == [] and store.blocks() == {}
    store.capacity_bytes = store.file_bytes(BLOCK) - 1
    assert store.writer(BlockKey(object_hash("s3://b/k"), 0), BLOCK) is None, "no room"


class _Short(StreamStatDirFetcher):
    """Streams at most ``limit`` bytes of a range, then ends (``fail``: raises instead), as
    an object cut short, or a connection lost through the retries, would."""

    def __init__(self, root: Path, limit: int, *, fail: bool) -> None:
        super().__init__(root)
        self.limit, self.fail = limit, fail

    def stream(self, url: str, offset: int, length: int) -> Iterator[bytes]:
        sent = 0
        for piece in super().stream(url, offset, length):
            piece = piece[: self.limit - sent]
            if not piece:
                break
            sent += len(piece)
            yield piece
        if self.fail:
            raise BadSample("transient", f"{url}: connection reset")


@pytest.mark.parametrize("fail", [False, True], ids=["ends-early", "breaks"])
def test_a_stream_cut_short_keeps_the_blocks_it_finished_and_nothing_else(
    tmp_path: Path, data: bytes, fail: bool
) -> None:
    """A run of four blocks whose stream stops inside the third: the read fails (unreadable
    when the store said no more, transient when the connection broke), blocks 0 and 1 are
    cached and intact, nothing else is, the ledger holds exactly them and no temporary file
    is left. The next read, the store whole again, fetches only what is missing."""
    inner = _Short(tmp_path / "objects", 2 * BLOCK + 300, fail=fail)
    fetcher = CachingFetcher(inner, small_store(tmp_path / "cache"), stats=CacheStats())
    url = inner.url("a.bin")
    with pytest.raises(BadSample) as caught:
        fetcher.fetch(url, [(0, 4 * BLOCK)])
    assert caught.value.kind == ("transient" if fail else "unreadable")
    store = fetcher.store
    h = object_hash(url)
    assert set(store.blocks()) == {BlockKey(h, 0), BlockKey(h, 1)}
    assert store.used_bytes() == 2 * store.file_bytes(BLOCK) + RECORD_BYTES * len(
        store.listing()[1]
    )
    assert being_written(tmp_path / "cache") == []
    inner.limit, inner.fail = len(data), False
    inner.requests.clear()
    assert fetcher.fetch(url, [(0, 4 * BLOCK)]) == [data[: 4 * BLOCK]]
    assert inner.requests == [(url, [(2 * BLOCK, 2 * BLOCK)])]


def test_block_directories_are_made_when_the_store_opens(tmp_path: Path) -> None:
    """All 256 block directories exist once a store opens (a cold epoch then makes no
    directory per new prefix); one deleted behind the store's back is made again by the
    first block that needs it."""
    store = small_store(tmp_path / "cache")
    blocks = tmp_path / "cache" / "blocks"
    assert sorted(os.listdir(blocks)) == [f"{i:02x}" for i in range(256)]
    key = BlockKey(object_hash("s3://b/k"), 0)
    (blocks / key.object[:2]).rmdir()
    assert store.write(key, b"x" * 10)
    got = store.read(key, [(0, 10)])
    assert got is not None and bytes(got.cut(0, 10)) == b"x" * 10
