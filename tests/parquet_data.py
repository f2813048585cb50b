"""Parquet files for the tests, written with pyarrow: images (a binary column and a Hugging
Face style struct) beside the same images as a class-per-directory tree, and the records of
``serving.record_dataset`` as fixed-size lists."""

from __future__ import annotations

import io
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
from PIL import Image

from serving import RECORD_FLOATS

__all__ = ["N_IMAGES", "N_RECORDS", "png", "records_parquet", "write_images"]

N_IMAGES = 30
N_RECORDS = 203  # prime: no world size or batch size divides it


def png(i: int) -> bytes:
    rng = np.random.default_rng(i)
    pixels = rng.integers(0, 256, (20 + i % 7, 24 + i % 5, 3), dtype=np.uint8)
    out = io.BytesIO()
    Image.fromarray(pixels).save(out, format="PNG")
    return out.getvalue()


def write_images(tmp: Path) -> tuple[Path, Path]:
    """The same images as a class-per-directory tree (image ``i`` in class ``c{i:03d}``, so
    its label is ``i``) and as two Parquet files of 7-row groups, each twice: a binary column
    ``png`` and a Hugging Face style ``image`` struct of ``bytes`` and ``path``."""
    folder, parquet = tmp / "folder", tmp / "parquet"
    parquet.mkdir(parents=True)
    images = [png(i) for i in range(N_IMAGES)]
    for i, data in enumerate(images):
        (folder / "train" / f"c{i:03d}").mkdir(parents=True)
        (folder / "train" / f"c{i:03d}" / f"img{i:03d}.png").write_bytes(data)
    half = N_IMAGES // 2
    for part, rows in enumerate((range(half), range(half, N_IMAGES))):
        table = pa.table(
            {
                "png": pa.array([images[i] for i in rows], pa.binary()),
                "image": pa.array([{"bytes": images[i], "path": f"img{i:03d}.png"} for i in rows]),
                "label": pa.array(list(rows), pa.int64()),
                "split": pa.array(["train"] * len(rows)),
            }
        )
        pq.write_table(table, parquet / f"images-{part}.parquet", row_group_size=7)
    return folder, parquet


def records_parquet(root: Path) -> np.ndarray:
    """The records of ``serving.record_dataset`` (record ``i`` is ``i * 1000 + arange``,
    label ``i % 10``), as fixed-size lists of float32 in three files of 16-row groups."""
    root.mkdir(parents=True)
    records = np.arange(N_RECORDS, dtype=np.float32)[:, None] * 1000
    records = records + np.arange(RECORD_FLOATS, dtype=np.float32)
    for part, rows in enumerate(np.array_split(np.arange(N_RECORDS), 3)):
        values = pa.array(records[rows].reshape(-1))
        table = pa.table(
            {
                "record": pa.FixedSizeListArray.from_arrays(values, RECORD_FLOATS),
                "label": pa.array((rows % 10).tolist(), pa.int32()),
                "key": pa.array([f"r{i:06d}" for i in rows]),
            }
        )
        pq.write_table(table, root / f"records-{part}.parquet", row_group_size=16)
    return records


def _varint(n: int) -> bytes:
    out = bytearray()
    while n >= 0x80:
        out.append(n & 0x7F | 0x80)
        n >>= 7
    return bytes(out + bytes([n]))


def with_row_counts(
    data: bytes,
    *,
    group_rows: dict[int, int],
    column_values: dict[int, int] | None = None,
    file_rows: int | None = None,
) -> bytes:
    """A Parquet file whose footer says other row counts (a footer that lies): row group
    ``g`` has ``group_rows[g]`` rows, its first column ``column_values[g]`` values, and the
    file ``file_rows`` rows; the pages are left as they were."""
    from batchd_server.parquet.thrift import Compact

    size = int.from_bytes(data[-8:-4], "little")
    start = len(data) - 8 - size
    footer = data[start:-8]
    edits: list[tuple[int, int, int]] = []  # (begin, end, new value) of i64 varints

    def i64(r: Compact, value: int | None) -> None:
        begin = r.pos
        r.varint()
        if value is not None:
            edits.append((begin, r.pos, value))

    def each(r: Compact) -> int:
        head = r.byte()
        return r.varint() if head >> 4 == 15 else head >> 4

    r = Compact(footer)
    for field, kind in r.fields():
        if field == 3 and kind == 6:
            i64(r, file_rows)
        elif field == 4 and kind == 9:
            for g in range(each(r)):
                for sub, sub_kind in r.fields():
                    if sub == 3 and sub_kind == 6:
                        i64(r, group_rows.get(g))
                    elif sub == 1 and sub_kind == 9 and column_values is not None:
                        for c in range(each(r)):
                            for chunk_field, chunk_kind in r.fields():
                                if chunk_field == 3 and chunk_kind == 12:
                                    for meta, meta_kind in r.fields():
                                        if meta == 5 and meta_kind == 6 and c == 0:
                                            i64(r, column_values.get(g))
                                        else:
                                            r.skip(meta_kind)
                                else:
                                    r.skip(chunk_kind)
                    else:
                        r.skip(sub_kind)
        else:
            r.skip(kind)
    out = bytearray(footer)
    for begin, end, value in sorted(edits, reverse=True):
        out[begin:end] = _varint(value << 1)
    return data[:start] + bytes(out) + len(out).to_bytes(4, "little") + b"PAR1"
