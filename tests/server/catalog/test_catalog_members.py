"""Tar members' ranges in the catalog cache: a session of several fields gets every member's
offset and length per sample (-1 where a sample has none) in its catalog segment, from an
entry of its own; a session of one field loads the split's rows alone, as before. Real
catalog (both backends: the ranges are read from a JSON column), real shared memory."""

from __future__ import annotations

import io
import tarfile
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from sqlalchemy.engine import Engine

from batchd_server.catalog.ingest import ingest_tar
from batchd_server.catalog.types import member_names
from batchd_server.catalog_cache import CatalogCache
from batchd_server.shm import ShmRegistry
from batchd_server.shm.arrays import attach_arrays

MiB = 1 << 20


@pytest.fixture
def cache(engine: Engine) -> Iterator[CatalogCache]:
    with ShmRegistry(budget_bytes=64 * MiB) as registry:
        cache = CatalogCache(engine, registry)
        try:
            yield cache
        finally:
            cache.close()


def _shard(path: Path) -> dict[str, dict[str, bytes]]:
    samples = {
        f"k{i}": {"npy": bytes([i]) * (10 + i), "cls": b"1", **({"txt": b"hi"} if i != 2 else {})}
        for i in range(4)
    }
    with tarfile.open(path, "w") as tar:
        for key, members in samples.items():
            for ext, data in members.items():
                info = tarfile.TarInfo(f"{key}.{ext}")
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))
    return samples


def test_members_ranges_come_only_with_the_entry_that_asks_for_them(
    engine: Engine, cache: CatalogCache, tmp_path: Path
) -> None:
    root = tmp_path / "shards"
    root.mkdir()
    samples = _shard(root / "s-train.tar")
    ingest_tar(engine, dataset="wds", root=root, shards=["s-train.tar"])
    one = cache.acquire("wds", None, "train", None)
    fields = cache.acquire("wds", None, "train", None, members=True)
    try:
        assert one.segment is not fields.segment
        plain, a = attach_arrays(one.segment.name)
        with_members, b = attach_arrays(fields.segment.name)
        try:
            assert not any(name.startswith("member.") for name in plain)
            data = (root / "s-train.tar").read_bytes()
            for ext in ("npy", "cls", "txt"):
                offsets, lengths = (with_members[n] for n in member_names(ext))
                for i, (offset, length) in enumerate(zip(offsets, lengths, strict=True)):
                    want = samples[f"k{i}"].get(ext)
                    if want is None:
                        assert (offset, length) == (-1, -1)
                    else:
                        assert data[offset : offset + length] == want
            np.testing.assert_array_equal(
                with_members[member_names("npy")[0]], plain["byte_offsets"]
            )
        finally:
            del plain, with_members
            a.close()
            b.close()
    finally:
        cache.release(one)
        cache.release(fields)
