"""Parquet sources, part by part: the catalog rows an ingest writes (Postgres and SQLite), and
a worker's row reader over real files (what it reads, and how often)."""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import sqlalchemy as sa
from sqlalchemy.engine import Engine

from batchd_server.catalog.ingest import ingest_parquet
from batchd_server.catalog.reader import load_split
from batchd_server.errors import DataError
from batchd_server.parquet.rows import ParquetRows
from batchd_server.pipelines.base import BadSample
from batchd_server.storage.files import SampleFiles
from batchd_server.storage.ranges import Ranges
from batchd_server.storage.reader import LocalHooks


def _blobs(n: int) -> list[bytes]:
    return [bytes([i % 251]) * (10 + i) for i in range(n)]


def _write(path: Path, columns: dict[str, Any], row_group_size: int) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.table(columns), path, row_group_size=row_group_size)


def _chunk(path: Path, group: int, leaf: str) -> tuple[int, int]:
    """Where pyarrow's metadata says the ``leaf`` column's chunk of ``group`` is."""
    meta = pq.read_metadata(path).row_group(group)
    (column,) = [
        meta.column(i) for i in range(meta.num_columns) if meta.column(i).path_in_schema == leaf
    ]
    start = column.data_page_offset
    if column.has_dictionary_page and 0 < column.dictionary_page_offset < start:
        start = column.dictionary_page_offset
    return start, column.total_compressed_size


def _rows(engine: Engine, dataset: str) -> list[Any]:
    with engine.connect() as conn:
        return list(
            conn.execute(
                sa.text(
                    "SELECT s.key, s.path, s.byte_offset, s.byte_length, s.label, s.split, "
                    "s.length, s.row_group, s.row_index FROM samples s JOIN datasets d "
                    "ON d.id = s.dataset_id WHERE d.name = :name ORDER BY s.id"
                ),
                {"name": dataset},
            )
        )


# --------------------------------------------------------------------------- ingest


def test_each_row_becomes_a_sample_with_its_row_group_row_and_payload_chunk(
    engine: Engine, tmp_path: Path
) -> None:
    """Rows in file order; the byte range is the payload leaf's chunk in the row's group
    (the struct field's for ``image.bytes``); labels (null too) and splits from columns."""
    n = 10
    blobs = _blobs(n)
    _write(
        tmp_path / "data" / "a.parquet",
        {
            "image": pa.array([{"bytes": b, "path": f"{i}.png"} for i, b in enumerate(blobs)]),
            "label": pa.array([None if i == 4 else i % 3 for i in range(n)], pa.int16()),
            "part": pa.array(["train" if i < 7 else "val" for i in range(n)]),
        },
        row_group_size=4,
    )
    report = ingest_parquet(
        engine,
        dataset="hf",
        root=tmp_path / "data",
        files=["*.parquet"],
        payload="image.bytes",
        split_column="part",
        label="label",
    )
    assert (report.rows_read, report.inserted) == (n, n)
    rows = _rows(engine, "hf")
    path = tmp_path / "data" / "a.parquet"
    for i, row in enumerate(rows):
        group, index = divmod(i, 4)
        offset, length = _chunk(path, group, "image.bytes")
        assert tuple(row) == (
            f"a.parquet#{i}",
            "a.parquet",
            offset,
            length,
            None if i == 4 else i % 3,
            "train" if i < 7 else "val",
            None,
            group,
            index,
        )
    arrays = load_split(engine, "hf", "train")
    assert arrays.row_groups.tolist() == [0, 0, 0, 0, 1, 1, 1]
    assert arrays.row_indexes.tolist() == [0, 1, 2, 3, 0, 1, 2]
    assert arrays.dataset.parquet_payload == "image.bytes"
    again = ingest_parquet(
        engine, dataset="hf", root=tmp_path / "data", files=["a.parquet"],
        payload="image.bytes", split_column="part",
    )  # fmt: skip
    assert (again.inserted, again.already_present) == (0, n)


def test_a_token_lists_length_is_its_list_length_unless_a_length_column_says(
    engine: Engine, tmp_path: Path
) -> None:
    """Without --length a list payload's length is the catalog's length; with it, the
    column's; a negative length is refused naming the file and row."""
    tokens = [list(range(i % 5)) for i in range(8)]
    _write(
        tmp_path / "t" / "tok.parquet",
        {
            "ids": pa.array(tokens, pa.list_(pa.int64())),
            "n": pa.array([7] * 7 + [-1], pa.int32()),
            "doc": pa.array([f"doc-{i}" for i in range(8)]),
        },
        row_group_size=3,
    )
    ingest_parquet(
        engine, dataset="tok", root=tmp_path / "t", files=["tok.parquet"], payload="ids",
        split="train", key="doc",
    )  # fmt: skip
    rows = _rows(engine, "tok")
    assert [(r.key, r.length) for r in rows] == [(f"doc-{i}", len(t)) for i, t in enumerate(tokens)]
    with pytest.raises(DataError, match=r"tok.parquet, row 7: length=-1 is not valid"):
        ingest_parquet(
            engine, dataset="tok2", root=tmp_path / "t", files=["tok.parquet"], payload="ids",
            split="train", length="n",
        )  # fmt: skip


