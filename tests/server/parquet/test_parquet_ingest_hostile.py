"""Ingest of Parquet files that lie: each footer row becomes a catalog row, so a footer whose
row counts disagree with each other, with the payload's values or with its page headers is
refused with an error naming the file and row group (not an ingest of a trillion rows); and
a key holding a NUL, which no catalog stores, is refused naming its row."""

from __future__ import annotations

import io
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from parquet_data import with_row_counts

from batchd_server.catalog.ingest.parquet import ParquetSamples
from batchd_server.errors import DataError

ROWS = 30


def _file(**columns: Any) -> bytes:
    table = pa.table({"png": [bytes([i]) * 40 for i in range(ROWS)], **columns})
    out = io.BytesIO()
    pq.write_table(table, out, row_group_size=10)
    return out.getvalue()


def _ingest(tmp_path: Path, data: bytes, **options: Any) -> int:
    """Rows of ``data`` as ingest reads them; refuses to read more than the file has."""
    (tmp_path / "f.parquet").write_bytes(data)
    samples = ParquetSamples(
        files=["f.parquet"],
        open_file=lambda rel: (tmp_path / rel).open("rb"),
        payload="png",
        split="train",
        **options,
    )
    n = 0
    for n, _ in enumerate(samples.rows(), 1):
        assert n <= ROWS, "more rows than the file has"
    return n


def test_a_true_footer_is_read_whole(tmp_path: Path) -> None:
    assert _ingest(tmp_path, _file()) == ROWS


@pytest.mark.timeout(60)
def test_a_footer_that_lies_consistently_is_refused_by_the_page_headers(tmp_path: Path) -> None:
    """Row group 1, its payload's values and the file all say a trillion rows: only the
    pages (ten values) know better."""
    big = 10**12
    data = with_row_counts(
        _file(), group_rows={1: big}, column_values={1: big}, file_rows=big + 2 * 10
    )
    with pytest.raises(DataError) as refused:
        _ingest(tmp_path, data)
    message = str(refused.value)
    assert f"f.parquet: its footer says row group 1 has {big} rows" in message
    assert "pages hold 10 values" in message and "rewrite it" in message


@pytest.mark.parametrize("columns", [{}, {"label": pa.array(range(ROWS))}])
def test_a_row_group_whose_rows_are_not_its_payloads_values_is_refused(
    tmp_path: Path, columns: dict[str, Any]
) -> None:
    data = with_row_counts(_file(**columns), group_rows={0: 11}, file_rows=ROWS + 1)
    with pytest.raises(DataError) as refused:
        _ingest(tmp_path, data, label="label" if columns else None)
    assert "row group 0 has 11 rows, but its payload column has 10 values" in str(refused.value)


def test_a_file_row_count_that_is_not_its_row_groups_is_refused(tmp_path: Path) -> None:
    data = with_row_counts(_file(), group_rows={}, file_rows=ROWS * 1000)
    with pytest.raises(DataError) as refused:
        _ingest(tmp_path, data)
    assert f"says it has {ROWS * 1000} rows, its row groups {ROWS}" in str(refused.value)


def test_a_key_holding_a_nul_is_refused_naming_its_row(tmp_path: Path) -> None:
    keys = [f"k{i}" if i != 13 else "k\x0013" for i in range(ROWS)]
    with pytest.raises(DataError) as refused:
        _ingest(tmp_path, _file(key=pa.array(keys)), key="key")
    message = str(refused.value)
    assert "f.parquet, row 13: key 'k\\x0013' holds a NUL character" in message
