"""Reads that cannot be served are bad samples, not worker crashes: a sample larger than the
per-sample limit (a huge or sparse file) is ``too_large`` before anything is allocated, and
a byte range whose end passes 2**63 (a row ingested with ``--no-verify``) is ``bad_range``,
never an int64 that wraps into some other range."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from batchd_server.pipelines.base import BadSample
from batchd_server.storage.files import MAX_SAMPLE_BYTES, SampleFiles
from batchd_server.storage.ranges import Ranges, plan_reads

INT64_MAX = (1 << 63) - 1


@pytest.fixture
def root(tmp_path: Path) -> Path:
    data = tmp_path / "data"
    data.mkdir()
    (data / "shard.bin").write_bytes(bytes(range(256)) * 16)  # 4 KiB
    return data


@pytest.fixture
def files(root: Path) -> Iterator[SampleFiles]:
    with SampleFiles(str(root)) as f:
        yield f


def _ranges(
    files: SampleFiles, offsets: list[int], lengths: list[int]
) -> tuple[np.ndarray, np.ndarray]:
    return files.read_ranges(
        Ranges(
            ["shard.bin"],
            np.zeros(len(offsets), np.intp),
            np.array(offsets, np.int64),
            np.array(lengths, np.int64),
        )
    )


def test_a_sparse_terabyte_file_is_too_large_and_nothing_is_allocated(
    root: Path, files: SampleFiles
) -> None:
    """A 1 TiB sparse file read whole (or from an offset to its end) is BadSample
    'too_large' naming its size and the limit; the next read works."""
    (root / "huge.jpg").touch()
    os.truncate(root / "huge.jpg", 1 << 40)
    for offset, length in ((-1, -1), (0, -1), (1 << 39, -1)):
        with pytest.raises(BadSample) as caught:
            files.read("huge.jpg", offset, length)
        assert caught.value.kind == "too_large"
        assert "huge.jpg" in str(caught.value) and "--max-sample-bytes" in str(caught.value)
    assert bytes(files.read("shard.bin", 0, 4)) == b"\x00\x01\x02\x03"
    assert MAX_SAMPLE_BYTES == 256 << 20


def test_the_per_sample_limit_is_the_operators(root: Path) -> None:
    """max_sample_bytes=100: a 101-byte range (single or in a batch) is too_large, a
    100-byte one is read."""
    with SampleFiles(str(root), max_sample_bytes=100) as files:
        assert len(files.read("shard.bin", 0, 100)) == 100
        with pytest.raises(BadSample) as caught:
            files.read("shard.bin", 0, 101)
        assert caught.value.kind == "too_large"
        with pytest.raises(BadSample) as caught:
            files.read("shard.bin")
        assert caught.value.kind == "too_large"
        data, starts = _ranges(files, [0, 200], [100, 100])
        shard = (root / "shard.bin").read_bytes()
        assert bytes(data[starts[1] : starts[1] + 100]) == shard[200:300]
        with pytest.raises(BadSample) as caught:
            _ranges(files, [0, 200], [100, 101])
        assert caught.value.kind == "too_large"


def test_a_range_whose_end_passes_int64_is_a_bad_range_alone_or_in_a_batch(
    files: SampleFiles,
) -> None:
    """offset + length > 2**63 - 1 is BadSample 'bad_range', from read() and from a batch's
    read_ranges (where the sum would wrap to a negative end that passes every check)."""
    near = INT64_MAX - 7
    with pytest.raises(BadSample) as caught:
        files.read("shard.bin", near, 64)
    assert caught.value.kind == "bad_range"
    assert str(near) in str(caught.value)
    for offsets, lengths in (([near], [64]), ([0, 64, near], [64, 64, 64]), ([10], [INT64_MAX])):
        with pytest.raises(BadSample) as caught:
            _ranges(files, offsets, lengths)
        assert caught.value.kind in ("bad_range", "too_large"), (offsets, lengths)
    with pytest.raises(BadSample) as caught:
        _ranges(files, [0, 64, near], [64, 64, 64])
    assert caught.value.kind == "bad_range"
    data, starts = _ranges(files, [0, 64], [64, 64])
    assert bytes(data[starts[1] : starts[1] + 4]) == bytes(range(64, 68))


def test_planning_refuses_ranges_whose_end_wraps() -> None:
    """plan_reads is never given such a range (read_ranges refuses it first); given one, it
    raises instead of planning a run of negative length."""
    with pytest.raises(ValueError, match="2\\*\\*63"):
        plan_reads(np.array([0, INT64_MAX - 7], np.int64), np.array([64, 64], np.int64))
