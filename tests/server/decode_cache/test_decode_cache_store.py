"""The decode cache's parts on real files: entry checks, the tiers' bound and crash safety,
eviction by the live sessions' datasets, and its place in the shm budget."""

from __future__ import annotations

import os
import time
from pathlib import Path

import numpy as np
import pytest

import batchd_server
from batchd.errors import ResourceExhausted
from batchd_server.catalog.types import DatasetRef
from batchd_server.decode_cache.entry import pack, unpack
from batchd_server.decode_cache.keys import catalog_name, identity_of, root_tag, versions
from batchd_server.decode_cache.owner import DecodeCacheOwner
from batchd_server.decode_cache.worker import DecodeCacheSpec, SampleCache
from batchd_server.shm import ShmRegistry
from batchd_server.shm.entries import EntryDir, disk_entry_dir, shm_entry_dir

KEY = bytes(range(32))
INSTANCE = "0123456789ab"


def entry_bytes(key: bytes = KEY, fill: int = 7, n: int = 100) -> bytearray:
    parts = pack(key, {"k": 1}, {"a": np.full(n, fill, np.uint8), "b": np.arange(3, dtype="<i8")})
    return bytearray(b"".join(bytes(p) for p in parts))


def tier(directory: Path, limit: int) -> EntryDir:
    found = disk_entry_dir(directory, limit)
    found.create()
    return found


def test_an_entry_reads_back_and_anything_else_is_refused() -> None:
    data = entry_bytes()
    meta, arrays = unpack(KEY, data) or pytest.fail("a whole entry must unpack")
    assert meta == {"k": 1}
    np.testing.assert_array_equal(arrays["a"], np.full(100, 7, np.uint8))
    np.testing.assert_array_equal(arrays["b"], np.arange(3))
    assert unpack(bytes(32), data) is None, "another key's entry"
    assert unpack(KEY, data[:-1]) is None, "torn"
    flipped = bytearray(data)
    flipped[len(flipped) // 2] ^= 1
    assert unpack(KEY, flipped) is None, "a flipped bit"
    assert unpack(KEY, bytearray(b"BDC1")) is None


def test_a_tier_holds_no_more_than_its_bound(tmp_path: Path) -> None:
    size = len(entry_bytes())
    store = tier(tmp_path, 3 * size)
    names = [f"{i:032x}" for i in range(5)]
    added = [store.add(name, (entry_bytes(),)) for name in names]
    assert added == [True, True, True, False, False]
    assert store.used_bytes() == 3 * size == store.recount()
    assert store.read(names[3]) is None
    assert store.read(names[0]) == entry_bytes()
    assert store.remove(names[0], size)
    assert store.add(names[3], (entry_bytes(),)), "room again once one was removed"


def test_a_writer_killed_mid_write_leaves_no_entry_and_its_bytes_come_back(
    tmp_path: Path,
) -> None:
    """A dead writer's temporary file is never an entry; the owner's recount removes it once
    stale and corrects the reservation it never gave back."""
    store = tier(tmp_path, 10_000)
    assert store._reserve(4_000)  # reserved, then killed before the rename
    tmp = tmp_path / f"{store.tmp_prefix}{'f' * 32}"
    tmp.write_bytes(entry_bytes()[:50])
    assert store.read("f" * 32) is None
    assert store.used_bytes() == 4_000
    assert store.recount() == 50, "a fresh temporary file may still be renamed: counted"
    old = time.time() - 3600
    os.utime(tmp, (old, old))
    assert store.recount() == 0
    assert not tmp.exists()


def test_a_corrupt_entry_is_counted_and_a_later_write_replaces_it(tmp_path: Path) -> None:
    store = tier(tmp_path, 10_000)
    name = "a" * 32
    store.add(name, (entry_bytes(),))
    path = Path(store.entry_path(name))
    data = bytearray(path.read_bytes())
    data[-1] ^= 0xFF
    path.write_bytes(data)
    cache = SampleCache(DecodeCacheSpec((store,)))
    assert cache.get(name, KEY) is None
    assert cache.take_counts().corrupt == 1
    cache.put(name, KEY, ({"k": 1}, {"a": np.full(100, 7, np.uint8), "b": np.arange(3)}))
    assert cache.get(name, KEY) is not None


def test_keys_change_with_the_file_the_recipe_and_the_range(tmp_path: Path) -> None:
    (tmp_path / "x.bin").write_bytes(b"abc")
    root = str(tmp_path)
    sample_key = identity_of(root).key
    key = sample_key("r", "x.bin", -1, -1, 1)
    assert key is not None and key[0].startswith(root_tag(root)) and len(key[0]) == 32
    assert sample_key("r", "x.bin", -1, -1, 1) == key
    assert sample_key("r2", "x.bin", -1, -1, 1) != key
    assert sample_key("r", "x.bin", 0, 2, 1) != key
    assert sample_key("r", "missing.bin", -1, -1, 1) is None
    stat = os.stat(tmp_path / "x.bin")
    os.utime(tmp_path / "x.bin", ns=(stat.st_atime_ns, stat.st_mtime_ns + 1))
    assert sample_key("r", "x.bin", -1, -1, 1) != key, "rewritten in place"


def test_an_object_is_keyed_by_its_catalog_row_without_a_request() -> None:
    """An object store's samples have keys (they had none: the cache was a no-op there),
    made of the dataset's catalog row, the object's key, its range and the sample id."""
    root = "s3://bucket/prefix"
    dataset = catalog_name(DatasetRef(7, "imgs", "1", root))
    key = identity_of(root, dataset).key("r", "a/b.jpg", -1, -1, 11)
    assert key is not None and key[0].startswith(root_tag(root))
    assert identity_of(root, dataset).probes, "a batch's hits are found before it is fetched"
    assert not identity_of("/data").probes
    others = [
        identity_of(root, catalog_name(DatasetRef(8, "imgs", "1", root))),  # re-created
        identity_of(root, catalog_name(DatasetRef(7, "imgs", "2", root))),  # another version
        identity_of("s3://bucket/other", dataset),
    ]
    assert all(o.key("r", "a/b.jpg", -1, -1, 11) != key for o in others)
    same = identity_of(root, dataset)
    assert same.key("r", "a/c.jpg", -1, -1, 11) != key
    assert same.key("r", "a/b.jpg", 0, 10, 11) != key
    assert same.key("r", "a/b.jpg", -1, -1, 12) != key


def test_keys_carry_batchds_own_version() -> None:
    assert f"batchd-server={batchd_server.__version__}" in versions().split()


def named(root: str, i: int) -> str:
    return root_tag(root) + f"{i:024x}"


def test_eviction_takes_datasets_no_live_session_reads_least_recent_first(
    tmp_path: Path,
) -> None:
    """Over its high water mark, the shm tier drops the dead dataset's entries, oldest first,
    to the disk tier; the live dataset's entries stay, even the oldest."""
    size = len(entry_bytes())
    evictions: list[tuple[str, int]] = []
    owner = DecodeCacheOwner(
        shm_dir=tmp_path,
        instance=INSTANCE,
        size_bytes=10 * size,
        disk_dir=tmp_path / "disk",
        disk_bytes=100 * size,
        live_roots=lambda: {"/live"},
        on_evict=lambda t, n: evictions.append((t, n)),
    )
    try:
        shm = owner.shm
        now = time.time()
        for i in range(5):
            for root in ("/live", "/dead"):
                assert shm.add(named(root, i), (entry_bytes(),))
                t = now - 1000 + i * 10 + (5 if root == "/dead" else 0)
                os.utime(shm.entry_path(named(root, i)), (t, t))
        assert owner.sweep() == {"shm": 2, "disk": 0}, "from 100% down to 80%"
        assert evictions == [("shm", 2)]
        left = {e.name for e in shm.entries()}
        assert {named("/live", i) for i in range(5)} <= left
        assert left - {named("/live", i) for i in range(5)} == {
            named("/dead", i) for i in (2, 3, 4)
        }
        assert owner.disk is not None
        assert {e.name for e in owner.disk.entries()} == {named("/dead", 0), named("/dead", 1)}
        assert owner.used_bytes("shm") == 8 * size
        assert owner.sweep() == {"shm": 0, "disk": 0}, "under the high water mark now"
    finally:
        owner.close()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(f"batchd-{INSTANCE}")]
    assert owner.disk is not None and len(list(owner.disk.entries())) == 2, "disk tier kept"


