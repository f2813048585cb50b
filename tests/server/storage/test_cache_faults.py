"""The node cache under faults of its disk and its directory: a block that cannot be read (a
directory or a FIFO in its place, an I/O error, a refused open, a read-only disk) is fetched
again or read without the cache, never a failed read; a directory another user may write
in is refused at start; a link in a file's place is not followed.

Faults are real where they can be made as root: a directory or a FIFO in a block's place, a
symbolic link, a read-only bind mount (``unshare -m`` in a subprocess), modes and owners.
EIO and EACCES cannot be made on a healthy disk by root (``chmod`` does not stop root), so
those two come from a shim of ``os.open``/``os.pread`` for the block files only.
"""

from __future__ import annotations

import errno
import os
import shutil
import subprocess
import sys
import textwrap
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from batchd_server.errors import FailedPrecondition
from batchd_server.storage import blocks as blocks_module
from batchd_server.storage.blocks import BlockKey, BlockStore, object_hash
from batchd_server.storage.cache import CacheStats, CachingFetcher, cached
from tests.cache_support import BLOCK, CHUNK, StatDirFetcher, small_store

REPO = Path(__file__).resolve().parents[3]


@pytest.fixture
def objects(tmp_path: Path) -> Path:
    root = tmp_path / "objects"
    root.mkdir()
    (root / "a.bin").write_bytes(np.random.default_rng(5).bytes(4 * BLOCK))
    return root


def make(objects: Path, cache: Path) -> tuple[CachingFetcher, StatDirFetcher]:
    inner = StatDirFetcher(objects)
    return CachingFetcher(inner, small_store(cache), stats=CacheStats()), inner


def _cached_block(objects: Path, cache: Path) -> tuple[CachingFetcher, StatDirFetcher, Path]:
    fetcher, inner = make(objects, cache)
    url = inner.url("a.bin")
    fetcher.fetch(url, [(BLOCK, BLOCK)])
    inner.requests.clear()
    return fetcher, inner, fetcher.store.path(BlockKey(object_hash(url), 1))


def _in_place(path: Path, kind: str) -> None:
    path.unlink()
    if kind == "directory":
        path.mkdir()
    elif kind == "full-directory":
        path.mkdir()
        (path / "x").write_bytes(b"x")
    elif kind == "fifo":
        os.mkfifo(path)
    else:
        path.symlink_to("/etc/hostname")


def _in_thread(call: Callable[[], Any]) -> Any:
    """``call()`` in a thread, so that a read that blocks forever (an open of a FIFO with no
    writer) fails the test instead of hanging it; the bound is a generous 30 s."""
    box: list[Any] = []

    def run() -> None:
        try:
            box.append(("ok", call()))
        except BaseException as e:
            box.append(("raised", e))

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(30)
    assert box, "the read blocked (an open without O_NONBLOCK waits for a FIFO's writer)"
    kind, value = box[0]
    if kind == "raised":
        raise value
    return value


@pytest.mark.parametrize("kind", ["directory", "full-directory", "fifo", "symlink"])
def test_something_else_in_a_blocks_place_is_fetched_again(
    objects: Path, tmp_path: Path, kind: str
) -> None:
    """A directory, a FIFO or a link where a block file should be: the read is right (from
    the store), the thing is removed and the block kept again; one that cannot be removed (a
    directory with files) is read around at every read, never an error."""
    fetcher, inner, path = _cached_block(objects, tmp_path / "cache")
    url = inner.url("a.bin")
    data = (objects / "a.bin").read_bytes()
    _in_place(path, kind)
    got = _in_thread(lambda: fetcher.fetch(url, [(BLOCK + 3, 40)]))
    assert got == [data[BLOCK + 3 : BLOCK + 43]]
    assert inner.requests == [(url, [(BLOCK, BLOCK)])]
    assert fetcher.stats.take().corrupt >= 1  # twice where it stays: before and after the lock
    if kind == "full-directory":
        assert path.is_dir()
        assert _in_thread(lambda: fetcher.fetch(url, [(BLOCK, 10)])) == [data[BLOCK : BLOCK + 10]]
    else:
        assert path.is_file() and not path.is_symlink()
        assert fetcher.fetch(url, [(BLOCK, 10)]) == [data[BLOCK : BLOCK + 10]]
        assert len(inner.requests) == 1, "kept again: the second read is a hit"