def test_refusals_name_what_is_wrong_and_write_nothing(engine: Engine, tmp_path: Path) -> None:
    """Another payload column than the dataset's, no split or two, a label of text, and a
    pattern matching nothing: DataError, and the catalog is unchanged."""
    _write(
        tmp_path / "d" / "x.parquet",
        {"a": pa.array(_blobs(3)), "b": pa.array(_blobs(3)), "s": pa.array(["x", "y", "z"])},
        row_group_size=2,
    )
    root = tmp_path / "d"
    ingest_parquet(engine, dataset="ds", root=root, files=["x.parquet"], payload="a", split="t")
    with pytest.raises(DataError, match=r"serves Parquet column 'a'.*new --version"):
        ingest_parquet(engine, dataset="ds", root=root, files=["x.parquet"], payload="b", split="t")
    for split, column in ((None, None), ("t", "s")):
        with pytest.raises(DataError, match="--split NAME or --split-column COLUMN"):
            ingest_parquet(
                engine, dataset="e", root=root, files=["x.parquet"], payload="a",
                split=split, split_column=column,
            )  # fmt: skip
    with pytest.raises(DataError, match=r"column 's' \(--label\) is string; it must hold integers"):
        ingest_parquet(
            engine, dataset="e", root=root, files=["x.parquet"], payload="a", split="t", label="s"
        )
    with pytest.raises(DataError, match="matches no file"):
        ingest_parquet(engine, dataset="e", root=root, files=["y*.parquet"], payload="a", split="t")
    with engine.connect() as conn:
        assert conn.scalar(sa.text("SELECT count(*) FROM samples")) == 3
        assert conn.scalar(sa.text("SELECT count(*) FROM datasets")) == 1


# --------------------------------------------------------------------------- worker side


class CountingReader(LocalHooks):
    """A ``SampleFiles`` that counts each size query and each ranged read."""

    def __init__(self, root: Path) -> None:
        self.files = SampleFiles(str(root))
        self.sizes: Counter[str] = Counter()
        self.reads: Counter[tuple[str, int, int]] = Counter()
        self.range_calls = 0

    def size(self, path: str) -> int:
        self.sizes[path] += 1
        return self.files.size(path)

    def read(self, path: str, offset: int = -1, length: int = -1) -> memoryview:
        self.reads[(path, offset, length)] += 1
        return self.files.read(path, offset, length)

    def read_ranges(self, ranges: Ranges) -> Any:
        self.range_calls += 1
        return self.files.read_ranges(ranges)


def test_a_worker_reads_each_footer_once_and_each_row_groups_chunk_once(tmp_path: Path) -> None:
    """Serving every row of two files over two batches reads each file's size and footer
    once, and each row group's payload chunk once; each row's bytes are its value."""
    blobs = _blobs(20)
    for part in range(2):
        _write(
            tmp_path / f"p{part}.parquet",
            {"png": pa.array(blobs[part * 10 : part * 10 + 10]), "x": pa.array(range(10))},
            row_group_size=4,
        )
    reader = CountingReader(tmp_path)
    rows = ParquetRows(reader, "png", None)
    for batch in range(2):
        rows.begin_batch()
        for i in range(20):
            if i % 2 != batch:
                continue
            part, within = divmod(i, 10)
            group, row = divmod(within, 4)
            name = f"p{part}.parquet"
            offset, length = _chunk(tmp_path / name, group, "png")
            data, numbers = rows.value(name, group, row, offset, length)
            assert bytes(data) == blobs[i] and not numbers
    assert reader.sizes == {"p0.parquet": 1, "p1.parquet": 1}
    assert all(count == 1 for count in reader.reads.values()), reader.reads
    # Per file: the 8-byte tail, the footer, and one read per row group (3 groups of <= 4).
    assert len(reader.reads) == 2 * (2 + 3), reader.reads


def test_numbers_arrive_as_the_pipelines_dtype_and_bad_rows_are_bad_samples(
    tmp_path: Path,
) -> None:
    """list<int64> to uint16 tokens: a value that does not fit is kind ``shape``, a null row
    kind ``missing``; fixed_size_list<float64> to float32 arrays, row by row."""
    _write(
        tmp_path / "n.parquet",
        {
            "ids": pa.array([[1, 2], [70000], None, [3]], pa.list_(pa.int64())),
            "vec": pa.FixedSizeListArray.from_arrays(pa.array(np.arange(8, dtype=np.float64)), 2),
        },
        row_group_size=4,
    )
    path = tmp_path / "n.parquet"
    files = SampleFiles(str(tmp_path))
    tokens = ParquetRows(files, "ids", np.dtype("<u2"))
    where = _chunk(path, 0, "ids.list.element")
    data, numbers = tokens.value("n.parquet", 0, 0, *where)
    assert numbers and np.frombuffer(data, "<u2").tolist() == [1, 2]
    assert np.frombuffer(tokens.value("n.parquet", 0, 3, *where)[0], "<u2").tolist() == [3]
    with pytest.raises(BadSample, match="70000 does not fit the pipeline's uint16") as e:
        tokens.value("n.parquet", 0, 1, *where)
    assert e.value.kind == "shape"
    with pytest.raises(BadSample, match=r"row group 0, row 2\): the payload is null") as e:
        tokens.value("n.parquet", 0, 2, *where)
    assert e.value.kind == "missing"
    arrays = ParquetRows(files, "vec", np.dtype("<f4"))
    where = _chunk(path, 0, "vec.list.element")
    assert np.frombuffer(arrays.value("n.parquet", 0, 3, *where)[0], "<f4").tolist() == [6, 7]


