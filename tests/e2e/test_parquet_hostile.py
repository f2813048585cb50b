"""Hostile Parquet files end to end, through a real S3 store, a real server reading through
its node cache (where uncompressed rows are read in place, their page headers walked) and
``batchd.Loader`` with ``on_error="skip"``: a payload chunk whose page header is a 9-byte map
of two-to-the-49 booleans, and a ZSTD bomb of 32 MiB of zeros in one row, end as bad samples
of their rows (``corrupt``, ``too_large``), recorded in the catalog; every other row is
served, each once, in two epochs from the same worker pool. No hang, no DataLoss."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import sqlalchemy as sa
from parquet_data import png
from s3server import ThrowawayS3, bucket_in_env
from sqlalchemy.engine import Engine

import batchd
from batchd_server.catalog.ingest import ingest_parquet
from batchd_server.parquet.payload import chunk_range

from serving import serve

pytestmark = [pytest.mark.backend("sqlite"), pytest.mark.slow(seconds=40)]

BUCKET = "hostile"
MAP_OF_BOOLS = bytes([0x1B]) + b"\xff" * 6 + b"\x7f" + bytes([0x11])
"""Field 1, a map of 2**49 - 1 (bool, bool) entries."""
BOMB = 32 << 20
MAX_SAMPLE_BYTES = 4 << 20


def _write(
    root: Path, name: str, labels: list[int], values: list[bytes], **options: object
) -> None:
    table = pa.table({"png": pa.array(values, pa.binary()), "label": pa.array(labels)})
    pq.write_table(table, root / name, **options)


def _files(root: Path) -> None:
    """good: six images in place; header: six images whose second row group's first page
    header is :data:`MAP_OF_BOOLS`; bomb: a row of :data:`BOMB` zeros, ZSTD, beside two
    images in row groups of their own."""
    root.mkdir(parents=True)
    plain = {"compression": "none", "use_dictionary": False, "row_group_size": 3}
    _write(root, "good.parquet", list(range(6)), [png(i) for i in range(6)], **plain)
    _write(root, "header.parquet", list(range(10, 16)), [png(i) for i in range(10, 16)], **plain)
    data = bytearray((root / "header.parquet").read_bytes())
    start, _ = chunk_range(pq.read_metadata(root / "header.parquet").row_group(1), (0,))
    data[start : start + len(MAP_OF_BOOLS)] = MAP_OF_BOOLS
    (root / "header.parquet").write_bytes(bytes(data))
    values = [b"\x00" * BOMB, png(21), png(22)]
    _write(root, "bomb.parquet", [20, 21, 22], values, compression="zstd", row_group_size=1)


@pytest.fixture
def store(tmp_path: Path) -> Iterator[ThrowawayS3]:
    with bucket_in_env(BUCKET) as server:
        _files(tmp_path / "data")
        server.upload_tree(tmp_path / "data", BUCKET, "data")
        yield server


def _errors(engine: Engine, count: int) -> dict[str, str]:
    """key -> kind of the catalog's sample errors, once ``count`` are there (the server
    records them from a queue, a moment after the batch)."""
    deadline = time.monotonic() + 30
    query = sa.text(
        "SELECT s.key, e.kind FROM sample_errors e JOIN samples s ON s.id = e.sample_id"
    )
    while True:
        with engine.connect() as conn:
            found = {str(k): str(kind) for k, kind in conn.execute(query)}
        if len(found) >= count or time.monotonic() > deadline:
            return found
        time.sleep(0.1)


@pytest.mark.timeout(120)
def test_a_hostile_header_and_a_zstd_bomb_are_bad_samples_the_rest_is_served(
    store: ThrowawayS3, engine: Engine, tmp_path: Path
) -> None:
    ingest_parquet(
        engine, dataset="hostile", root=f"s3://{BUCKET}/data", files=["*.parquet"],
        payload="png", split="train", label="label",
    )  # fmt: skip
    url = engine.url.render_as_string(hide_password=False)
    good = [*range(6), 10, 11, 12, 21, 22]
    with serve(
        url, tmp_path, cache_dir=tmp_path / "cache", cache_size_bytes=64 << 20,
        max_sample_bytes=MAX_SAMPLE_BYTES, object_store_retry_s=1.0,
    ) as server:  # fmt: skip
        for _ in range(2):  # the second epoch: the same pool, the same answers
            labels: list[int] = []
            failed: list[int] = []
            with batchd.Loader(
                server.address, dataset="hostile", batch_size=4, shuffle=False,
                pipeline=batchd.Image(size=8), device="cpu", on_error="skip",
                max_error_fraction=0.9,
            ) as loader:  # fmt: skip
                for batch in loader:
                    labels += batch["label"].tolist()
                    failed += loader.last_failed_sample_ids
            assert sorted(labels) == good
            assert len(failed) == 4
    assert _errors(engine, 4) == {
        "header.parquet#3": "corrupt",
        "header.parquet#4": "corrupt",
        "header.parquet#5": "corrupt",
        "bomb.parquet#0": "too_large",
    }
