"""An s3:// dataset when its store goes away: stopped mid-epoch and started again within the
retry window (nothing lost), down at session open (a clear error), and the server's log and
catalog never holding the store's secret. Each test runs its own SeaweedFS
(``tests/s3server.py``), since each stops it or needs a server of its own."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import obstore
import pytest
from s3server import ThrowawayS3, bucket_in_env
from sqlalchemy.engine import Engine

import batchd
from batchd import errors
from batchd_server.catalog.ingest import ingest_manifest

from chaos_harness import wait_until
from serving import RECORD_FLOATS, records_loader, serve

pytestmark = pytest.mark.slow(seconds=60)

BUCKET = "data"
N_RECORDS = 203
RAW = batchd.Array((RECORD_FLOATS,), "float32", raw=True)


@pytest.fixture
def s3() -> Iterator[ThrowawayS3]:
    with bucket_in_env(BUCKET) as server:
        yield server


def _records(
    s3: ThrowawayS3, engine: Engine, tmp_path: Path, *, missing: bool = False
) -> np.ndarray:
    """``records`` as ``serving.record_dataset`` makes them, but in the store (and, with
    ``missing``, one more row whose object is not there)."""
    records = np.arange(N_RECORDS, dtype=np.float32)[:, None] * 1000 + np.arange(RECORD_FLOATS)
    obstore.put(s3.store(BUCKET), "records/shard-000.bin", records.astype(np.float32).tobytes())
    size = RECORD_FLOATS * 4
    rows = [
        {"path": "shard-000.bin", "byte_offset": i * size, "byte_length": size, "split": "train"}
        for i in range(N_RECORDS)
    ]
    if missing:
        rows.append({"path": "gone.bin", "byte_offset": 0, "byte_length": size, "split": "train"})
    manifest = tmp_path / "records.jsonl"
    manifest.write_text("".join(json.dumps(r) + "\n" for r in rows))
    ingest_manifest(
        engine, dataset="records", root=f"s3://{BUCKET}/records", manifest=manifest, verify=False
    )
    return records


def test_the_store_stopped_mid_epoch_and_started_again_loses_nothing(
    s3: ThrowawayS3, sqlite_engine: Engine, tmp_path: Path
) -> None:
    """The store is killed after two batches and started again on the same ports and data
    while the workers wait on it: the epoch completes with every sample exactly once and no
    sample reported bad (reads during the outage were retried, not given up)."""
    _records(s3, sqlite_engine, tmp_path)
    url = sqlite_engine.url.render_as_string(hide_password=False)
    # 51 batches of 4, more than the ring holds: most are read after the store stops.
    with (
        serve(url, tmp_path, object_store_retry_s=120, task_timeout_s=300) as srv,
        records_loader(srv, batch_size=4, seed=2, device="cpu") as loader,
    ):
        it = iter(loader)
        ids = [i for _ in range(2) for i in next(it)["sample_id"].tolist()]
        s3.stop()
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
            # The consumer drains the ring and frees its slots; the batches handed out then
            # wait on the stopped store.
            wait_until(lambda: srv.pool.outstanding() > 0, "a batch to wait on the store", 30)
            s3.start()
        finally:
            consumer.join(240)
        assert not consumer.is_alive(), "the epoch did not finish after the store came back"
        assert not failed, failed
    counts = Counter(ids + rest)
    assert len(counts) == N_RECORDS and set(counts.values()) == {1}


def test_a_store_that_is_down_at_session_open_is_a_clear_error_naming_the_url(
    s3: ThrowawayS3, sqlite_engine: Engine, tmp_path: Path
) -> None:
    """Opening a session on an s3:// dataset whose store is down fails at once with
    FailedPrecondition naming the root URL; once the store is back, the same open works."""
    _records(s3, sqlite_engine, tmp_path)
    url = sqlite_engine.url.render_as_string(hide_password=False)
    with serve(url, tmp_path, object_store_retry_s=1) as srv:
        s3.stop()
        with (
            pytest.raises(errors.FailedPrecondition, match=f"cannot reach s3://{BUCKET}/records"),
            records_loader(srv, device="cpu") as loader,
        ):
            list(loader)
        s3.start()
        with records_loader(srv, device="cpu") as loader:
            assert sum(len(b["sample_id"]) for b in loader) == N_RECORDS


def test_the_server_log_and_the_catalog_never_hold_the_stores_secret(
    s3: ThrowawayS3, sqlite_engine: Engine, tmp_path: Path
) -> None:
    """``batchd-server serve`` at DEBUG, serving an s3:// dataset with a missing object and
    refusing a session on a bucket that does not exist: its whole log (workers' included)
    and the catalog file hold neither the secret key nor the access key id."""
    _records(s3, sqlite_engine, tmp_path, missing=True)
    nobucket = tmp_path / "nobucket.jsonl"
    nobucket.write_text('{"path": "x.bin", "split": "train"}\n')
    ingest_manifest(
        sqlite_engine, dataset="nobucket", root="s3://no-such-bucket/x", manifest=nobucket,
        verify=False,
    )  # fmt: skip
    sock = tmp_path / "batchd.sock"
    url = sqlite_engine.url.render_as_string(hide_password=False)
    env = {
        **os.environ,
        **s3.env(),
        "BATCHD_DATABASE_URL": url,
        "BATCHD_LISTEN": f"unix://{sock}",
        "BATCHD_WORKERS": "1",
        "BATCHD_OBJECT_STORE_RETRY_S": "1",
    }
    command = [sys.executable, "-m", "batchd_server.cli", "--log-level", "DEBUG", "serve"]
    proc = subprocess.Popen(command, env=env, stderr=subprocess.PIPE, text=True)
    log: list[str] = []
    try:
        assert proc.stderr is not None
        for line in proc.stderr:
            log.append(line)
            if "ready: serving on" in line:
                break
        options: dict[str, Any] = {"batch_size": 16, "pipeline": RAW, "device": "cpu"}
        with batchd.Loader(
            f"unix://{sock}", dataset="records", on_error="skip", max_error_fraction=1.0,
            **options,
        ) as loader:  # fmt: skip
            assert sum(len(b["sample_id"]) for b in loader) == N_RECORDS
        with (
            pytest.raises(errors.FailedPrecondition, match="s3://no-such-bucket/x"),
            batchd.Loader(f"unix://{sock}", dataset="nobucket", **options) as loader,
        ):
            list(loader)
        proc.send_signal(signal.SIGTERM)
        log += proc.stderr.readlines()
        assert proc.wait(60) == 0
    finally:
        proc.kill()
        proc.wait(30)
    text = "".join(log)
    assert "s3://data/records/gone.bin: no such object" in text, "the log this test greps"
    assert s3.secret_key not in text and s3.access_key not in text
    catalog = Path(url.removeprefix("sqlite:///")).read_bytes()
    assert s3.secret_key.encode() not in catalog and s3.access_key.encode() not in catalog