def test_the_shm_tier_is_named_like_segments_so_a_dead_servers_is_swept(tmp_path: Path) -> None:
    registry = ShmRegistry(budget_bytes=1 << 20, shm_dir=tmp_path)
    try:
        store = shm_entry_dir(tmp_path, "fedcba987654", 1 << 20)
        store.create()
        store.add("0" * 32, (entry_bytes(),))
        (tmp_path / f"{store.tmp_prefix}{'1' * 32}").write_bytes(b"x")
        removed = registry.sweep()  # no live instance holds fedcba987654's lock
        assert len(removed) == 3, removed
        assert not [p for p in tmp_path.iterdir() if "fedcba987654" in p.name]
    finally:
        registry.close()


def test_the_cache_is_counted_in_the_shm_budget(tmp_path: Path) -> None:
    registry = ShmRegistry(budget_bytes=4 << 20, shm_dir=tmp_path)
    try:
        held = [0]
        registry.set_aside(3 << 20, purpose="the decode cache", used=lambda: held[0])
        assert registry.reserved_bytes() == 3 << 20
        with pytest.raises(ResourceExhausted, match="budget"):
            registry.create("ring", 2 << 20, purpose="a ring")
        ring = registry.create("ring", 1 << 20, purpose="a ring")
        registry.release(ring)
        with pytest.raises(ResourceExhausted, match="budget"):
            registry.set_aside(2 << 20, purpose="another cache", used=lambda: 0)
    finally:
        registry.close()