@pytest.mark.parametrize("error", [errno.EIO, errno.EACCES])
@pytest.mark.parametrize("where", ["open", "pread"])
def test_an_unreadable_block_is_fetched_again(
    objects: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, error: int, where: str
) -> None:
    """An I/O error or a refused open of a block file (a shim: root cannot make either on a
    healthy disk) is a miss: the file is removed and the block fetched again."""
    fetcher, inner, path = _cached_block(objects, tmp_path / "cache")
    url = inner.url("a.bin")
    data = (objects / "a.bin").read_bytes()
    real_open, real_pread = os.open, os.pread
    failing = {str(path)}

    def shim_open(file: Any, flags: int, *args: Any, **kwargs: Any) -> int:
        if where == "open" and str(file) in failing:
            raise OSError(error, os.strerror(error), str(file))
        return real_open(file, flags, *args, **kwargs)

    def shim_pread(fd: int, n: int, at: int) -> bytes:
        if where == "pread" and os.readlink(f"/proc/self/fd/{fd}") in failing:
            raise OSError(error, os.strerror(error))
        return real_pread(fd, n, at)

    monkeypatch.setattr(os, "open", shim_open)
    monkeypatch.setattr(os, "pread", shim_pread)
    assert fetcher.fetch(url, [(BLOCK + 5, 30)]) == [data[BLOCK + 5 : BLOCK + 35]]
    assert inner.requests == [(url, [(BLOCK, BLOCK)])]
    failing.clear()  # the disk is well again: the block fetched anew is a hit
    assert fetcher.fetch(url, [(BLOCK, 10)]) == [data[BLOCK : BLOCK + 10]]
    assert len(inner.requests) == 1


_READ_ONLY = textwrap.dedent(
    """
    import sys
    from pathlib import Path
    from batchd_server.storage.cache import CacheStats, CachingFetcher, cached
    from tests.cache_support import BLOCK, StatDirFetcher

    cache, objects = Path(sys.argv[1]), Path(sys.argv[2])
    inner = StatDirFetcher(objects)
    fetcher = cached(inner, cache, capacity_bytes=1 << 30, block_bytes=BLOCK)
    url = inner.url("a.bin")
    data = (objects / "a.bin").read_bytes()
    # Block 1 was cached before the disk went read-only; blocks 2 and 3 were not.
    assert fetcher.fetch(url, [(BLOCK, 100), (2 * BLOCK, 2 * BLOCK)]) == [
        data[BLOCK : BLOCK + 100], data[2 * BLOCK : 4 * BLOCK]
    ]
    print("read", type(fetcher).__name__)
    """
)


def test_a_read_only_cache_disk_reads_from_the_store(objects: Path, tmp_path: Path) -> None:
    """The cache directory on a disk that went read-only (EROFS, a real bind mount in a
    private mount namespace): a new process's reads are right, from the store, with a
    warning; no read fails."""
    assert shutil.which("unshare") is not None, "this test needs unshare(1) (util-linux)"
    cache = tmp_path / "cache"
    _cached_block(objects, cache)
    script = (
        f'mount --bind -o ro {cache} {cache} && exec {sys.executable} -c "$0" {cache} {objects}'
    )
    server_src = Path(blocks_module.__file__).parents[2]  # the batchd_server under test
    env = {**os.environ, "PYTHONPATH": f"{server_src}:{REPO}"}
    done = subprocess.run(
        ["unshare", "-m", "sh", "-c", script, _READ_ONLY],
        capture_output=True,
        text=True,
        env=env,
        cwd=REPO,
        timeout=120,
    )
    if "unshare failed" in done.stderr or "Operation not permitted" in done.stderr:
        pytest.fail(f"this test needs mount namespaces (root): {done.stderr}")
    assert done.returncode == 0, done.stderr
    assert "read" in done.stdout
    assert "Read-only file system" in done.stderr, "the fault is said in a warning"


