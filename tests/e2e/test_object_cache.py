"""The node cache end to end: a real server with ``--cache-dir`` whose workers read an
``s3://`` dataset from a real S3-compatible store (SeaweedFS on loopback,
``tests/s3server.py``), consumed through ``batchd.Loader``. An epoch fills the cache; with
the store stopped the next epoch completes, identical to the same files read locally; a
restarted server reads what the first one cached without asking the store."""

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
from batchd_server.api import RunningServer
from batchd_server.catalog import migrate
from batchd_server.catalog.db import make_engine
from batchd_server.catalog.ingest import ingest_imagefolder
from batchd_server.demo_data import write_demo_images
from batchd_server.metrics import node_cache as cache_metrics

from chaos_harness import wait_until
from serving import RECORD_FLOATS, record_dataset, serve, token_dataset

pytestmark = pytest.mark.slow(seconds=90)

BUCKET = "cached"
RAW = batchd.Array((RECORD_FLOATS,), "float32", raw=True)
IMAGE = batchd.Image(size=24)


def _ingest(url: str, env: dict[str, str], *args: str) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "batchd_server.cli", "ingest", *args],
        env={**os.environ, **env, "BATCHD_DATABASE_URL": url},
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert done.returncode == 0, done.stderr


@pytest.fixture(scope="module")
def s3() -> Iterator[ThrowawayS3]:
    with bucket_in_env(BUCKET) as server:
        yield server


