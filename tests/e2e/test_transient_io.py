"""Transient I/O errors are retried in the worker, not blamed on the sample; one that
outlasts the retries is a sample error of kind ``transient`` that says so. The errors come
from the server's test-only hook (``BATCHD_TESTING_READ_ERRORS``, read by real worker
processes), on real reads of real files, through a real server."""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np
import pytest
import sqlalchemy as sa
from sqlalchemy.engine import Engine

import batchd
from batchd_server.catalog.schema import sample_errors, samples
from batchd_server.pipelines import transient

from serving import RECORD_FLOATS, record_dataset, serve, token_dataset

# The embedded catalog only: how a worker reads does not depend on the catalog.
pytestmark = pytest.mark.backend("sqlite")


def _ids_by_path(engine: Engine) -> dict[str, int]:
    with engine.connect() as conn:
        return {row.path: row.id for row in conn.execute(sa.select(samples.c.path, samples.c.id))}


def test_transient_read_errors_are_retried_and_a_persistent_one_is_reported_as_transient(
    engine: Engine, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """EIO twice and EMFILE three times on two token files, EIO twice on the records' shard:
    every sample arrives, intact. ESTALE on every read of a third file: that sample alone is
    skipped, its error (in the batch and in the catalog) says the error is usually
    transient and the file may be fine."""
    seqs = token_dataset(engine, tmp_path / "tokens", n=30)
    records = record_dataset(engine, tmp_path / "records", n=64)
    ids = _ids_by_path(engine)
    faults = "EIO:2:t0003.bin,EMFILE:3:t0011.bin,ESTALE:-1:t0007.bin,EIO:2:shard-000.bin"
    assert transient.TRIES > 3, "the recovering faults must fail fewer times than the tries"
    monkeypatch.setenv(transient.FAULTS_ENV, faults)  # before the workers are spawned
    url = engine.url.render_as_string(hide_password=False)
    with serve(url, tmp_path, workers=1) as srv:
        served: dict[int, np.ndarray] = {}
        failed: list[int] = []
        with batchd.Loader(
            srv.address,
            dataset="tokens",
            batch_size=8,
            shuffle=False,
            max_error_fraction=0.1,
            pipeline=batchd.Tokens(max_len=16),
        ) as loader:
            for batch in loader:
                failed += loader.last_failed_sample_ids
                for row, sample_id in enumerate(batch["sample_id"].tolist()):
                    length = int(batch["length"][row])
                    served[sample_id] = batch["input_ids"][row, :length].numpy()
        stale = ids["t0007.bin"]
        assert failed == [stale]
        assert sorted(served) == sorted(
            i for p, i in ids.items() if p.startswith("t") and i != stale
        )
        for k, seq in enumerate(seqs):
            if k != 7:
                np.testing.assert_array_equal(served[ids[f"t{k:04d}.bin"]], seq)

        with batchd.Loader(
            srv.address,
            dataset="records",
            batch_size=16,
            shuffle=False,
            pipeline=batchd.Array((RECORD_FLOATS,), "float32", raw=True),
        ) as loader:
            parts, failed = [], []
            for batch in loader:
                parts.append(batch["array"].numpy())
                failed += loader.last_failed_sample_ids
        assert failed == []
        rows = np.concatenate(parts)
        np.testing.assert_array_equal(rows, records)

        deadline = time.monotonic() + 30
        while True:
            with engine.connect() as conn:
                recorded = conn.execute(
                    sa.select(
                        sample_errors.c.sample_id, sample_errors.c.kind, sample_errors.c.message
                    )
                ).all()
            if recorded or time.monotonic() > deadline:
                break
            time.sleep(0.1)
    ((sample_id, kind, message),) = recorded
    assert (sample_id, kind) == (stale, "transient")
    for needed in ("t0007.bin", "ESTALE", "usually transient", f"{transient.TRIES} tries"):
        assert needed in message, message
