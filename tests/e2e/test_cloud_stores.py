"""Datasets under ``gs://`` and ``az://`` roots, end to end, as ``test_object_store.py`` does
for ``s3://``: each test runs once against fake-gcs-server and once against Azurite
(``tests/cloudservers.py``), both on loopback. Parquet files, tar shards and an image folder
(one object per sample) are ingested through the ``batchd-server`` command from the store,
served by a real server whose workers read byte ranges from it, and consumed through
``batchd.Loader``; every check compares against the same files read locally. The store is
also restarted mid-epoch, and stopped while the node cache serves an epoch it holds.
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from cloudservers import CloudServer, environment, make_server
from parquet_data import records_parquet
from sqlalchemy.engine import Engine
from test_object_store import _write_shards

import batchd
from batchd_server.api import RunningServer
from batchd_server.catalog import migrate
from batchd_server.catalog.db import make_engine
from batchd_server.catalog.ingest import ingest_imagefolder, ingest_parquet, ingest_tar
from batchd_server.demo_data import write_demo_images
from batchd_server.metrics import node_cache as cache_metrics

from chaos_harness import wait_until
from resume import assert_resume_yields_the_rest
from serving import RECORD_FLOATS, serve

pytestmark = pytest.mark.slow(seconds=4)

BUCKET = "data"
RAW = batchd.Array((RECORD_FLOATS,), "float32", raw=True)
IMAGE = batchd.Image(size=24)
N_RECORDS = 203


def _cli(url: str, env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    done = subprocess.run(
        [sys.executable, "-m", "batchd_server.cli", *args],
        env={**os.environ, **env, "BATCHD_DATABASE_URL": url},
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert done.returncode == 0, done.stderr
    return done


@pytest.fixture(scope="module", params=["gs", "az"])
def cloud(request: pytest.FixtureRequest) -> Iterator[CloudServer]:
    """One emulator per store for the module, pointed at by this process's environment
    (the server's workers inherit it)."""
    server = make_server(request.param)
    try:
        server.start()
        server.create_bucket(BUCKET)
        with environment(server.env()):
            yield server
    finally:
        server.close()


@pytest.fixture(scope="module")
def catalog(cloud: CloudServer, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """Each dataset twice: ``<name>`` from local files and ``cloud<name>`` from the same
    files in the store, ingested with the command line."""
    tmp = tmp_path_factory.mktemp(f"cloud-{cloud.scheme}")
    url = f"sqlite:///{tmp / 'catalog.db'}"
    engine: Engine = make_engine(url)
    migrate.upgrade(engine)
    root = f"{cloud.scheme}://{BUCKET}"
    env = cloud.env()
    records_parquet(tmp / "parquet")
    columns = {"payload": "record", "split": "train", "label": "label", "key": "key"}
    ingest_parquet(engine, dataset="parquet", root=tmp / "parquet", files=["*.parquet"], **columns)
    cloud.upload_tree(tmp / "parquet", BUCKET, "parquet")
    done = _cli(
        url, env, "ingest", "parquet", "--dataset", "cloudparquet", "--root", f"{root}/parquet",
        "--payload", "record", "--split", "train", "--label", "label", "--key", "key",
        "records-*.parquet",
    )  # fmt: skip
    assert f"{N_RECORDS} inserted" in done.stdout, done.stdout
    _write_shards(tmp / "tars")
    ingest_tar(engine, dataset="tars", root=tmp / "tars", shards=["images-train-{0..1}.tar"])
    cloud.upload_tree(tmp / "tars", BUCKET, "tars")
    _cli(url, env, "ingest", "tar", "--dataset", "cloudtars", "--root", f"{root}/tars/",
         "images-train-{0..1}.tar")  # fmt: skip
    write_demo_images(tmp / "images", 12, seed=3)
    ingest_imagefolder(engine, dataset="images", root=tmp / "images")
    cloud.upload_tree(tmp / "images", BUCKET, "images")
    _cli(url, env, "ingest", "imagefolder", "--dataset", "cloudimages", "--root",
         f"{root}/images")  # fmt: skip
    engine.dispose()
    yield url


@pytest.fixture(scope="module")
def server(catalog: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningServer]:
    with serve(catalog, tmp_path_factory.mktemp("server")) as srv:
        yield srv


def _epochs(
    server: RunningServer, dataset: str, pipeline: Any, epochs: list[int], between: Any = None
) -> list[list[dict[str, np.ndarray]]]:
    """Each of ``epochs`` of one shuffled session; ``between()`` runs after the first."""
    got = []
    with batchd.Loader(
        server.address, dataset=dataset, batch_size=8, pipeline=pipeline, seed=11,
        device="cpu", on_error="raise",
    ) as loader:  # fmt: skip
        for i, epoch in enumerate(epochs):
            if i == 1 and between is not None:
                between()
            loader.set_epoch(epoch)
            batches = []
            for batch in loader:
                assert loader.last_failed_sample_ids == ()
                batches.append({k: np.asarray(v) for k, v in batch.items()})
            got.append(batches)
    return got


def _same_but_ids(a: list[dict[str, np.ndarray]], b: list[dict[str, np.ndarray]]) -> None:
    """The same batches, sample for sample, but for the sample ids (two datasets)."""
    assert len(a) == len(b)
    for x, y in zip(a, b, strict=True):
        assert x.keys() == y.keys()
        for name in x:
            if name != "sample_id":
                assert np.array_equal(x[name], y[name]), name


def _ids(batches: list[dict[str, np.ndarray]]) -> list[int]:
    return [i for b in batches for i in b["sample_id"].tolist()]


@pytest.mark.parametrize(
    ("dataset", "pipeline"), [("parquet", RAW), ("tars", IMAGE), ("images", IMAGE)]
)
def test_a_dataset_under_a_cloud_root_loads_each_sample_once_as_its_local_files_do(
    server: RunningServer, dataset: str, pipeline: Any
) -> None:
    """Parquet, tar and image-folder datasets ingested from gs:// or az:// serve every sample
    exactly once, with the very bytes (labels, pixels, records) of the same files read
    locally, in two epochs of a session."""
    (local,) = _epochs(server, dataset, pipeline, [1])
    remote = _epochs(server, f"cloud{dataset}", pipeline, [1, 2])
    count = len(_ids(local))
    assert count > 0
    for epoch in remote:
        ids = _ids(epoch)
        assert len(ids) == len(set(ids)) == count, "each sample exactly once"
    _same_but_ids(local, remote[0])


@pytest.mark.parametrize("dataset", ["cloudparquet", "cloudtars"])
def test_resume_holds_on_a_cloud_dataset(server: RunningServer, dataset: str) -> None:
    """A mid-epoch state_dict resumes a gs:// or az:// dataset at exactly the next batch."""
    pipeline = RAW if dataset == "cloudparquet" else IMAGE

    def make() -> batchd.Loader:
        return batchd.Loader(
            server.address, dataset=dataset, batch_size=4, pipeline=pipeline, seed=5,
            device="cpu",
        )  # fmt: skip

    assert_resume_yields_the_rest(make, epochs=2, stop_after=2)


def test_a_mix_of_a_local_and_a_cloud_dataset_serves_each_sample_once(
    server: RunningServer,
) -> None:
    """One session mixes the local Parquet dataset and the same files under a cloud root:
    every sample of both once, each row's record the one its sample id names."""
    with batchd.Loader(
        server.address, sources=batchd.Mix({"parquet": 0.5, "cloudparquet": 0.5}),
        batch_size=10, pipeline=RAW, device="cpu",
    ) as loader:  # fmt: skip
        rows = [
            (source, label, record[0])
            for b in loader
            for source, label, record in zip(
                b["source"].tolist(), b["label"].tolist(), b["array"], strict=True
            )
        ]
    assert Counter(s for s, _, _ in rows) == {0: N_RECORDS, 1: N_RECORDS}
    for source in (0, 1):
        firsts = sorted(float(r) for s, _, r in rows if s == source)
        assert firsts == [i * 1000.0 for i in range(N_RECORDS)]


def test_the_store_restarted_mid_epoch_loses_nothing(
    cloud: CloudServer, catalog: str, tmp_path: Path
) -> None:
    """The emulator stops after two batches and starts again on the same port and data while
    batches wait on it: the epoch completes, every sample exactly once, none reported bad."""
    with (
        serve(catalog, tmp_path, object_store_retry_s=120, task_timeout_s=300) as srv,
        batchd.Loader(
            srv.address, dataset="cloudparquet", batch_size=4, pipeline=RAW, seed=2,
            device="cpu",
        ) as loader,
    ):  # fmt: skip
        it = iter(loader)
        ids = [i for _ in range(2) for i in next(it)["sample_id"].tolist()]
        cloud.stop()
        rest: list[int] = []
        failed: list[BaseException] = []

        def consume() -> None:
            try:
                for batch in it:
                    assert loader.last_failed_sample_ids == ()
                    rest.extend(batch["sample_id"].tolist())
            except BaseException as e:
                failed.append(e)

        consumer = threading.Thread(target=consume, name="consumer")
        consumer.start()
        try:
            wait_until(lambda: srv.pool.outstanding() > 0, "a batch to wait on the store", 30)
            cloud.start()
        finally:
            consumer.join(240)
        assert not consumer.is_alive(), "the epoch did not finish after the store came back"
        assert not failed, failed
    counts = Counter(ids + rest)
    assert len(counts) == N_RECORDS and set(counts.values()) == {1}


@pytest.mark.parametrize(("dataset", "pipeline"), [("tars", IMAGE)])
def test_with_the_store_stopped_an_epoch_whose_bytes_are_cached_completes_identically(
    cloud: CloudServer, catalog: str, tmp_path: Path, dataset: str, pipeline: Any
) -> None:
    """Epoch 1 through the store fills the node cache; the emulator is then stopped, and
    epoch 2 of the same session completes from the cache, equal batch for batch to the same
    files read locally."""
    label = f"cloud{dataset}"
    try:
        with serve(
            catalog, tmp_path, cache_dir=tmp_path / "cache", cache_size_bytes=64 << 20,
            object_store_retry_s=1.0,
        ) as srv:  # fmt: skip
            local = _epochs(srv, dataset, pipeline, [1, 2])
            hits = cache_metrics.CACHE_HITS.labels(dataset=label)._value.get()
            remote = _epochs(srv, label, pipeline, [1, 2], between=cloud.stop)
            assert cache_metrics.CACHE_HITS.labels(dataset=label)._value.get() > hits
    finally:
        if getattr(cloud, "process", None) is None:
            cloud.start()
    _same_but_ids(local[0], remote[0])
    _same_but_ids(local[1], remote[1])


def test_ingest_at_debug_and_the_catalog_never_hold_the_stores_secret(
    cloud: CloudServer, catalog: str
) -> None:
    """An ingest from the store logged at DEBUG, and the catalog file afterwards, hold
    neither the account key (Azurite's is random per run) nor the connection string; the
    catalog holds the root URL. (The endpoint may be logged: the log is the operator's.)"""
    done = _cli(
        catalog, cloud.env(), "--log-level", "DEBUG", "ingest", "imagefolder", "--dataset",
        "secretcheck", "--root", f"{cloud.scheme}://{BUCKET}/images",
    )  # fmt: skip
    text = done.stdout + done.stderr
    data = Path(catalog.removeprefix("sqlite:///")).read_bytes()
    assert f"{cloud.scheme}://{BUCKET}/images".encode() in data
    if cloud.secret:  # fake-gcs-server takes unsigned requests: its env holds no secret
        for value in (cloud.secret, *cloud.env().values()):
            assert value not in text and value.encode() not in data
