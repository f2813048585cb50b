"""Parquet rows read where they lie: the places of a plainly stored binary column's values,
found from its page headers and length prefixes, against what pyarrow decodes; and a
worker's row reader serving such rows through the node cache from a real S3 server without
decoding a row group (a compressed file still decoded, and served the same)."""

from __future__ import annotations

import io
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import obstore
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from s3server import ThrowawayS3, bucket_in_env

from batchd_server.parquet.pages import NotPlain, row_places
from batchd_server.parquet.payload import chunk_range
from batchd_server.parquet.rows import ParquetRows
from batchd_server.pipelines.base import BadSample
from batchd_server.storage.blocks import BlockStore
from batchd_server.storage.cache import CacheStats, CachingFetcher
from batchd_server.storage.objects import ObjectFiles
from batchd_server.storage.ranges import Ranges
from batchd_server.storage.s3 import S3Fetcher

BUCKET = "inplace"
ROOT = f"s3://{BUCKET}/parquet"
_RNG = np.random.default_rng(5)
_VALUES = [_RNG.bytes(int(_RNG.integers(0, 3000))) for _ in range(600)]


def _file(table: pa.Table, **options: Any) -> bytes:
    out = io.BytesIO()
    pq.write_table(table, out, row_group_size=200, **options)
    return out.getvalue()


def _struct_images() -> pa.Table:
    kind = pa.struct([("bytes", pa.binary()), ("path", pa.string())])
    rows = [
        None if i % 5 == 0 else {"bytes": None if i % 11 == 0 else v, "path": "p"}
        for i, v in enumerate(_VALUES)
    ]
    return pa.table({"image": pa.array(rows, kind)})


_NULLS = pa.table(
    {"k": range(600), "image": [None if i % 7 == 0 else v for i, v in enumerate(_VALUES)]}
)
_CASES = {
    "dictionary then plain": (pa.table({"image": _VALUES}), {}),
    "plain": (pa.table({"image": _VALUES}), {"use_dictionary": False}),
    "small pages with nulls": (_NULLS, {"data_page_size": 4000}),
    "plain small pages with nulls": (_NULLS, {"data_page_size": 4000, "use_dictionary": False}),
    "repeated values": (pa.table({"image": [_VALUES[i % 9] for i in range(600)]}), {}),
    "one value throughout": (pa.table({"image": [_VALUES[1]] * 600}), {}),
    "image.bytes in a struct": (_struct_images(), {"data_page_size": 4000}),
}


def _leaf(data: bytes, path: str) -> int:
    schema = pq.read_metadata(io.BytesIO(data)).schema
    return next(i for i in range(len(schema)) if schema.column(i).path == path)


@pytest.mark.parametrize("case", sorted(_CASES))
def test_the_places_of_an_uncompressed_columns_values_are_the_values_pyarrow_reads(
    case: str,
) -> None:
    table, options = _CASES[case]
    data = _file(table, compression="none", **options)
    path = "image.bytes" if case.startswith("image.bytes") else "image"
    leaf = _leaf(data, path)
    meta = pq.read_metadata(io.BytesIO(data))
    expected = pq.read_table(io.BytesIO(data)).column("image").to_pylist()
    if path == "image.bytes":
        expected = [None if v is None else v["bytes"] for v in expected]
    got: list[bytes | None] = []
    for g in range(meta.num_row_groups):
        start, size = chunk_range(meta.row_group(g), (leaf,))
        places = row_places(
            lambda o, n: data[o : o + n],
            start,
            size,
            meta.schema.column(leaf).max_definition_level,
            meta.row_group(g).num_rows,
        )
        got += [
            None if o < 0 else data[o : o + n]
            for o, n in zip(places.offset.tolist(), places.length.tolist(), strict=True)
        ]
    assert got == expected


@pytest.mark.parametrize(
    "options", [{"compression": "snappy"}, {"compression": "none", "data_page_version": "2.0"}]
)
def test_a_compressed_or_version_2_chunk_is_not_plain(options: dict[str, Any]) -> None:
    data = _file(pa.table({"image": _VALUES}), **options)
    meta = pq.read_metadata(io.BytesIO(data))
    start, size = chunk_range(meta.row_group(0), (0,))
    with pytest.raises(NotPlain):
        row_places(lambda o, n: data[o : o + n], start, size, 1, 200)


