"""Hostile bytes where a Parquet column chunk's pages should be: the page-header walker
(``parquet/pages.py``, over ``parquet/thrift.py``) refuses them in time and memory bounded
by the chunk's bytes, so the worker decodes the chunk with pyarrow instead (which reports a
broken file as a bad sample), never hangs, recurses out or allocates what a header claims.

Each crafted header here hung, crashed or ran out of memory in the walker before it was
bounded; the fuzzes then damage real pyarrow-written chunks, for the walker alone and for
a worker's row reader that decodes them (seeded: a failure names its case, and the same run
reproduces it)."""

from __future__ import annotations

import io
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from batchd_server.parquet.pages import NotPlain, chunk_pages, plain_places, row_places
from batchd_server.parquet.payload import chunk_range
from batchd_server.parquet.rows import ParquetRows
from batchd_server.pipelines.base import BadSample
from batchd_server.storage.files import SampleFiles

from fuzzing import mutate


def _varint(n: int) -> bytes:
    out = bytearray()
    while True:
        if n < 0x80:
            return bytes(out + bytes([n]))
        out.append(n & 0x7F | 0x80)
        n >>= 7


def _i32(field_delta: int, value: int) -> bytes:
    """A compact-protocol i32 field ``field_delta`` after the previous one."""
    return bytes([field_delta << 4 | 5]) + _varint(value << 1 if value >= 0 else -2 * value - 1)


def _data_page_header(values: int, size: int) -> bytes:
    """A version 1 data page header: PLAIN values, RLE levels, ``size`` bytes."""
    inner = _i32(1, values) + _i32(1, 0) + _i32(1, 3) + _i32(1, 3) + b"\x00"
    return _i32(1, 0) + _i32(1, size) + _i32(1, size) + bytes([2 << 4 | 12]) + inner + b"\x00"


_VALUES = [bytes([i]) * (i * 7 % 300) for i in range(60)]


def _file(**options: Any) -> bytes:
    out = io.BytesIO()
    pq.write_table(pa.table({"image": _VALUES}), out, compression="none", **options)
    return out.getvalue()


def _with_chunk(prefix: bytes, **options: Any) -> bytes:
    """A real file whose payload chunk begins with ``prefix`` instead of its own bytes."""
    data = bytearray(_file(**options))
    start, _ = chunk_range(pq.read_metadata(io.BytesIO(bytes(data))).row_group(0), (0,))
    data[start : start + len(prefix)] = prefix
    return bytes(data)


def _plain_places(data: bytes) -> Any:
    meta = pq.read_metadata(io.BytesIO(_file(use_dictionary=False)))
    start, size = chunk_range(meta.row_group(0), (0,))
    return plain_places(meta, (0,), 0, _reader(data), start, size, 1 << 30)


_MAP_OF_BOOLS = bytes([1 << 4 | 11]) + _varint((1 << 49) - 1) + bytes([0x11])
"""Field 1, a map of 2**49 - 1 (bool, bool) entries, in 9 bytes: an entry's booleans are a
byte each, but the walker read them as field booleans (none), 2**49 times."""


@pytest.mark.timeout(20)
@pytest.mark.parametrize(
    "header",
    [
        pytest.param(_MAP_OF_BOOLS, id="a 9-byte map of bools"),
        pytest.param(bytes([1 << 4 | 9, 0xF1]) + _varint(1 << 40), id="a list of 2**40 bools"),
        pytest.param(bytes([1 << 4 | 12]) + bytes([1 << 4 | 12]) * 5000, id="structs 5000 deep"),
        pytest.param(bytes([1 << 4 | 9, 0x19]) * 5000, id="lists 5000 deep"),
        pytest.param(bytes([1 << 4 | 5]) + b"\xff" * 20, id="a varint of 140 bits"),
    ],
)
def test_a_hostile_page_header_is_refused_and_the_chunk_decoded(header: bytes) -> None:
    assert len(_MAP_OF_BOOLS) == 9
    assert _plain_places(_with_chunk(header, use_dictionary=False)) is None


@pytest.mark.timeout(20)
@pytest.mark.parametrize("values", [1 << 40, 61])
def test_a_page_that_claims_more_values_than_its_chunk_has_allocates_nothing(
    values: int,
) -> None:
    """The first data page claims more values than the footer's 60 rows: refused before
    anything is allocated for them (1 << 40 values were 9 TB of numpy arrays)."""
    header = _data_page_header(values, 16)
    data = _with_chunk(header + b"\x00" * 16, use_dictionary=False)
    assert _plain_places(data) is None


@pytest.mark.timeout(20)
def test_levels_or_values_that_claim_more_bytes_than_their_page_are_refused() -> None:
    meta = pq.read_metadata(io.BytesIO(_file(use_dictionary=False)))
    start, size = chunk_range(meta.row_group(0), (0,))
    header = _data_page_header(60, size - 40)
    levels = (1 << 31).to_bytes(4, "little")  # 2 GiB of definition levels
    data = _with_chunk(header + levels, use_dictionary=False)
    with pytest.raises(NotPlain):
        row_places(lambda o, n: data[o : o + n], start, size, 1, 60)


