"""Shard files stay open across samples and batches, a batch's byte ranges are read in few
reads, and the cached descriptors stay confined to the dataset root and follow file changes."""

from __future__ import annotations

import os
import shutil
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from batchd_server.pipelines.base import BadSample
from batchd_server.storage import files as files_module
from batchd_server.storage.files import MAX_READS_PER_FILE, SampleFiles
from batchd_server.storage.ranges import MAX_GAP_BYTES, Ranges, plan_reads

I64 = np.int64


@pytest.fixture
def calls(monkeypatch: pytest.MonkeyPatch) -> Counter[str]:
    """Counts the real os.open and os.preadv calls made while the test runs."""
    counted: Counter[str] = Counter()

    def counting(name: str) -> Callable[..., Any]:
        real = getattr(os, name)

        def call(*args: Any, **kwargs: Any) -> Any:
            counted[name] += 1
            return real(*args, **kwargs)

        return call

    for name in ("open", "preadv"):
        monkeypatch.setattr(os, name, counting(name))
    return counted


@pytest.fixture
def root(tmp_path: Path) -> Path:
    data = tmp_path / "data"
    data.mkdir()
    (tmp_path / "outside").mkdir()
    return data


@pytest.fixture
def files(root: Path) -> Iterator[SampleFiles]:
    with SampleFiles(str(root)) as f:
        yield f


def ranges(files: SampleFiles, paths: list[str], which: list[int], spans: list[tuple[int, int]]):
    """read_ranges of (offset, length) spans, sample i in paths[which[i]], as a list of bytes."""
    offsets = np.array([o for o, _ in spans], I64)
    lengths = np.array([n for _, n in spans], I64)
    data, starts = files.read_ranges(Ranges(paths, np.array(which, np.intp), offsets, lengths))
    return [bytes(data[s : s + n]) for s, n in zip(starts, lengths, strict=True)]


def test_ranges_are_sorted_and_neighbours_share_one_read() -> None:
    """Adjacent, overlapping, repeated and nearby ranges form one run; a far one its own."""
    near = 120 + MAX_GAP_BYTES  # a gap of exactly MAX_GAP_BYTES after the first four
    far = near + 5 + MAX_GAP_BYTES + 1
    offsets = np.array([far, 100, 0, 50, 100, near], I64)
    lengths = np.array([10, 20, 100, 70, 20, 5], I64)
    plan = plan_reads(offsets, lengths)
    assert plan.run_offsets.tolist() == [0, far]
    assert plan.run_lengths.tolist() == [near + 5, 10]
    assert plan.total_bytes == near + 15 and plan.end == far + 10
    file = np.random.default_rng(0).integers(0, 256, far + 10, dtype=np.uint8)
    buffer = np.concatenate(
        [file[o : o + n] for o, n in zip(plan.run_offsets, plan.run_lengths, strict=True)]
    )
    for offset, length, start in zip(offsets, lengths, plan.starts, strict=True):
        assert (buffer[start : start + length] == file[offset : offset + length]).all()
    assert plan_reads(np.zeros(0, I64), np.zeros(0, I64)).total_bytes == 0


def test_read_ranges_gives_every_range_of_several_files_exactly(
    root: Path, files: SampleFiles
) -> None:
    """Shuffled, repeated and empty ranges over three shards, read as batches, byte for byte."""
    rng = np.random.default_rng(1)
    blobs = {f"s{k}.bin": rng.bytes(200_000) for k in range(3)}
    for name, blob in blobs.items():
        (root / name).write_bytes(blob)
    names = sorted(blobs)
    for batch in range(20):
        files.begin_batch()
        count = 1 + batch * 13
        which = rng.integers(0, 1 + batch % 3, count).tolist()
        spans = []
        for _ in range(count):
            offset = int(rng.integers(0, 200_000))
            spans.append((offset, int(rng.integers(0, min(3000, 200_000 - offset) + 1))))
        got = ranges(files, names, which, spans)
        for k, (offset, length), data in zip(which, spans, got, strict=True):
            assert data == blobs[names[k]][offset : offset + length]


def test_a_shard_is_opened_once_for_all_its_samples_and_batches(
    root: Path, files: SampleFiles, calls: Counter[str]
) -> None:
    """One os.open serves per-sample reads and batches, over many batches."""
    (root / "shard.bin").write_bytes(bytes(range(256)) * 64)
    for batch in range(10):
        files.begin_batch()
        assert bytes(files.read("shard.bin", batch, 3)) == bytes([batch, batch + 1, batch + 2])
        assert ranges(files, ["shard.bin"], [0, 0], [(0, 2), (256, 2)]) == [b"\0\1", b"\0\1"]
    assert calls["open"] == 1


