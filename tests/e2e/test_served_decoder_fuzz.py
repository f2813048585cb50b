"""Decoder fuzz through a real server: mutated JPEG, PNG, .npy and token files ingested as
datasets and served to real Loaders. Every epoch completes, each sample once, valid or
skipped; every skipped file is a sample error in the catalog naming it; no worker died or
hung. (The larger run, in worker processes without a server, is
``tests/server/workers/test_worker_decoder_fuzz.py``.)"""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import sqlalchemy as sa
from sqlalchemy.engine import Engine

import batchd
from batchd_server.catalog.ingest import ingest_manifest
from batchd_server.catalog.schema import sample_errors, samples

from fuzzing import FORMATS, manifest, write_fuzzed
from serving import serve

# The embedded catalog only: decoding does not depend on the catalog's backend.
pytestmark = pytest.mark.backend("sqlite")

SEED = 7
PER_FORMAT = 24
SPECS = {
    "jpeg": batchd.Image(16, resize=20),
    "png": batchd.Image(16, random_crop=True, flip=True),
    "npy": batchd.Array((8,), "float32"),
    "tokens": batchd.Tokens(max_len=16),
}


def test_mutated_files_served_by_a_real_server_are_skipped_and_named(
    engine: Engine, tmp_path: Path
) -> None:
    for i, fmt in enumerate(FORMATS):
        fuzzed = write_fuzzed(fmt, tmp_path / fmt, PER_FORMAT, SEED + i)
        rows = manifest(fuzzed, tmp_path / f"{fmt}.jsonl")
        ingest_manifest(engine, dataset=fmt, root=fuzzed.root, manifest=rows)
    with engine.connect() as conn:
        paths = {r.id: r.path for r in conn.execute(sa.select(samples.c.id, samples.c.path))}
    url = engine.url.render_as_string(hide_password=False)
    skipped: set[int] = set()
    with serve(url, tmp_path, workers=2) as srv:
        for fmt in FORMATS:
            served: list[int] = []
            failed: list[int] = []
            with batchd.Loader(
                srv.address,
                dataset=fmt,
                batch_size=8,
                on_error="skip",
                max_error_fraction=1.0,
                pipeline=SPECS[fmt],
            ) as loader:
                for batch in loader:
                    served += batch["sample_id"].tolist()
                    failed += loader.last_failed_sample_ids
            mine = sorted(i for i, p in paths.items() if p.startswith(f"{fmt}-"))
            assert sorted(served + failed) == mine, f"{fmt}: samples lost or repeated"
            valid = {i for i in mine if int(paths[i][-9:-4]) % 4 == 0}
            assert not valid & set(failed), f"{fmt}: a valid file was skipped"
            assert failed, f"{fmt}: no mutant failed; the fuzzing is not fuzzing"
            skipped |= set(failed)
        assert srv.pool.restarts == 0, "a worker died or hung on a mutated file"
        recorded = _wait_for_errors(engine, len(skipped))
    assert set(recorded) == skipped
    for sample_id, message in recorded.items():
        assert paths[sample_id] in message, message


def _wait_for_errors(engine: Engine, count: int) -> dict[int, str]:
    """The catalog's sample errors (id -> message), once ``count`` of them are written."""
    deadline = time.monotonic() + 60
    while True:
        with engine.connect() as conn:
            rows = conn.execute(sa.select(sample_errors.c.sample_id, sample_errors.c.message))
            recorded = {sample_id: message for sample_id, message in rows}
        if len(recorded) >= count or time.monotonic() > deadline:
            return recorded
        time.sleep(0.1)
