"""The decode cache on ``s3://`` datasets, end to end: a real store (SeaweedFS) behind a
counting proxy (``s3server.FaultyProxy``), a real server with the cache, ``batchd.Loader``.

A cached epoch of an object-store dataset costs no request, its rows equal an uncached
session's, and the first (missing) epoch still fetches a batch's tar members in a few
requests, not one per sample.
"""

from __future__ import annotations

import io
import os
import tarfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from PIL import Image
from s3server import FaultyProxy, ThrowawayS3, bucket_in_env
from sqlalchemy.engine import Engine

import batchd
from batchd_server.api import RunningServer
from batchd_server.catalog import migrate
from batchd_server.catalog.db import make_engine
from batchd_server.catalog.ingest import ingest_imagefolder, ingest_tar
from batchd_server.demo_data import write_demo_images
from batchd_server.metrics import REGISTRY

from serving import serve

pytestmark = pytest.mark.slow(seconds=60)

BUCKET = "decoded"
PIPELINE = batchd.Image(size=24)
SHARD_IMAGES = 12
BATCH = 6


def _jpeg(i: int) -> bytes:
    out = io.BytesIO()
    Image.new("RGB", (40 + i, 30 + 2 * i), (9 * i, 255 - 9 * i, 90)).save(out, format="JPEG")
    return out.getvalue()


def _write_shards(root: Path) -> None:
    """Two WebDataset shards of :data:`SHARD_IMAGES` JPEGs each."""
    root.mkdir(parents=True)
    for s in range(2):
        with tarfile.open(root / f"img-train-{s}.tar", "w") as tar:
            for j in range(SHARD_IMAGES):
                i = s * SHARD_IMAGES + j
                for name, data in ((f"{i:03d}.jpg", _jpeg(i)), (f"{i:03d}.cls", b"1")):
                    info = tarfile.TarInfo(name)
                    info.size = len(data)
                    tar.addfile(info, io.BytesIO(data))


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[ThrowawayS3, FaultyProxy]]:
    """A store holding tar shards and loose images, this process pointed at it through a
    proxy that counts requests (the server's workers inherit the environment)."""
    tmp = tmp_path_factory.mktemp("store")
    with bucket_in_env(BUCKET) as s3:
        _write_shards(tmp / "tars")
        s3.upload_tree(tmp / "tars", BUCKET, "tars")
        write_demo_images(tmp / "images", 18, seed=3)
        s3.upload_tree(tmp / "images", BUCKET, "images")
        proxy = FaultyProxy(s3.ports["s3"])
        saved = os.environ["AWS_ENDPOINT_URL"]
        os.environ["AWS_ENDPOINT_URL"] = proxy.endpoint
        try:
            yield s3, proxy
        finally:
            os.environ["AWS_ENDPOINT_URL"] = saved
            proxy.close()


@pytest.fixture(scope="module")
def catalog(
    store: tuple[ThrowawayS3, FaultyProxy], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Engine]:
    tmp = tmp_path_factory.mktemp("catalog")
    engine = make_engine(f"sqlite:///{tmp / 'catalog.db'}")
    migrate.upgrade(engine)
    ingest_tar(engine, dataset="tars", root=f"s3://{BUCKET}/tars", shards=["img-train-*.tar"])
    ingest_imagefolder(engine, dataset="images", root=f"s3://{BUCKET}/images")
    try:
        yield engine
    finally:
        engine.dispose()


@pytest.fixture(scope="module")
def server(catalog: Engine, tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningServer]:
    url = catalog.url.render_as_string(hide_password=False)
    with serve(url, tmp_path_factory.mktemp("server"), decode_cache_bytes=64 << 20) as srv:
        yield srv


def lookups(dataset: str, result: str) -> float:
    labels = {"dataset": dataset, "result": result}
    return REGISTRY.get_sample_value("batchd_decode_cache_lookups_total", labels) or 0.0


def epoch(server: RunningServer, dataset: str, number: int, **kw: Any) -> list[np.ndarray]:
    """The images of one epoch, in order."""
    with batchd.Loader(
        server.address, dataset=dataset, batch_size=BATCH, pipeline=PIPELINE, seed=1, **kw
    ) as loader:
        loader.set_epoch(number)
        found = []
        for batch in loader:
            assert loader.last_failed_sample_ids == ()
            found.append(batch["image"].numpy().copy())
        return found


@pytest.mark.parametrize("dataset", ["tars", "images"])
def test_a_cached_epoch_of_an_object_store_dataset_costs_no_request_and_is_exact(
    server: RunningServer, store: tuple[ThrowawayS3, FaultyProxy], dataset: str
) -> None:
    """Epoch 0 misses every sample and caches it; epochs 1 and 2 hit every one, send the
    store nothing for their samples (no staging or prefetch of what the cache holds: only
    each OpenSession's check that the root is reachable), and equal an uncached session's
    epochs."""
    proxy = store[1]
    misses, hits = lookups(dataset, "miss"), lookups(dataset, "hit")
    first = epoch(server, dataset, 0)
    samples = sum(len(b) for b in first)
    assert lookups(dataset, "miss") - misses == samples
    before = proxy.requests
    cached = {n: epoch(server, dataset, n) for n in (1, 2)}
    assert proxy.requests - before <= 2, "a hit must not touch the store (2 opens)"
    assert lookups(dataset, "hit") - hits == 2 * samples
    for n, batches in cached.items():
        fresh = epoch(server, dataset, n, decode_cache=False)
        assert len(fresh) == len(batches)
        for a, b in zip(batches, fresh, strict=True):
            np.testing.assert_array_equal(a, b, err_msg=f"epoch {n}")


def test_an_epoch_of_misses_still_stages_a_batchs_tar_members_together(
    catalog: Engine, store: tuple[ThrowawayS3, FaultyProxy], tmp_path: Path
) -> None:
    """With the cache on, a batch of misses is fetched as with the cache off: a request or
    so per shard the batch touches, not one per sample (the cache used to turn that off)."""
    proxy = store[1]
    url = catalog.url.render_as_string(hide_password=False)
    samples = 2 * SHARD_IMAGES
    with serve(url, tmp_path, decode_cache_bytes=64 << 20) as srv:
        before = proxy.requests
        epoch(srv, "tars", 5, decode_cache=False)
        uncached = proxy.requests - before
        before = proxy.requests
        misses = lookups("tars", "miss")
        epoch(srv, "tars", 5)
        cached = proxy.requests - before
        missed = lookups("tars", "miss") - misses
    assert uncached < samples / 2, uncached
    assert cached <= uncached, (cached, uncached)
    assert missed == samples, "a fresh server: every one a miss"