def test_records_laid_out_in_order_cost_one_read_per_batch(
    root: Path, files: SampleFiles, calls: Counter[str]
) -> None:
    """256 consecutive records in shuffled order: one preadv for the whole batch."""
    records = np.arange(256 * 64, dtype=np.uint8).reshape(256, 64)
    (root / "shard.bin").write_bytes(records.tobytes())
    order = np.random.default_rng(2).permutation(256)
    got = ranges(files, ["shard.bin"], [0] * 256, [(int(i) * 64, 64) for i in order])
    assert got == [records[i].tobytes() for i in order]
    assert calls["preadv"] == 1


def test_scattered_records_are_gathered_from_a_map_without_reads(
    root: Path, files: SampleFiles, calls: Counter[str]
) -> None:
    """Records far apart in one shard cost no read call: they are taken from its mapping."""
    blob = np.random.default_rng(3).bytes(64 * MAX_GAP_BYTES * 4)
    (root / "shard.bin").write_bytes(blob)
    spans = [(k * 4 * MAX_GAP_BYTES + 7, 100) for k in range(MAX_READS_PER_FILE + 10)][::-1]
    for _ in range(3):
        files.begin_batch()
        got = ranges(files, ["shard.bin"], [0] * len(spans), spans)
        assert got == [blob[o : o + n] for o, n in spans]
    assert calls["preadv"] == 0 and calls["open"] == 1


def test_ranges_past_the_end_or_in_missing_or_unsafe_files_are_bad_samples(
    root: Path, files: SampleFiles
) -> None:
    """read_ranges refuses the batch with BadSample; read() then finds each culprit."""
    (root / "shard.bin").write_bytes(b"x" * 100)
    (root / "leak.bin").symlink_to(root.parent / "outside")
    for paths, spans in (
        (["shard.bin"], [(0, 10), (95, 10)]),
        (["shard.bin", "nope.bin"], [(0, 10), (0, 1)]),
        (["shard.bin", "leak.bin"], [(0, 10), (0, 1)]),
        (["shard.bin"], [(-1, 10)]),
    ):
        with pytest.raises(BadSample):
            ranges(files, paths, list(range(len(spans))) if len(paths) > 1 else [0], spans)
    assert ranges(files, ["shard.bin"], [0], [(90, 10)]) == [b"x" * 10]


def test_a_replaced_or_grown_shard_is_seen_from_the_next_batch(
    root: Path, files: SampleFiles, calls: Counter[str]
) -> None:
    """A cached descriptor is re-checked once per batch: replaced or appended files reopen."""
    shard = root / "shard.bin"
    shard.write_bytes(b"old!" * 10)
    assert bytes(files.read("shard.bin", 0, 4)) == b"old!"
    fresh = root / "fresh.tmp"
    fresh.write_bytes(b"new!" * 10)
    os.replace(fresh, shard)
    files.begin_batch()
    assert bytes(files.read("shard.bin", 0, 4)) == b"new!"
    assert calls["open"] == 2
    with shard.open("ab") as f:
        f.write(b"more")
    with pytest.raises(BadSample):
        files.read("shard.bin", 40, 4)  # same batch: the size it had at its check
    files.begin_batch()
    assert ranges(files, ["shard.bin"], [0], [(40, 4)]) == [b"more"]
    assert calls["open"] == 3


def test_a_cached_shard_whose_directory_now_leads_out_of_the_root_is_refused(
    root: Path, files: SampleFiles
) -> None:
    """Swapping a directory of a cached path for a symlink out of the root is an escape."""
    (root / "d").mkdir()
    (root / "d" / "shard.bin").write_bytes(b"inside")
    outside = root.parent / "outside"
    (outside / "shard.bin").write_bytes(b"secret")
    assert bytes(files.read("d/shard.bin", 0, 6)) == b"inside"
    shutil.rmtree(root / "d")
    (root / "d").symlink_to(outside)
    files.begin_batch()
    with pytest.raises(BadSample) as caught:
        files.read("d/shard.bin", 0, 6)
    assert caught.value.kind == "unsafe_path"
    with pytest.raises(BadSample):
        ranges(files, ["d/shard.bin"], [0], [(0, 6)])


def test_the_descriptor_cache_is_bounded(root: Path, files: SampleFiles) -> None:
    """Reading ranges of many shards never holds more than a few descriptors open."""
    before = len(os.listdir("/proc/self/fd"))
    for k in range(40):
        (root / f"s{k}.bin").write_bytes(bytes([k]) * 10)
        assert ranges(files, [f"s{k}.bin"], [0], [(k % 10, 1)]) == [bytes([k])]
    assert len(os.listdir("/proc/self/fd")) - before <= files_module._MAX_OPEN_FDS
