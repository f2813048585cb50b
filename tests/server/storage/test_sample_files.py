"""SampleFiles reads sample bytes from under a dataset root, and never from outside it."""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from batchd_server.errors import FailedPrecondition
from batchd_server.pipelines.base import BadSample
from batchd_server.storage import files as files_module
from batchd_server.storage.files import SampleFiles

NOBODY = 65534


def kind_of(files: SampleFiles, path: str, offset: int = -1, length: int = -1) -> str:
    with pytest.raises(BadSample) as caught:
        files.read(path, offset, length)
    return caught.value.kind


@pytest.fixture
def root(tmp_path: Path) -> Path:
    """A dataset root with one file, one nested file and a secret beside the root."""
    data = tmp_path / "data"
    (data / "cls").mkdir(parents=True)
    (data / "a.bin").write_bytes(b"alpha")
    (data / "cls" / "b.bin").write_bytes(b"bravo!")
    (tmp_path / "secret.txt").write_bytes(b"do not serve")
    return data


@pytest.fixture
def files(root: Path) -> Iterator[SampleFiles]:
    with SampleFiles(str(root)) as f:
        yield f


def test_whole_files_are_read_exactly(files: SampleFiles) -> None:
    """A path without a byte range yields the whole file."""
    assert bytes(files.read("a.bin")) == b"alpha"
    assert bytes(files.read("cls/b.bin")) == b"bravo!"
    assert bytes(files.read("./cls//b.bin")) == b"bravo!"


def test_byte_ranges_of_shard_files_are_read_exactly(root: Path, files: SampleFiles) -> None:
    """Many ranges of many shards, more shards than cached descriptors, all read right."""
    rng = np.random.default_rng(0)
    shards = {f"shard{i:02d}.bin": rng.bytes(4096) for i in range(24)}
    for name, blob in shards.items():
        (root / name).write_bytes(blob)
    for _ in range(500):
        name = f"shard{int(rng.integers(24)):02d}.bin"
        offset = int(rng.integers(0, 4096))
        length = int(rng.integers(0, 4096 - offset + 1))
        assert bytes(files.read(name, offset, length)) == shards[name][offset : offset + length]


def test_an_offset_without_a_length_reads_to_the_end(files: SampleFiles) -> None:
    """offset >= 0 with length -1 is the rest of the file."""
    assert bytes(files.read("a.bin", 2, -1)) == b"pha"
    assert bytes(files.read("a.bin", 5, -1)) == b""


def test_a_range_past_the_end_is_unreadable_and_says_why(files: SampleFiles) -> None:
    """The message names the file size and the range asked for."""
    with pytest.raises(BadSample) as caught:
        files.read("a.bin", 3, 10)
    assert caught.value.kind == "unreadable"
    assert "[3, 13)" in str(caught.value) and "5 bytes" in str(caught.value)
    assert kind_of(files, "a.bin", 6, -1) == "unreadable"
    assert kind_of(files, "a.bin", -5, 2) == "unreadable"


def test_absolute_paths_are_unsafe_even_inside_the_root(root: Path, files: SampleFiles) -> None:
    """Catalog paths are relative; an absolute one is refused whatever it names."""
    assert kind_of(files, str(root / "a.bin")) == "unsafe_path"
    assert kind_of(files, "/etc/passwd") == "unsafe_path"


def test_dotdot_is_unsafe_before_the_filesystem_is_consulted(files: SampleFiles) -> None:
    """'..' is refused by its spelling: even when the target is missing or inside the root."""
    assert kind_of(files, "../secret.txt") == "unsafe_path"
    assert kind_of(files, "../no-such-file") == "unsafe_path"
    assert kind_of(files, "cls/../a.bin") == "unsafe_path"
    assert kind_of(files, "cls/..") == "unsafe_path"


def test_symlinks_out_of_the_root_are_unsafe(root: Path, files: SampleFiles) -> None:
    """A file or directory symlink leading outside the root is refused, dangling or not."""
    (root / "leak.txt").symlink_to(root.parent / "secret.txt")
    (root / "outdir").symlink_to(root.parent)
    (root / "dangling").symlink_to(root.parent / "nothing-here")
    assert kind_of(files, "leak.txt") == "unsafe_path"
    assert kind_of(files, "outdir/secret.txt") == "unsafe_path"
    assert kind_of(files, "dangling") == "unsafe_path"
    with pytest.raises(BadSample) as caught:
        files.map_whole("leak.txt")
    assert caught.value.kind == "unsafe_path"


