"""The node cache's faults end to end: a real server with ``--cache-dir`` over an ``s3://``
dataset of images in a real S3-compatible store (SeaweedFS on loopback). Cached blocks replaced by a
directory, a FIFO and garbage behind the server's back are fetched again: the next epoch is
whole and identical, with ``on_error="raise"`` (no DataLoss, no hang). A cache directory
another user may write in is refused when the server starts, saying what to fix."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from s3server import ThrowawayS3, bucket_in_env
from sqlalchemy.engine import Engine

import batchd
from batchd_server.catalog import migrate
from batchd_server.catalog.db import make_engine
from batchd_server.demo_data import write_demo_images
from batchd_server.errors import FailedPrecondition
from batchd_server.metrics import node_cache as cache_metrics

from serving import serve

pytestmark = pytest.mark.slow(seconds=60)

BUCKET = "cachefaults"
IMAGE = batchd.Image(size=24)


@pytest.fixture(scope="module")
def s3() -> Iterator[ThrowawayS3]:
    with bucket_in_env(BUCKET) as server:
        yield server


@pytest.fixture(scope="module")
def catalog(s3: ThrowawayS3, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """Images (an object each) in the store, as ``s3images``."""
    tmp = tmp_path_factory.mktemp("cache-faults")
    url = f"sqlite:///{tmp / 'catalog.db'}"
    engine: Engine = make_engine(url)
    migrate.upgrade(engine)
    write_demo_images(tmp / "images", 20, seed=4)
    s3.upload_tree(tmp / "images", BUCKET, "images")
    done = subprocess.run(
        [sys.executable, "-m", "batchd_server.cli", "ingest", "imagefolder", "--dataset",
         "s3images", "--root", f"s3://{BUCKET}/images"],
        env={**os.environ, **s3.env(), "BATCHD_DATABASE_URL": url},
        capture_output=True, text=True, timeout=180,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    engine.dispose()
    yield url


def _epoch(server: Any, epoch: int) -> list[dict[str, np.ndarray]]:
    out = []
    with batchd.Loader(
        server.address, dataset="s3images", batch_size=4, pipeline=IMAGE, seed=3,
        device="cpu", on_error="raise",
    ) as loader:  # fmt: skip
        loader.set_epoch(epoch)
        for batch in loader:
            out.append({k: np.asarray(v) for k, v in batch.items()})
    return out


def test_blocks_replaced_behind_the_servers_back_are_fetched_again(
    catalog: str, tmp_path: Path
) -> None:
    cache = tmp_path / "cache"
    with serve(catalog, tmp_path, cache_dir=cache, cache_size_bytes=64 << 20) as server:
        first = _epoch(server, 0)
        blocks = sorted(p for p in (cache / "blocks").glob("*/*.[0-9]*") if p.is_file())
        assert len(blocks) >= 3
        for path, fault in zip(blocks, ["directory", "fifo", "garbage"], strict=False):
            path.unlink()
            if fault == "directory":
                path.mkdir()
            elif fault == "fifo":
                os.mkfifo(path)
            else:
                path.write_bytes(b"not a block")
        corrupt = cache_metrics.CACHE_CORRUPT._value.get()
        again = _epoch(server, 0)
        assert cache_metrics.CACHE_CORRUPT._value.get() >= corrupt + 3
    assert len(first) == len(again)
    for a, b in zip(first, again, strict=True):
        for name in a:
            assert np.array_equal(a[name], b[name]), name


def test_a_cache_directory_others_may_write_in_is_refused_at_start(
    catalog: str, tmp_path: Path
) -> None:
    cache = tmp_path / "shared-cache"
    cache.mkdir()
    cache.chmod(0o777)
    with (
        pytest.raises(FailedPrecondition, match=r"writable by its group or by anyone.*chmod"),
        serve(catalog, tmp_path, cache_dir=cache),
    ):
        pass