@pytest.fixture(scope="module")
def catalog(s3: ThrowawayS3, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """Records (byte ranges of one shard) and images (whole objects), each as local files
    (``records``, ``images``) and as the same files in the store (``s3records``,
    ``s3images``); token documents (whole objects) in the store (``s3tokens``)."""
    tmp = tmp_path_factory.mktemp("object-cache")
    url = f"sqlite:///{tmp / 'catalog.db'}"
    engine: Engine = make_engine(url)
    migrate.upgrade(engine)
    record_dataset(engine, tmp / "records", n=301)
    s3.upload_tree(tmp / "records", BUCKET, "records")
    _ingest(url, s3.env(), "manifest", "--dataset", "s3records", "--root",
            f"s3://{BUCKET}/records", str(tmp / "records.jsonl"))  # fmt: skip
    write_demo_images(tmp / "images", 20, seed=2)
    ingest_imagefolder(engine, dataset="images", root=tmp / "images")
    s3.upload_tree(tmp / "images", BUCKET, "images")
    _ingest(url, s3.env(), "imagefolder", "--dataset", "s3images", "--root",
            f"s3://{BUCKET}/images")  # fmt: skip
    token_dataset(engine, tmp / "tokens", n=60)
    s3.upload_tree(tmp / "tokens", BUCKET, "tokens")
    _ingest(url, s3.env(), "manifest", "--dataset", "s3tokens", "--root",
            f"s3://{BUCKET}/tokens", str(tmp / "tokens.jsonl"))  # fmt: skip
    engine.dispose()
    yield url


def _cached_server(url: str, tmp: Path, cache: Path) -> Any:
    return serve(
        url,
        tmp,
        cache_dir=cache,
        cache_size_bytes=64 << 20,
        cache_prefetch_batches=4,
        object_store_retry_s=1.0,
    )


def _batches(loader: batchd.Loader) -> list[dict[str, np.ndarray]]:
    out = []
    for batch in loader:
        assert loader.last_failed_sample_ids == ()
        out.append({k: np.asarray(v) for k, v in batch.items()})
    return out


def _epochs(
    server: RunningServer, dataset: str, pipeline: Any, epochs: list[int], between: Any = None
) -> list[list[dict[str, np.ndarray]]]:
    """Each of ``epochs`` of one session, shuffled; ``between()`` runs after the first."""
    got = []
    with batchd.Loader(
        server.address, dataset=dataset, batch_size=8, pipeline=pipeline, seed=11,
        device="cpu", on_error="raise",
    ) as loader:  # fmt: skip
        for i, epoch in enumerate(epochs):
            if i == 1 and between is not None:
                between()
            loader.set_epoch(epoch)
            got.append(_batches(loader))
    return got


def _same_but_ids(a: list[dict[str, np.ndarray]], b: list[dict[str, np.ndarray]]) -> None:
    assert len(a) == len(b)
    for x, y in zip(a, b, strict=True):
        assert x.keys() == y.keys()
        for name in x:
            if name != "sample_id":
                assert np.array_equal(x[name], y[name]), name


def _counter(metric: Any, **labels: str) -> float:
    return float(metric.labels(**labels)._value.get() if labels else metric._value.get())


@pytest.mark.parametrize(("dataset", "pipeline"), [("records", RAW), ("images", IMAGE)])
def test_with_the_store_stopped_an_epoch_whose_bytes_are_cached_completes_identically(
    s3: ThrowawayS3, catalog: str, tmp_path: Path, dataset: str, pipeline: Any
) -> None:
    """Epoch 1 through the store fills the cache; the store is then stopped, and epoch 2 of
    the same session completes, equal batch for batch to epoch 2 of the same files read
    from a local directory, every block a hit."""
    label = f"s3{dataset}"
    try:
        with _cached_server(catalog, tmp_path, tmp_path / "cache") as server:
            local = _epochs(server, dataset, pipeline, [1, 2])
            hits = _counter(cache_metrics.CACHE_HITS, dataset=label)
            misses = _counter(cache_metrics.CACHE_MISSES, dataset=label)
            remote = _epochs(server, label, pipeline, [1, 2], between=s3.stop)
            assert _counter(cache_metrics.CACHE_HITS, dataset=label) > hits
            assert _counter(cache_metrics.CACHE_MISSES, dataset=label) >= misses
    finally:
        # After the server's own check that no child outlived it (weed is this process's).
        if s3.process is None:
            s3.start()
    _same_but_ids(local[0], remote[0])
    _same_but_ids(local[1], remote[1])


def test_a_restarted_server_reads_what_the_first_one_cached(
    s3: ThrowawayS3, catalog: str, tmp_path: Path
) -> None:
    """A second server on the same --cache-dir serves an epoch without fetching a byte."""
    cache = tmp_path / "cache"
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    with _cached_server(catalog, tmp_path / "a", cache) as server:
        first = _epochs(server, "s3images", IMAGE, [0])
    fetched = _counter(cache_metrics.CACHE_FETCHED_BYTES, reader="worker") + _counter(
        cache_metrics.CACHE_FETCHED_BYTES, reader="prefetch"
    )
    misses = _counter(cache_metrics.CACHE_MISSES, dataset="s3images")
    with _cached_server(catalog, tmp_path / "b", cache) as server:
        again = _epochs(server, "s3images", IMAGE, [0])
    assert _counter(cache_metrics.CACHE_MISSES, dataset="s3images") == misses
    after = _counter(cache_metrics.CACHE_FETCHED_BYTES, reader="worker") + _counter(
        cache_metrics.CACHE_FETCHED_BYTES, reader="prefetch"
    )
    assert after == fetched, "nothing was fetched from the store"
    _same_but_ids(first[0], again[0])


def test_the_server_prefetches_ahead_of_a_stream_that_waits(
    s3: ThrowawayS3, catalog: str, tmp_path: Path
) -> None:
    """A loop that holds its first batch keeps the workers at the ring's few slots (large
    batches: 4); the cache manager fetches the images of the batches after those meanwhile,
    so the rest of the epoch's blocks are hits, and the lead it reports is above 0."""
    cache = tmp_path / "cache"
    prefetched = _counter(cache_metrics.CACHE_FETCHED_BYTES, reader="prefetch")
    hits = _counter(cache_metrics.CACHE_HITS, dataset="s3images")
    with (
        _cached_server(catalog, tmp_path, cache) as server,
        batchd.Loader(
            server.address, dataset="s3images", batch_size=2, prefetch=1, shuffle=False,
            pipeline=batchd.Image(size=1024), device="cpu",
        ) as loader,
    ):  # fmt: skip
        batches = iter(loader)
        next(batches)
        wait_until(
            lambda: _counter(cache_metrics.CACHE_FETCHED_BYTES, reader="prefetch") > prefetched,
            "a prefetch",
            timeout_s=60,
        )
        wait_until(
            lambda: _counter(cache_metrics.CACHE_PREFETCH_LEAD, dataset="s3images") > 0,
            "a prefetch lead",
            timeout_s=60,
        )
        rest = list(batches)
    assert len(rest) == 7  # 16 training images
    assert _counter(cache_metrics.CACHE_HITS, dataset="s3images") > hits


def test_the_server_prefetches_the_documents_of_a_packed_stream_that_waits(
    s3: ThrowawayS3, catalog: str, tmp_path: Path
) -> None:
    """A packed session's plan is followed like any other's: while its loop holds the first
    batch, the cache manager fetches the documents of the batches after the workers', so
    the rest of the epoch reads them from the node cache."""
    cache = tmp_path / "cache"
    prefetched = _counter(cache_metrics.CACHE_FETCHED_BYTES, reader="prefetch")
    hits = _counter(cache_metrics.CACHE_HITS, dataset="s3tokens")
    with (
        _cached_server(catalog, tmp_path, cache) as server,
        batchd.Loader(
            server.address, dataset="s3tokens", batch_size=2, prefetch=1, shuffle=False,
            pipeline=batchd.Tokens(max_len=64), pack=batchd.Pack(seq_len=16), device="cpu",
        ) as loader,
    ):  # fmt: skip
        batches = iter(loader)
        first = next(batches)
        wait_until(
            lambda: _counter(cache_metrics.CACHE_FETCHED_BYTES, reader="prefetch") > prefetched,
            "a prefetch",
            timeout_s=60,
        )
        rest = list(batches)
    tokens = sum(int(np.asarray(b["length"]).sum()) for b in [first, *rest])
    assert tokens == sum(i % 13 + 1 for i in range(60)), "every document's tokens, once"
    assert _counter(cache_metrics.CACHE_HITS, dataset="s3tokens") > hits
