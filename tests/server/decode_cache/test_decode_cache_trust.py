"""What the decode cache trusts: only entries that are its own user's regular files, a disk
directory no one else may write, and that directory for one server at a time
(NOTE [ Foreign entries ] in ``shm/entries.py``, NOTE [ One server per directory ] in
``decode_cache/directory.py``). The tests run as root, so they can make files of another
user; run as another user, they skip with the reason."""

from __future__ import annotations

import logging
import os
from pathlib import Path

import numpy as np
import pytest

from batchd_server.decode_cache.directory import LOCK_NAME
from batchd_server.decode_cache.entry import pack
from batchd_server.decode_cache.owner import DecodeCacheOwner
from batchd_server.decode_cache.worker import DecodeCacheSpec, SampleCache
from batchd_server.errors import FailedPrecondition
from batchd_server.shm.entries import EntryDir, disk_entry_dir, shm_entry_dir

KEY = bytes(range(32))
NAME = "c" * 32
OTHER_UID = 54321
INSTANCE = "0123456789ab"

as_root = pytest.mark.skipif(os.geteuid() != 0, reason="making another user's file needs root")


def entry() -> bytes:
    return b"".join(bytes(p) for p in pack(KEY, {"k": 1}, {"a": np.full(64, 9, np.uint8)}))


def sticky_shm_tier(tmp_path: Path) -> EntryDir:
    """A tier in a directory like /dev/shm: everyone may write it, sticky."""
    shm = tmp_path / "shm"
    shm.mkdir()
    shm.chmod(0o1777)
    found = shm_entry_dir(shm, INSTANCE, 1 << 20)
    found.create()
    return found


def plant(tier: EntryDir, *, uid: int | None = None, mode: int = 0o600) -> Path:
    """A whole, valid entry under ``NAME``, as an attacker would write it."""
    path = Path(tier.entry_path(NAME))
    path.write_bytes(entry())
    path.chmod(mode)
    if uid is not None:
        os.chown(path, uid, uid)
    return path


def test_our_own_entry_is_served(tmp_path: Path) -> None:
    tier = sticky_shm_tier(tmp_path)
    plant(tier)
    assert SampleCache(DecodeCacheSpec((tier,))).get(NAME, KEY) is not None


@as_root
def test_another_users_entry_is_never_served_nor_counted(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A whole, valid entry with the right key, planted by another user in /dev/shm: a miss
    (logged), and the owner's count and eviction scan leave it out."""
    tier = sticky_shm_tier(tmp_path)
    path = plant(tier, uid=OTHER_UID)
    cache = SampleCache(DecodeCacheSpec((tier,)))
    with caplog.at_level(logging.WARNING):
        assert cache.get(NAME, KEY) is None
    assert f"owned by uid {OTHER_UID}" in caplog.text and str(path) in caplog.text
    assert cache.take_counts().hits == 0
    assert tier.recount() == 0
    assert [e.name for e in tier.entries()] == []


def test_an_entry_others_may_write_is_not_served(tmp_path: Path) -> None:
    tier = sticky_shm_tier(tmp_path)
    plant(tier, mode=0o666)
    assert tier.read(NAME) is None


def test_a_fifo_or_a_symlink_under_an_entrys_name_is_a_miss_at_once(tmp_path: Path) -> None:
    """A FIFO would block a reader that opened it without O_NONBLOCK until someone writes
    to it; a symlink would serve whatever it points at."""
    tier = sticky_shm_tier(tmp_path)
    os.mkfifo(tier.entry_path(NAME), 0o600)
    assert tier.read(NAME) is None
    os.unlink(tier.entry_path(NAME))
    target = tmp_path / "target"
    target.write_bytes(entry())
    os.symlink(target, tier.entry_path(NAME))
    assert tier.read(NAME) is None
    assert tier.recount() == 0


def owner(disk: Path, shm: Path) -> DecodeCacheOwner:
    return DecodeCacheOwner(
        shm_dir=shm, instance=INSTANCE, size_bytes=1 << 20, disk_dir=disk, disk_bytes=1 << 20
    )


def test_a_disk_directory_others_may_write_is_refused(tmp_path: Path) -> None:
    disk = tmp_path / "dc"
    disk.mkdir()
    disk.chmod(0o777)
    with pytest.raises(FailedPrecondition, match=r"--decode-cache-dir .*mode 0777.*chmod go-w"):
        owner(disk, tmp_path)
    disk.chmod(0o770)
    with pytest.raises(FailedPrecondition, match="mode 0770"):
        owner(disk, tmp_path)
    assert not [p for p in tmp_path.iterdir() if p.name.startswith("batchd-")], "nothing made"


@as_root
def test_another_users_disk_directory_is_refused(tmp_path: Path) -> None:
    disk = tmp_path / "dc"
    disk.mkdir(mode=0o700)
    os.chown(disk, OTHER_UID, OTHER_UID)
    with pytest.raises(FailedPrecondition, match=f"owned by uid {OTHER_UID}"):
        owner(disk, tmp_path)


def test_a_new_disk_directory_is_made_for_the_server_alone(tmp_path: Path) -> None:
    disk = tmp_path / "new" / "dc"
    first = owner(disk, tmp_path)
    first.close()
    assert disk.stat().st_mode & 0o777 == 0o700


def test_a_second_server_on_one_disk_directory_is_refused_naming_it_and_the_holder(
    tmp_path: Path,
) -> None:
    disk = tmp_path / "dc"
    first = owner(disk, tmp_path)
    try:
        with pytest.raises(FailedPrecondition) as refused:
            owner(disk, tmp_path / "other")
        assert str(disk) in str(refused.value)
        assert f"pid {os.getpid()}" in str(refused.value)
        assert (disk / LOCK_NAME).read_text().strip() == str(os.getpid())
    finally:
        first.close()
    again = owner(disk, tmp_path)  # once the first is gone, the directory is free
    again.close()


def test_a_disk_tier_checks_each_entry_too(tmp_path: Path) -> None:
    disk = tmp_path / "dc"
    disk.mkdir(mode=0o700)
    tier = disk_entry_dir(disk, 1 << 20)
    tier.create()
    plant(tier, mode=0o622)
    assert tier.read(NAME) is None