def test_symlinks_inside_the_root_are_followed(root: Path, files: SampleFiles) -> None:
    """Symlinks to files and directories that stay under the root are fine."""
    (root / "alias.bin").symlink_to("cls/b.bin")
    (root / "alias_dir").symlink_to(root / "cls")
    assert bytes(files.read("alias.bin")) == b"bravo!"
    assert bytes(files.read("alias_dir/b.bin", 1, 3)) == b"rav"


def test_files_in_a_directory_already_read_stay_confined(root: Path, files: SampleFiles) -> None:
    """After a directory's first file, its next files open through the remembered directory:
    a symlink file in it is still followed only inside the root, a file that vanished is
    missing, and the directory swapped for a symlink out of the root is refused."""
    assert bytes(files.read("cls/b.bin")) == b"bravo!"  # cls/ is now known
    (root / "cls" / "inside.bin").symlink_to(root / "a.bin")
    (root / "cls" / "leak.txt").symlink_to(root.parent / "secret.txt")
    (root / "cls" / "gone.bin").write_bytes(b"x")
    assert bytes(files.read("cls/inside.bin")) == b"alpha"
    assert kind_of(files, "cls/leak.txt") == "unsafe_path"
    (root / "cls" / "gone.bin").unlink()
    assert kind_of(files, "cls/gone.bin") == "missing"
    outside = root.parent / "outside"
    outside.mkdir()
    (outside / "b.bin").write_bytes(b"not yours")
    shutil.rmtree(root / "cls")
    (root / "cls").symlink_to(outside)
    assert kind_of(files, "cls/b.bin") == "unsafe_path"


def test_a_symlink_loop_is_refused(root: Path, files: SampleFiles) -> None:
    """A loop never hangs or crashes the reader."""
    (root / "loop1").symlink_to("loop2")
    (root / "loop2").symlink_to("loop1")
    assert kind_of(files, "loop1") == "unsafe_path"


def test_a_root_that_is_a_symlink_works(root: Path, tmp_path: Path) -> None:
    """The root is resolved once; its own symlink is not an escape."""
    link = tmp_path / "root-link"
    link.symlink_to(root)
    with SampleFiles(str(link)) as files:
        assert bytes(files.read("cls/b.bin")) == b"bravo!"
        assert kind_of(files, "../secret.txt") == "unsafe_path"


def test_a_root_that_is_not_a_directory_fails_the_session(root: Path) -> None:
    """A missing root, or a file, is FailedPrecondition with the path in the message."""
    for bad in (root / "nope", root / "a.bin"):
        with pytest.raises(FailedPrecondition, match=str(bad)):
            SampleFiles(str(bad))


def test_missing_files_are_missing(files: SampleFiles) -> None:
    """A missing file, a missing directory, or a file used as a directory."""
    assert kind_of(files, "nope.bin") == "missing"
    assert kind_of(files, "nodir/nope.bin") == "missing"
    assert kind_of(files, "a.bin/inner") == "missing"
    assert kind_of(files, "nope.bin", 0, 1) == "missing"


def test_directories_and_fifos_are_unreadable_and_never_block(
    root: Path, files: SampleFiles
) -> None:
    """Only regular files are read: a directory (EISDIR) or a FIFO (which would block) is not."""
    os.mkfifo(root / "pipe")
    assert kind_of(files, "cls") == "unreadable"
    assert kind_of(files, "") == "unreadable"
    assert kind_of(files, "pipe") == "unreadable"
    assert kind_of(files, "pipe", 0, 1) == "unreadable"


def test_a_nul_byte_in_a_path_is_refused(files: SampleFiles) -> None:
    """The OS cannot name such a file; it is not a crash."""
    assert kind_of(files, "a.bin\x00.jpg") == "unsafe_path"


