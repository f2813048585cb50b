"""One session mixing a local dataset with the same Parquet files under ``s3://``, ``gs://``
and ``az://`` roots, each store its emulator on loopback (SeaweedFS, fake-gcs-server,
Azurite): the workers read from the three stores at once, each with its own credentials
from the one environment."""

from __future__ import annotations

import contextlib
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from cloudservers import environment, make_server
from parquet_data import records_parquet
from s3server import bucket_in_env
from sqlalchemy.engine import Engine

import batchd
from batchd_server.catalog.ingest import ingest_parquet

from serving import RECORD_FLOATS, serve

pytestmark = pytest.mark.slow(seconds=15)

BUCKET = "mixed"
N_RECORDS = 203
SOURCES = ("local", "s3", "gs", "az")


@contextlib.contextmanager
def _stores() -> Iterator[dict[str, object]]:
    """A SeaweedFS with ``BUCKET`` (its keys in the environment), a fake-gcs-server and an
    Azurite, each with ``BUCKET`` and each pointed at by the environment."""
    with contextlib.ExitStack() as stack:
        servers: dict[str, object] = {"s3": stack.enter_context(bucket_in_env(BUCKET))}
        for scheme in ("gs", "az"):
            server = make_server(scheme)
            stack.callback(server.close)
            server.start()
            server.create_bucket(BUCKET)
            stack.enter_context(environment(server.env()))
            servers[scheme] = server
        yield servers


def test_one_session_reads_a_local_an_s3_a_gcs_and_an_azure_dataset_each_sample_once(
    sqlite_engine: Engine, tmp_path: Path
) -> None:
    """Four sources, the same 203 records each: every sample of each once, and each row's
    record the one its source's files hold."""
    records_parquet(tmp_path / "parquet")
    columns = {"payload": "record", "split": "train", "label": "label", "key": "key"}
    with _stores() as servers:
        ingest_parquet(sqlite_engine, dataset="local", root=tmp_path / "parquet",
                       files=["*.parquet"], **columns)  # fmt: skip
        for scheme, server in servers.items():
            server.upload_tree(tmp_path / "parquet", BUCKET, "pq")  # type: ignore[attr-defined]
            ingest_parquet(sqlite_engine, dataset=scheme, root=f"{scheme}://{BUCKET}/pq",
                           files=["*.parquet"], **columns)  # fmt: skip
        url = sqlite_engine.url.render_as_string(hide_password=False)
        with (
            serve(url, tmp_path) as srv,
            batchd.Loader(
                srv.address, sources=batchd.Mix({name: 0.25 for name in SOURCES}),
                batch_size=16, pipeline=batchd.Array((RECORD_FLOATS,), "float32", raw=True),
                device="cpu",
            ) as loader,
        ):  # fmt: skip
            rows = []
            for batch in loader:
                assert loader.last_failed_sample_ids == ()
                for source, sample, record in zip(
                    batch["source"].tolist(), batch["sample_id"].tolist(), batch["array"],
                    strict=True,
                ):  # fmt: skip
                    rows.append((loader.sources[source], sample, np.asarray(record)))
    assert Counter(name for name, _, _ in rows) == dict.fromkeys(SOURCES, N_RECORDS)
    assert len({sample for _, sample, _ in rows}) == len(rows), "each sample exactly once"
    for name in SOURCES:
        firsts = sorted(float(record[0]) for source, _, record in rows if source == name)
        assert firsts == [i * 1000.0 for i in range(N_RECORDS)], name