def test_a_file_that_changed_or_is_not_parquet_is_a_corrupt_sample(tmp_path: Path) -> None:
    """A byte range that no longer matches the footer, a row group or row past the file's,
    and a file that is not Parquet: BadSample ``corrupt`` saying to re-ingest."""
    _write(tmp_path / "a.parquet", {"png": pa.array(_blobs(6))}, row_group_size=3)
    (tmp_path / "junk.parquet").write_bytes(b"x" * 100)
    rows = ParquetRows(SampleFiles(str(tmp_path)), "png", None)
    offset, length = _chunk(tmp_path / "a.parquet", 1, "png")
    for group, row, at in ((1, 0, offset + 1), (5, 0, offset), (1, 9, offset)):
        with pytest.raises(BadSample, match="changed since it was ingested") as e:
            rows.value("a.parquet", group, row, at, length)
        assert e.value.kind == "corrupt"
    with pytest.raises(BadSample, match="not a Parquet file") as e:
        rows.value("junk.parquet", 0, 0, 4, 10)
    assert e.value.kind == "corrupt"


def test_gather_copies_the_rows_of_several_groups_in_order_or_declines_a_bad_row(
    tmp_path: Path,
) -> None:
    """Rows of two files and several row groups, in any order, come back as one buffer with
    each row's start and length; a batch with a null row is declined (None), for the
    row-by-row path to report it."""
    blobs = _blobs(12)
    for part in range(2):
        values: list[bytes | None] = list(blobs[part * 6 : part * 6 + 6])
        if part == 1:
            values[5] = None
        _write(tmp_path / f"g{part}.parquet", {"png": pa.array(values, pa.binary())}, 4)
    rows = ParquetRows(SampleFiles(str(tmp_path)), "png", None)
    wanted = [7, 0, 5, 1, 9, 4]  # sample i: file i // 6, row group (i % 6) // 4
    paths = ["g0.parquet", "g1.parquet"]
    files = np.array([i // 6 for i in wanted], np.intp)
    groups = np.array([(i % 6) // 4 for i in wanted], np.int32)
    within = np.array([(i % 6) % 4 for i in wanted], np.int32)
    ranges = [
        _chunk(tmp_path / paths[f], int(g), "png") for f, g in zip(files, groups, strict=True)
    ]
    offsets = np.array([r[0] for r in ranges], np.int64)
    lengths = np.array([r[1] for r in ranges], np.int64)
    got = rows.gather(Ranges(paths, files, offsets, lengths), groups, within)
    assert got is not None
    data, starts, sizes, numbers = got
    assert not numbers
    assert [data[a : a + n].tobytes() for a, n in zip(starts, sizes, strict=True)] == [
        blobs[i] for i in wanted
    ]
    files[0], groups[0], within[0] = 1, 1, 1  # sample 11: the null row
    offsets[0], lengths[0] = _chunk(tmp_path / "g1.parquet", 1, "png")
    assert rows.gather(Ranges(paths, files, offsets, lengths), groups, within) is None


def test_load_reads_a_batchs_row_groups_together_and_then_rows_cost_no_read(
    tmp_path: Path,
) -> None:
    """``load`` fetches the payload chunks of every row group a batch needs in one
    ``read_ranges`` (what keeps several GETs in flight on an object store); serving the rows
    after it reads nothing more, and their bytes are right."""
    blobs = _blobs(16)
    _write(tmp_path / "l.parquet", {"png": pa.array(blobs)}, row_group_size=4)
    reader = CountingReader(tmp_path)
    rows = ParquetRows(reader, "png", None)
    wanted = np.array([13, 2, 6, 9, 0, 15], np.int64)
    groups = (wanted // 4).astype(np.int32)
    ranges = [_chunk(tmp_path / "l.parquet", int(g), "png") for g in groups]
    offsets = np.array([r[0] for r in ranges], np.int64)
    lengths = np.array([r[1] for r in ranges], np.int64)
    files = np.zeros(len(wanted), np.intp)
    rows.load(Ranges(["l.parquet"], files, offsets, lengths), groups)
    assert reader.range_calls == 1
    reads = sum(reader.reads.values())  # the footer's two
    for i, g, (offset, length) in zip(wanted.tolist(), groups.tolist(), ranges, strict=True):
        data, _ = rows.value("l.parquet", g, i % 4, offset, length)
        assert bytes(data) == blobs[i]
    assert sum(reader.reads.values()) == reads == 2