def read_kind_as(uid: int, root: str, path: str) -> str:
    """The BadSample kind (or "ok") of reading ``path`` in a forked child running as ``uid``."""
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: never returns into pytest
        code = 1
        try:
            os.close(read_end)
            if uid != os.geteuid():
                os.setgroups([])
                os.setgid(uid)
                os.setuid(uid)
            try:
                SampleFiles(root).read(path)
                result = "ok"
            except BadSample as e:
                result = e.kind
            os.write(write_end, result.encode())
            code = 0
        finally:
            os._exit(code)
    os.close(write_end)
    try:
        result = os.read(read_end, 100).decode()
    finally:
        os.close(read_end)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    return result


def test_a_file_without_read_permission_is_unreadable() -> None:
    """EACCES becomes 'unreadable'.

    Root bypasses file permissions, and the tests run as root here, so the read happens in a
    forked child that has dropped to nobody (a fork, not a new interpreter: the interpreter
    lives under /root, which nobody cannot enter). The root directory is made in /tmp
    because pytest's own temporary tree is not traversable by other users.
    """
    base = tempfile.mkdtemp(prefix="batchd-perm-", dir="/tmp")
    try:
        os.chmod(base, 0o755)
        secret = Path(base, "secret.bin")
        secret.write_bytes(b"x")
        secret.chmod(0)
        uid = NOBODY if os.geteuid() == 0 else os.geteuid()
        assert read_kind_as(uid, base, "secret.bin") == "unreadable"
        secret.chmod(0o644)
        assert read_kind_as(uid, base, "secret.bin") == "ok"
    finally:
        shutil.rmtree(base)


def test_reads_reuse_one_buffer_and_never_move_earlier_views(root: Path) -> None:
    """Same-size reads share a buffer; a bigger read gets a new one, the old view stays."""
    (root / "big.bin").write_bytes(bytes(range(256)) * 64)
    with SampleFiles(str(root)) as files:
        first = files.read("cls/b.bin")
        second = files.read("a.bin")
        assert first.obj is second.obj
        small = bytes(second)
        big = files.read("big.bin")
        assert big.obj is not second.obj
        assert bytes(second) == small
        assert files.read("a.bin").obj is big.obj


def test_reads_larger_than_the_cached_buffer_get_their_own(
    root: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The reused buffer is capped, so one huge sample does not pin its size forever."""
    monkeypatch.setattr(files_module, "MAX_CACHED_BUFFER_BYTES", 8)
    (root / "ten.bin").write_bytes(b"0123456789")
    with SampleFiles(str(root)) as files:
        cached = files.read("cls/b.bin")
        assert bytes(files.read("ten.bin")) == b"0123456789"
        assert files.read("a.bin").obj is cached.obj


def test_map_whole_maps_files_read_only_and_caches_them(root: Path, files: SampleFiles) -> None:
    """map_whole gives the file's bytes, read-only, the same array while cached."""
    (root / "empty.bin").write_bytes(b"")
    mapped = files.map_whole("cls/b.bin")
    assert bytes(mapped) == b"bravo!"
    assert not mapped.flags.writeable
    assert files.map_whole("cls/b.bin") is mapped
    assert len(files.map_whole("empty.bin")) == 0
    with pytest.raises(BadSample) as caught:
        files.map_whole("nope.bin")
    assert caught.value.kind == "missing"


def test_close_releases_every_cached_descriptor(root: Path) -> None:
    """Cached shard descriptors and maps are closed by close(), and closing twice is fine."""

    def open_under_root() -> list[str]:
        # Only descriptors of this dataset: other threads of the test process (servers of
        # earlier tests winding down) open and close their own meanwhile.
        found = []
        for fd in os.listdir("/proc/self/fd"):
            with contextlib.suppress(OSError):
                target = os.readlink(f"/proc/self/fd/{fd}")
                if target.startswith(str(root.resolve())):
                    found.append(target)
        return found

    assert open_under_root() == []
    files = SampleFiles(str(root))
    files.read("a.bin", 0, 1)
    files.read("cls/b.bin", 0, 1)
    files.map_whole("a.bin")
    assert len(open_under_root()) >= 2
    files.close()
    files.close()
    assert open_under_root() == []
