"""Samples the server cannot read are skipped as bad samples of their own kind, through a
real server and real workers: a sparse 1 TiB file in an image dataset (``too_large``, not a
MemoryError that ends the epoch) and a record whose byte range ends past 2**63
(``bad_range``, ingested with ``--no-verify``). The rest of the epoch arrives intact."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import numpy as np
import pytest
import sqlalchemy as sa
from sqlalchemy.engine import Engine

import batchd
from batchd_server.catalog.ingest import ingest_manifest
from batchd_server.catalog.schema import sample_errors, samples

from serving import RECORD_FLOATS, image_dataset, serve

# The embedded catalog only: how a worker reads does not depend on the catalog.
pytestmark = pytest.mark.backend("sqlite")

INT64_MAX = (1 << 63) - 1


def _recorded(engine: Engine, count: int) -> list[tuple[int, str, str]]:
    """The catalog's sample errors, once ``count`` are there (the server writes them from a
    queue, a moment after the batch)."""
    deadline = time.monotonic() + 30
    while True:
        with engine.connect() as conn:
            rows = conn.execute(
                sa.select(sample_errors.c.sample_id, sample_errors.c.kind, sample_errors.c.message)
            ).all()
        if len(rows) >= count or time.monotonic() > deadline:
            return [(int(r[0]), str(r[1]), str(r[2])) for r in rows]
        time.sleep(0.1)


def test_a_sparse_terabyte_image_is_skipped_as_too_large_and_the_epoch_goes_on(
    engine: Engine, tmp_path: Path
) -> None:
    """One JPEG of 12 replaced by a sparse 1 TiB file: under on_error="skip" the epoch
    delivers the other 11, and that one sample is reported (batch and catalog) as
    too_large."""
    root = tmp_path / "images"
    image_dataset(engine, root, n=12)
    with engine.connect() as conn:
        query = sa.select(samples.c.path, samples.c.id).where(samples.c.split == "train")
        ids = {path: sample_id for path, sample_id in conn.execute(query)}
    huge_path = sorted(ids)[0]
    os.truncate(root / huge_path, 1 << 40)
    url = engine.url.render_as_string(hide_password=False)
    with serve(url, tmp_path, workers=1) as srv:
        served: list[int] = []
        failed: list[int] = []
        with batchd.Loader(
            srv.address,
            dataset="images",
            batch_size=4,
            shuffle=False,
            on_error="skip",
            max_error_fraction=0.5,
            pipeline=batchd.Image(size=32),
        ) as loader:
            for batch in loader:
                served += batch["sample_id"].tolist()
                failed += loader.last_failed_sample_ids
        assert failed == [ids[huge_path]]
        assert sorted(served) == sorted(i for p, i in ids.items() if p != huge_path)
        ((sample_id, kind, message),) = _recorded(engine, 1)
    assert (sample_id, kind) == (ids[huge_path], "too_large")
    assert huge_path in message and "--max-sample-bytes" in message


def test_a_record_whose_range_ends_past_int64_is_a_bad_range_and_the_rest_are_intact(
    engine: Engine, tmp_path: Path
) -> None:
    """A shard of 32 records, one row's byte_offset 2**63 - 8 (ingested without
    verification): every batch of the epoch arrives, that record is skipped as bad_range,
    and every other record has exactly its bytes."""
    root = tmp_path / "records"
    root.mkdir()
    n, width = 32, RECORD_FLOATS * 4
    records = np.arange(n * RECORD_FLOATS, dtype=np.float32).reshape(n, RECORD_FLOATS)
    (root / "shard.bin").write_bytes(records.tobytes())
    bad = 5
    rows = [
        {
            "key": f"r{i:03d}",
            "path": "shard.bin",
            "byte_offset": INT64_MAX - 7 if i == bad else i * width,
            "byte_length": width,
            "split": "train",
        }
        for i in range(n)
    ]
    manifest = tmp_path / "records.jsonl"
    manifest.write_text("".join(json.dumps(r) + "\n" for r in rows))
    ingest_manifest(engine, dataset="records", root=root, manifest=manifest, verify=False)
    with engine.connect() as conn:
        key_of = {i: key for i, key in conn.execute(sa.select(samples.c.id, samples.c.key))}
    url = engine.url.render_as_string(hide_password=False)
    with serve(url, tmp_path, workers=1) as srv:
        got: dict[int, np.ndarray] = {}
        failed: list[int] = []
        with batchd.Loader(
            srv.address,
            dataset="records",
            batch_size=8,
            shuffle=False,
            on_error="skip",
            max_error_fraction=0.5,
            pipeline=batchd.Array((RECORD_FLOATS,), "float32", raw=True),
        ) as loader:
            for batch in loader:
                failed += loader.last_failed_sample_ids
                array = batch["array"].numpy()
                for row, sample_id in enumerate(batch["sample_id"].tolist()):
                    got[sample_id] = array[row]
        assert [key_of[i] for i in failed] == [f"r{bad:03d}"]
        assert sorted(key_of[i] for i in got) == [f"r{i:03d}" for i in range(n) if i != bad]
        for sample_id, row in got.items():
            np.testing.assert_array_equal(row, records[int(key_of[sample_id][1:])])
        ((_, kind, message),) = _recorded(engine, 1)
    assert kind == "bad_range"
    assert str(INT64_MAX - 7) in message
