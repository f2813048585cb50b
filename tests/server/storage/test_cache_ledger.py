"""The node cache's ledger stays what the files take while others write: a recount lists the
files without holding the ledger's lock (writers do not wait for it) and counts what they
change meanwhile once; a delete that races another process's re-link of the same block
gives back what it removed, not what it first saw.

The races are made deterministic by hooking the step in between (the listing of one block
directory; the unlink of a block), and another store on the same directory (another
process's view: its own descriptor and lock) acting there, if the ledger's lock lets it.
"""

from __future__ import annotations

import fcntl
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from batchd_server.storage.blocks import BlockKey, BlockStore
from tests.cache_support import BLOCK, small_store


def key(prefix: int, index: int = 0) -> BlockKey:
    """A block whose file is in block directory ``prefix``."""
    return BlockKey(f"{prefix:02x}" + "ab" * 19, index)


def lock_is_free(cache: Path) -> bool:
    """Whether no one holds the ledger's lock now (probed from a descriptor of its own)."""
    fd = os.open(cache / "usage", os.O_RDWR)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    else:
        fcntl.flock(fd, fcntl.LOCK_UN)
        return True
    finally:
        os.close(fd)


def files_take(cache: Path) -> int:
    """What the block files under ``cache`` take, counted from the disk."""
    return sum(p.stat().st_size for p in (cache / "blocks").glob("*/*") if p.is_file())


@pytest.fixture
def stores(tmp_path: Path) -> Iterator[tuple[BlockStore, BlockStore]]:
    """Two stores on one directory: the server's and another process's."""
    mine, other = small_store(tmp_path / "cache"), small_store(tmp_path / "cache")
    yield mine, other
    mine.close()
    other.close()


def test_a_recount_lets_writers_in_and_counts_their_changes_once(
    tmp_path: Path, stores: tuple[BlockStore, BlockStore], monkeypatch: pytest.MonkeyPatch
) -> None:
    """While the recount lists block directory 0x80, another process writes a block into
    directory 0x10 and deletes one from 0x20, both listed already: it is not kept waiting,
    and the ledger after the recount is exactly what the files take."""
    mine, other = stores
    cache = tmp_path / "cache"
    for prefix in (0x10, 0x20, 0x90):
        assert mine.write(key(prefix), os.urandom(BLOCK))
    (cache / "usage").write_bytes((10**9).to_bytes(8, "little"))  # a crash left it high
    seen: dict[str, Any] = {}
    real_scandir = os.scandir

    def hooked(path: Any = ".") -> Any:
        if str(path).endswith("/blocks/80") and "free" not in seen:
            seen["free"] = lock_is_free(cache)
            if seen["free"]:
                assert other.write(key(0x10, 1), os.urandom(BLOCK // 2))
                assert other.delete(key(0x20))
        return real_scandir(path)

    monkeypatch.setattr(os, "scandir", hooked)
    mine.scan()
    monkeypatch.setattr(os, "scandir", real_scandir)
    assert seen["free"], "the recount held the ledger's lock while it listed the files"
    assert mine.used_bytes() == files_take(cache) == other.used_bytes()
    assert mine.used_bytes() == 2 * mine.file_bytes(BLOCK) + mine.file_bytes(BLOCK // 2)


def test_a_delete_racing_a_relink_gives_back_what_it_removed(
    tmp_path: Path, stores: tuple[BlockStore, BlockStore], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Between a delete's look at a block file and its unlink, another process deletes the
    block and links a new, longer one (a refetch of more of it). The delete must not remove
    the new file while giving back the old one's bytes: the ledger would drift for good.
    (Made so by looking, unlinking and giving back under the ledger's lock: the other process
    cannot act in between.)"""
    mine, other = stores
    cache = tmp_path / "cache"
    k = key(0x42)
    assert mine.write(k, os.urandom(100))
    path = str(mine.path(k))
    raced: dict[str, bool] = {}
    real_unlink = os.unlink

    def hooked(target: Any, *args: Any, **kwargs: Any) -> None:
        if str(target) == path and "free" not in raced:
            raced["free"] = lock_is_free(cache)
            if raced["free"]:  # the other process's delete and relink, in between
                assert other.delete(k)
                assert other.write(k, os.urandom(BLOCK))
        real_unlink(target, *args, **kwargs)

    monkeypatch.setattr(os, "unlink", hooked)
    mine.delete(k)
    monkeypatch.setattr(os, "unlink", real_unlink)
    assert mine.used_bytes() == files_take(cache), "the ledger drifted from the files"
    assert raced == {"free": False}, "the delete let another process in between"