@pytest.mark.parametrize("cut", [3, 40, 5000, 50_000])
def test_a_chunk_cut_short_is_not_plain_not_a_crash(cut: int) -> None:
    """Bytes that end early (a truncated file) or a chunk range that is wrong give NotPlain
    (the caller then decodes, and pyarrow reports the file), never wrong places."""
    data = _file(pa.table({"image": _VALUES}), compression="none", use_dictionary=False)
    meta = pq.read_metadata(io.BytesIO(data))
    start, size = chunk_range(meta.row_group(0), (0,))
    short = data[: start + cut]
    with pytest.raises(NotPlain):
        row_places(lambda o, n: short[o : o + n], start, size, 1, 200)
    with pytest.raises(NotPlain):
        row_places(lambda o, n: data[o : o + n], start + 7, size, 1, 200)


# ---------------------------------------------------------------- through the node cache

_FILES = {
    "plain.parquet": _file(_NULLS.select(["image"]), compression="none"),
    "snappy.parquet": _file(_NULLS.select(["image"]), compression="snappy"),
}


@pytest.fixture(scope="module")
def s3() -> Iterator[ThrowawayS3]:
    with bucket_in_env(BUCKET) as server:
        store = server.store(BUCKET)
        for name, data in _FILES.items():
            obstore.put(store, f"parquet/{name}", data)
        yield server


def _batch(name: str) -> tuple[Any, ...]:
    meta = pq.read_metadata(io.BytesIO(_FILES[name]))
    rows = np.array([599, 3, 250, 8, 401, 1, 100], np.int64)  # none a multiple of 7: no nulls
    groups = (rows // 200).astype(np.int32)
    ranges = [chunk_range(meta.row_group(int(g)), (0,)) for g in groups]
    return (
        [name],
        np.zeros(len(rows), np.intp),
        groups,
        (rows % 200).astype(np.int32),
        np.array([r[0] for r in ranges], np.int64),
        np.array([r[1] for r in ranges], np.int64),
        rows,
    )


@pytest.mark.slow(seconds=20)
@pytest.mark.parametrize("name", sorted(_FILES))
def test_rows_of_an_uncompressed_file_are_read_in_place_through_the_cache(
    s3: ThrowawayS3, tmp_path: Path, name: str
) -> None:
    """Through the node cache, an uncompressed file's rows are read where they lie (a
    batch's rows together) and no row group is decoded; a snappy file's row groups are
    decoded as before; both serve the same bytes, and a null row is reported as missing."""
    inner = S3Fetcher(retry_s=2.0)
    store = BlockStore(tmp_path / "cache", capacity_bytes=1 << 30)
    files = ObjectFiles(
        ROOT, CachingFetcher(inner, store, stats=CacheStats()), inner.size, max_sample_bytes=1 << 20
    )
    rows = ParquetRows(files, "image", None)
    paths, which, groups, within, offsets, lengths, wanted = _batch(name)
    rows.begin_batch()
    rows.load(Ranges(paths, which, offsets, lengths), groups, within)
    # Rows read in place are read together for the batch, as tar members are.
    assert len(files._staged) == (len(wanted) if name == "plain.parquet" else 0)
    for g, r, o, n, i in zip(groups, within, offsets, lengths, wanted, strict=True):
        assert bytes(rows.value(name, int(g), int(r), int(o), int(n))[0]) == _VALUES[int(i)]
    got = rows.gather(Ranges(paths, which, offsets, lengths), groups, within)
    assert got is not None
    data, starts, sizes, numbers = got
    assert not numbers
    assert [bytes(data[a : a + n]) for a, n in zip(starts, sizes, strict=True)] == [
        _VALUES[int(i)] for i in wanted
    ]
    decoded = bool(rows._groups)
    assert decoded == (name == "snappy.parquet")
    value, _ = rows.value(name, 1, 50, int(offsets[2]), int(lengths[2]))
    assert bytes(value) == _VALUES[250]
    null_group = chunk_range(pq.read_metadata(io.BytesIO(_FILES[name])).row_group(0), (0,))
    with pytest.raises(BadSample) as missing:
        rows.value(name, 0, 7, *null_group)
    assert missing.value.kind == "missing"
    files.close()
