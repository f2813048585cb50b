"""A worker decodes a row group's payload only when what its file says it holds fits the
server's --max-sample-bytes: a compression bomb (one ZSTD row of zeros), a dictionary bomb
(one large entry repeated in every row) or a bomb of token lists is a ``too_large`` bad
sample for its rows, read from the footer or the page headers before anything is decoded,
while the file's other row groups and a legitimately repetitive column are served."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from batchd_server.parquet.budget import footer_bound, pages_bound
from batchd_server.parquet.payload import chunk_range, resolve_payload
from batchd_server.parquet.rows import ParquetRows
from batchd_server.pipelines.base import BadSample
from batchd_server.storage.files import SampleFiles
from batchd_server.storage.ranges import Ranges

BUDGET = 1 << 20
BOMB = 32 << 20
"""Zeros in one row: ZSTD keeps them in about a KiB."""


def _write(root: Path, table: pa.Table, **options: Any) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    pq.write_table(table, root / "f.parquet", **options)
    return root / "f.parquet"


def _rows(root: Path, column: str, target: Any = None) -> ParquetRows:
    return ParquetRows(SampleFiles(str(root), max_sample_bytes=BUDGET), column, target, BUDGET)


def _value(rows: ParquetRows, path: Path, group: int, row: int) -> bytes:
    meta = pq.read_metadata(path)
    leaves = resolve_payload(pq.ParquetFile(path), rows.column, path.name).leaves
    offset, length = chunk_range(meta.row_group(group), leaves)
    return bytes(rows.value(path.name, group, row, offset, length)[0])


def _bomb_file(root: Path) -> Path:
    """Row group 0: a row of :data:`BOMB` zeros; row group 1: two small rows."""
    values = [b"\x00" * BOMB, b"small", b"rows"]
    return _write(
        root, pa.table({"image": pa.array(values, pa.binary())}), compression="zstd",
        row_group_size=1, use_dictionary=False,
    )  # fmt: skip


def test_a_zstd_bomb_is_too_large_before_it_is_decoded_its_neighbours_are_served(
    tmp_path: Path,
) -> None:
    path = _bomb_file(tmp_path)
    assert path.stat().st_size < BUDGET // 16  # the chunk itself passes --max-sample-bytes
    rows = _rows(tmp_path, "image")
    with pytest.raises(BadSample) as refused:
        _value(rows, path, 0, 0)
    assert refused.value.kind == "too_large"
    message = str(refused.value)
    assert "f.parquet: row group 0's 'image'" in message and "--max-sample-bytes" in message
    assert _value(rows, path, 1, 0) == b"small"
    assert _value(rows, path, 2, 0) == b"rows"
    assert not any(group == 0 for _, group in rows._groups)


def test_the_page_headers_bound_the_decode_whatever_the_footer_says(tmp_path: Path) -> None:
    """The footer is checked before the chunk is read; the page headers (what pyarrow
    allocates by) are checked again, so a footer rewritten to look small does not help."""
    path = _bomb_file(tmp_path)
    meta = pq.read_metadata(path)
    payload = resolve_payload(pq.ParquetFile(path), "image", path.name)
    data = path.read_bytes()
    bound = pages_bound(meta, payload, 0, lambda o, n: data[o : o + n], "here")
    assert BOMB <= bound.plain < BOMB + 4096 and bound.repeated == 0
    assert footer_bound(meta, payload.leaves, 0) >= BOMB
    small = pages_bound(meta, payload, 1, lambda o, n: data[o : o + n], "here")
    assert small.plain < 4096


def test_page_headers_that_disagree_with_the_footer_are_corrupt(tmp_path: Path) -> None:
    path = _bomb_file(tmp_path)
    meta = pq.read_metadata(path)
    payload = resolve_payload(pq.ParquetFile(path), "image", path.name)
    start, _ = chunk_range(meta.row_group(0), payload.leaves)
    data = bytearray(path.read_bytes())
    data[start : start + 64] = b"\x15" * 64  # i32 fields without end
    with pytest.raises(BadSample) as broken:
        pages_bound(meta, payload, 0, lambda o, n: bytes(data[o : o + n]), "here")
    assert broken.value.kind == "corrupt"


def _image_structs(values: list[bytes]) -> pa.Array:
    return pa.array([{"bytes": v, "path": "p"} for v in values])


def test_a_dictionary_bomb_is_too_large_a_repetitive_column_is_served(tmp_path: Path) -> None:
    """One 200 KiB entry in each of 100 rows is 20 MiB written out: refused from the
    dictionary and its indices. Nine 3 KiB entries over 300 rows (under the budget written
    out, over it by the conservative bound) are served, each row its own value."""
    big = np.random.default_rng(1).bytes(200 << 10)
    bomb = _write(tmp_path / "bomb", pa.table({"image": _image_structs([big] * 100)}))
    rows = _rows(tmp_path / "bomb", "image.bytes")
    with pytest.raises(BadSample) as refused:
        _value(rows, bomb, 0, 0)
    assert refused.value.kind == "too_large" and "by its dictionary" in str(refused.value)
    rng = np.random.default_rng(2)
    entries = [rng.bytes(3000) for _ in range(9)]
    wanted = [entries[i * 7 % 9] for i in range(300)]
    fine = _write(tmp_path / "fine", pa.table({"image": _image_structs(wanted)}))
    meta = pq.read_metadata(fine)
    payload = resolve_payload(pq.ParquetFile(fine), "image.bytes", "f")
    data = fine.read_bytes()
    bound = pages_bound(meta, payload, 0, lambda o, n: data[o : o + n], "here")
    assert bound.plain < BUDGET < bound.plain + bound.repeated  # measured, not refused
    rows = _rows(tmp_path / "fine", "image.bytes")
    assert [_value(rows, fine, 0, i) for i in range(300)] == wanted


def test_a_bomb_of_token_lists_is_too_large(tmp_path: Path) -> None:
    tokens = pa.array([[0] * (1 << 20), [1, 2, 3]], pa.list_(pa.int64()))
    path = _write(tmp_path, pa.table({"ids": tokens}), compression="zstd", row_group_size=1)
    rows = _rows(tmp_path, "ids", np.dtype("<i4"))
    with pytest.raises(BadSample) as refused:
        _value(rows, path, 0, 0)
    assert refused.value.kind == "too_large"
    assert np.frombuffer(_value(rows, path, 1, 0), "<i4").tolist() == [1, 2, 3]


def test_a_batch_load_leaves_a_bomb_to_its_rows_and_decodes_the_rest(tmp_path: Path) -> None:
    """``load`` (a batch's row groups read together) decodes nothing over the budget; the
    bomb's row is then refused when it is asked for, the others served from the load."""
    path = _bomb_file(tmp_path)
    meta = pq.read_metadata(path)
    places = np.array([chunk_range(meta.row_group(g), (0,)) for g in range(3)], np.int64)
    chunks = Ranges([path.name], np.zeros(3, np.intp), places[:, 0], places[:, 1])
    groups = np.arange(3, dtype=np.int32)
    rows = _rows(tmp_path, "image")
    rows.begin_batch()
    rows.load(chunks, groups)
    assert sorted(group for _, group in rows._groups) == [1, 2]
    # The bomb's row is bad: the rows one by one then say which.
    assert rows.gather(chunks, groups, np.zeros(3, np.int32)) is None
    with pytest.raises(BadSample) as refused:
        _value(rows, path, 0, 0)
    assert refused.value.kind == "too_large"