# ------------------------------------------------------------------------------ fuzzing

_BASES = {
    "plain": {"use_dictionary": False},
    "dictionary": {},
    "small pages": {"data_page_size": 512, "write_batch_size": 8, "use_dictionary": False},
    "small dictionary pages": {
        "data_page_size": 512,
        "write_batch_size": 8,
        "dictionary_pagesize_limit": 2048,
    },
}
FUZZ_CASES = 10_000


def _pages(data: bytes, start: int, size: int) -> list[int]:
    """Where each page of the chunk begins, relative to it."""
    ends = [body + header.size - start for header, body in chunk_pages(_reader(data), start, size)]
    return [0, *ends[:-1]]


def _reader(data: bytes) -> Any:
    return lambda o, n: data[o : o + n]


@pytest.mark.timeout(120)
def test_fuzzed_chunks_give_their_true_places_or_not_plain_never_a_crash_or_hang() -> None:
    """10,000 damaged chunks of real files (truncations, flipped bytes, overwritten or
    deleted runs, inserted noise; half at a page header other than the first): the walker
    either refuses with NotPlain or gives every row a place inside the file, and the places
    of an undamaged chunk are pyarrow's values."""
    rng = np.random.default_rng(34)
    bases = []
    for name, options in _BASES.items():
        data = _file(**options)
        meta = pq.read_metadata(io.BytesIO(data))
        start, size = chunk_range(meta.row_group(0), (0,))
        pages = _pages(data, start, size)
        assert name.startswith("plain") or len(pages) > 1, name
        bases.append((name, data, start, size, pages))
    refused = 0
    for case in range(FUZZ_CASES):
        name, data, start, size, pages = bases[case % len(bases)]
        chunk = data[start : start + size]
        cut = int(rng.choice(pages)) if case % 2 else 0
        damaged = data[:start] + chunk[:cut] + mutate(chunk[cut:], rng) + data[start + size :]
        try:
            places = row_places(_reader(damaged), start, size, 1, len(_VALUES))
        except NotPlain:
            refused += 1
            continue
        present = places.offset >= 0
        assert len(places.offset) == len(_VALUES), (case, name)
        assert (places.offset[present] >= start).all(), (case, name)
        ends = places.offset[present] + places.length[present]
        assert (ends <= len(damaged)).all(), (case, name)
    assert refused > FUZZ_CASES // 4  # the damage did reach the walker
    for _, data, start, size, _ in bases:
        places = row_places(_reader(data), start, size, 1, len(_VALUES))
        got = [data[o : o + n] for o, n in zip(places.offset, places.length, strict=True)]
        assert got == _VALUES


DECODE_CASES = 1_000


@pytest.mark.timeout(120)
def test_fuzzed_row_groups_decode_or_are_bad_samples_never_a_crash(tmp_path: Path) -> None:
    """1,000 damaged payload chunks (the catalog's byte range kept) of plain, ZSTD, snappy,
    version 2 and token-list files, served by a worker's row reader: each row is bytes or a
    BadSample (``corrupt`` or ``too_large``), never another exception or a crash."""
    rng = np.random.default_rng(16)
    tokens = pa.array([list(range(i % 17)) for i in range(60)], pa.list_(pa.int32()))
    small = {"row_group_size": 30, "data_page_size": 512, "write_batch_size": 8}
    bases = []
    for options in (
        {"compression": "none"},
        {"compression": "zstd"},
        {"compression": "snappy", "use_dictionary": False},
        {"compression": "zstd", "data_page_version": "2.0"},
    ):
        out = io.BytesIO()
        pq.write_table(pa.table({"image": _VALUES}), out, **small, **options)
        bases.append(("image", None, out.getvalue()))
    out = io.BytesIO()
    pq.write_table(pa.table({"ids": tokens}), out, compression="zstd", **small)
    bases.append(("ids", np.dtype("<i4"), out.getvalue()))
    kinds: Counter[str] = Counter()
    for case in range(DECODE_CASES):
        column, target, data = bases[case % len(bases)]
        group = case // len(bases) % 2
        start, size = chunk_range(pq.read_metadata(io.BytesIO(data)).row_group(group), (0,))
        damaged = mutate(data[start : start + size], rng)[:size].ljust(size, b"\x00")
        (tmp_path / "f.parquet").write_bytes(data[:start] + damaged + data[start + size :])
        files = SampleFiles(str(tmp_path), max_sample_bytes=1 << 20)
        rows = ParquetRows(files, column, target, 1 << 20)
        for row in range(0, 30, 7):
            try:
                rows.value("f.parquet", group, row, start, size)
                kinds["served"] += 1
            except BadSample as e:
                assert e.kind in ("corrupt", "too_large"), (case, e)
                kinds[e.kind] += 1
        files.close()
    assert kinds["corrupt"] > DECODE_CASES  # the damage did reach the decoder