# -- the directory, trusted only when it is the server's alone -------------------------


@pytest.mark.parametrize("mode", [0o777, 0o775, 0o757])
def test_a_cache_directory_others_may_write_in_is_refused(tmp_path: Path, mode: int) -> None:
    cache = tmp_path / "cache"
    cache.mkdir()
    cache.chmod(mode)
    with pytest.raises(FailedPrecondition, match=r"writable by its group or by anyone.*chmod"):
        cached(StatDirFetcher(tmp_path), cache, capacity_bytes=1 << 30)


def test_a_block_directory_others_may_write_in_is_refused(tmp_path: Path) -> None:
    small_store(tmp_path / "cache").close()
    (tmp_path / "cache" / "blocks" / "7f").chmod(0o777)
    with pytest.raises(FailedPrecondition, match=r"blocks/7f is writable"):
        small_store(tmp_path / "cache")


def test_a_cache_directory_of_another_user_is_refused(tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    cache.mkdir(mode=0o700)
    os.chown(cache, os.geteuid() + 1, -1)
    with pytest.raises(FailedPrecondition, match=r"owned by uid .*chown"):
        small_store(cache)


def test_a_link_in_place_of_a_block_directory_is_refused(tmp_path: Path) -> None:
    small_store(tmp_path / "cache").close()
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir(mode=0o700)
    (tmp_path / "cache" / "blocks" / "00").rmdir()
    (tmp_path / "cache" / "blocks" / "00").symlink_to(elsewhere)
    with pytest.raises(FailedPrecondition, match=r"not a directory"):
        small_store(tmp_path / "cache")


@pytest.mark.parametrize("name", ["usage", "fetching"])
def test_the_ledger_and_the_lock_file_are_not_opened_through_a_link(
    tmp_path: Path, name: str
) -> None:
    """A link put in place of the ledger (or the fetch locks' file) would have the server
    write where the link points: it is refused (ELOOP), the target untouched."""
    target = tmp_path / "target"
    target.write_bytes(b"keep")
    cache = tmp_path / "cache"
    cache.mkdir(mode=0o700)
    (cache / name).symlink_to(target)
    with pytest.raises(OSError) as caught:
        BlockStore(cache, capacity_bytes=1 << 30, block_bytes=BLOCK, chunk_bytes=CHUNK)
    assert caught.value.errno == errno.ELOOP
    assert target.read_bytes() == b"keep"


@pytest.mark.parametrize("name", ["usage", "fetching"])
def test_a_fifo_in_place_of_the_ledger_does_not_hang_the_start(tmp_path: Path, name: str) -> None:
    cache = tmp_path / "cache"
    cache.mkdir(mode=0o700)
    os.mkfifo(cache / name)
    with pytest.raises((FailedPrecondition, OSError), match="not a regular file"):
        _in_thread(lambda: small_store(cache))


def test_a_record_in_place_of_another_kind_of_file_is_ignored(
    objects: Path, tmp_path: Path
) -> None:
    """A FIFO where an object's record should be is no size (and no hang): the size is
    asked of the store."""
    fetcher, inner = make(objects, tmp_path / "cache")
    url = inner.url("a.bin")
    h = object_hash(url)
    os.mkfifo(tmp_path / "cache" / "blocks" / h[:2] / f"{h}.json")
    assert _in_thread(lambda: fetcher.store.meta(url)) is None
    assert fetcher.size(url) == 4 * BLOCK and inner.stats == 1


def test_modules_open_every_cache_file_without_following_links() -> None:
    """The flags every cache file is opened with (a tripwire for a new ``os.open``)."""
    from batchd_server.storage import cache_dir as cache_dir_module

    assert cache_dir_module._OPEN_FLAGS & os.O_NOFOLLOW
    assert cache_dir_module._OPEN_FLAGS & os.O_NONBLOCK
    source = Path(blocks_module.__file__).read_text()
    assert "os.open(" not in source, "open cache files with cache_dir.open_file"
