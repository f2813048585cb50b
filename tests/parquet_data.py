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
