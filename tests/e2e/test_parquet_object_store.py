"""Parquet datasets under ``s3://`` roots, end to end: the same Parquet files in a local
directory and uploaded to a real S3-compatible store (SeaweedFS, ``tests/s3server.py``),
ingested with ``batchd-server ingest parquet`` (globs matched against the store's listing,
footers and small columns read with ranged GETs), served by a real server whose workers read
footers and payload chunks with ranged GETs, consumed through ``batchd.Loader``."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import sqlalchemy as sa
from parquet_data import N_IMAGES, N_RECORDS, records_parquet, write_images
from s3server import ThrowawayS3, bucket_in_env
from sqlalchemy.engine import Engine

import batchd
from batchd_server.api import RunningServer
from batchd_server.catalog import migrate
from batchd_server.catalog.db import make_engine
from batchd_server.catalog.ingest import ingest_parquet

from resume import assert_resume_yields_the_rest
from serving import RECORD_FLOATS, serve

pytestmark = pytest.mark.slow(seconds=60)

BUCKET = "parquet"  # S3 bucket names have 3 to 63 characters
IMAGE = batchd.Image(size=16, resize=20)
ARRAY = batchd.Array((RECORD_FLOATS,), "float32")


def batchd_server(*args: str, url: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    """The ``batchd-server`` command line, as a user runs it, with ``env`` added."""
    return subprocess.run(
        [sys.executable, "-m", "batchd_server.cli", *args],
        env={**os.environ, **env, "BATCHD_DATABASE_URL": url},
        capture_output=True,
        text=True,
        timeout=180,
    )


@pytest.fixture(scope="module")
def s3() -> Iterator[ThrowawayS3]:
    """One store for the module, its keys in this process's environment (the server's
    workers inherit it)."""
    with bucket_in_env(BUCKET) as server:
        yield server


@pytest.fixture(scope="module")
def catalog(s3: ThrowawayS3, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Engine]:
    """Images (the Hugging Face struct) and records, each ingested from local files and, as
    ``s3<name>``, from the same files in the store through the command line."""
    tmp = tmp_path_factory.mktemp("parquet-object-store")
    url = f"sqlite:///{tmp / 'catalog.db'}"
    engine = make_engine(url)
    migrate.upgrade(engine)
    env = s3.env()
    _, images = write_images(tmp / "images")
    records_parquet(tmp / "records")
    (tmp / "junk").mkdir()
    (tmp / "junk" / "notes.parquet").write_bytes(b"not parquet at all, " * 8)
    for name in ("images", "records", "junk"):
        s3.upload_tree(tmp / name, BUCKET, name)
    ingest_parquet(
        engine, dataset="images", root=images, files=["images-*.parquet"],
        payload="image.bytes", split_column="split", label="label",
    )  # fmt: skip
    ingest_parquet(
        engine, dataset="records", root=tmp / "records", files=["*.parquet"],
        payload="record", split="train", label="label", key="key",
    )  # fmt: skip
    for args in (
        ["--dataset", "s3images", "--root", f"s3://{BUCKET}/images/parquet",
         "--split-column", "split", "--payload", "image.bytes", "--label", "label",
         "images-*.parquet"],
        ["--dataset", "s3records", "--root", f"s3://{BUCKET}/records/", "--split", "train",
         "--payload", "record", "--label", "label", "--key", "key", "records-{0..2}.parquet"],
    ):  # fmt: skip
        done = batchd_server("ingest", "parquet", *args, url=url, env=env)
        assert done.returncode == 0, done.stderr
    try:
        yield engine
    finally:
        engine.dispose()


@pytest.fixture(scope="module")
def server(catalog: Engine, tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningServer]:
    url = catalog.url.render_as_string(hide_password=False)
    with serve(url, tmp_path_factory.mktemp("server")) as srv:
        yield srv


def _epoch(server: RunningServer, dataset: str, pipeline: Any) -> list[dict[str, np.ndarray]]:
    """Every batch of one unshuffled epoch, as numpy arrays."""
    with batchd.Loader(
        server.address, dataset=dataset, batch_size=6, pipeline=pipeline, shuffle=False,
        device="cpu",
    ) as loader:  # fmt: skip
        batches = []
        for batch in loader:
            assert loader.last_failed_sample_ids == ()
            batches.append({k: np.asarray(v).copy() for k, v in batch.items()})
        return batches


def _catalog_rows(engine: Engine, dataset: str) -> list[tuple[Any, ...]]:
    with engine.connect() as conn:
        return [
            tuple(r)
            for r in conn.execute(
                sa.text(
                    "SELECT s.key, s.path, s.byte_offset, s.byte_length, s.label, s.split, "
                    "s.row_group, s.row_index FROM samples s JOIN datasets d "
                    "ON d.id = s.dataset_id WHERE d.name = :name ORDER BY s.id"
                ),
                {"name": dataset},
            )
        ]


@pytest.mark.parametrize(("dataset", "pipeline", "rows"), [("images", IMAGE, N_IMAGES)])
def test_an_s3_parquet_dataset_catalogs_and_serves_what_the_local_files_do(
    server: RunningServer, catalog: Engine, dataset: str, pipeline: Any, rows: int
) -> None:
    """The store's ingest writes the local ingest's rows (paths, payload chunks, row groups,
    labels, splits); every sample is served once with the same labels and pixels."""
    assert _catalog_rows(catalog, f"s3{dataset}") == _catalog_rows(catalog, dataset)
    local = _epoch(server, dataset, pipeline)
    remote = _epoch(server, f"s3{dataset}", pipeline)
    labels = [label for b in remote for label in b["label"].tolist()]
    assert sorted(labels) == list(range(rows))
    assert len(local) == len(remote)
    for a, b in zip(local, remote, strict=True):
        for name in a:
            if name != "sample_id":
                assert np.array_equal(a[name], b[name]), name


def test_s3_parquet_records_are_served_once_and_resume_exactly(
    server: RunningServer, catalog: Engine
) -> None:
    """The records from the store equal the local ones batch for batch, each once; a
    mid-epoch state_dict resumes at exactly the next batch."""
    assert _catalog_rows(catalog, "s3records") == _catalog_rows(catalog, "records")
    local = _epoch(server, "records", ARRAY)
    remote = _epoch(server, "s3records", ARRAY)
    served = [i for b in remote for i in b["sample_id"].tolist()]
    assert len(served) == len(set(served)) == N_RECORDS
    for a, b in zip(local, remote, strict=True):
        assert np.array_equal(a["array"], b["array"]) and np.array_equal(a["label"], b["label"])

    def make() -> batchd.Loader:
        return batchd.Loader(
            server.address, dataset="s3records", batch_size=8, pipeline=ARRAY, seed=5,
            device="cpu",
        )  # fmt: skip

    assert_resume_yields_the_rest(make, epochs=2, stop_after=30)


def test_an_object_that_is_not_parquet_or_a_pattern_of_nothing_is_a_clear_ingest_error(
    s3: ThrowawayS3, catalog: Engine
) -> None:
    """Exit 2 with one line naming the object; nothing is written."""
    url = catalog.url.render_as_string(hide_password=False)
    before = _catalog_rows(catalog, "bad")
    for pattern, says in (
        ("*.parquet", "notes.parquet is not a Parquet file"),
        ("nothing-*.parquet", "matches no object"),
    ):
        done = batchd_server(
            "ingest", "parquet", "--dataset", "bad", "--root", f"s3://{BUCKET}/junk",
            "--split", "train", "--payload", "png", pattern, url=url, env=s3.env(),
        )  # fmt: skip
        assert done.returncode == 2, (done.stdout, done.stderr)
        assert says in done.stderr
    assert _catalog_rows(catalog, "bad") == before == []


def test_s3_parquet_through_the_node_cache_serves_the_same_twice(
    catalog: Engine, tmp_path: Path
) -> None:
    """With the node cache on (its plan prefetches each row's payload chunk, the catalog's
    byte range), two epochs of the store's images and records equal the uncached ones."""
    url = catalog.url.render_as_string(hide_password=False)
    (tmp_path / "plain").mkdir()
    (tmp_path / "cached").mkdir()
    with serve(url, tmp_path / "plain") as plain:
        want = {d: _epoch(plain, f"s3{d}", p) for d, p in (("images", IMAGE), ("records", ARRAY))}
    with serve(
        url, tmp_path / "cached", cache_dir=tmp_path / "cache", cache_size_bytes=64 << 20,
        cache_prefetch_batches=4, object_store_retry_s=1.0,
    ) as cached:  # fmt: skip
        for dataset, pipeline in (("images", IMAGE), ("records", ARRAY)):
            for _ in range(2):
                got = _epoch(cached, f"s3{dataset}", pipeline)
                assert len(got) == len(want[dataset])
                for a, b in zip(got, want[dataset], strict=True):
                    for name in a:
                        assert np.array_equal(a[name], b[name]), (dataset, name)
    assert any((tmp_path / "cache").rglob("*")), "the cache holds blocks"
