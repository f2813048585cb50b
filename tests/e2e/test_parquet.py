"""Parquet datasets end to end: files written with pyarrow, ingested with the public
``batchd-server ingest parquet`` command, served by a real server to ``batchd.Loader``
(Postgres and SQLite), against the same data ingested as local files."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import sqlalchemy as sa
from parquet_data import N_IMAGES, N_RECORDS, png, records_parquet, write_images
from sqlalchemy.engine import Engine

import batchd
from batchd_server.api import RunningServer
from batchd_server.catalog.ingest import ingest_manifest, ingest_parquet
from batchd_server.metrics import REGISTRY

from resume import assert_resume_yields_the_rest
from serving import RECORD_FLOATS, record_dataset, serve

N_TOKENS = 50
BATCH = 8


def cli(*args: str, url: str, home: Path) -> subprocess.CompletedProcess[str]:
    """``batchd-server ARGS`` as a subprocess."""
    env = {**os.environ, "BATCHD_DATABASE_URL": url, "BATCHD_HOME": str(home)}
    return subprocess.run(
        [sys.executable, "-m", "batchd_server.cli", *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )


def _images_by_label(server: RunningServer, dataset: str) -> dict[int, np.ndarray]:
    with batchd.Loader(
        server.address,
        dataset=dataset,
        batch_size=BATCH,
        pipeline=batchd.Image(size=16, resize=20),
        device="cpu",
        shuffle=False,
    ) as loader:
        found: dict[int, np.ndarray] = {}
        for batch in loader:
            assert loader.last_failed_sample_ids == ()
            for label, image in zip(batch["label"].tolist(), batch["image"], strict=True):
                assert label not in found, f"label {label} served twice"
                found[label] = np.asarray(image).copy()
    return found


def test_parquet_images_plain_and_nested_serve_the_pixels_of_the_same_files_read_locally(
    engine: Engine, tmp_path: Path
) -> None:
    """``ingest parquet --payload png`` and ``--payload image.bytes`` (a struct's field) give
    every image once, with its label, pixel for pixel as the image folder of the same files."""
    folder, parquet = write_images(tmp_path)
    url = engine.url.render_as_string(hide_password=False)
    home = tmp_path / "home"
    done = cli(
        "ingest", "imagefolder", "--dataset", "local", "--root", str(folder), url=url, home=home
    )
    assert done.returncode == 0, done.stderr
    for name, payload in (("plain", "png"), ("hf", "image.bytes")):
        done = cli(
            "ingest", "parquet", "--dataset", name, "--root", str(parquet),
            "--split-column", "split", "--payload", payload, "--label", "label",
            "images-*.parquet", url=url, home=home,
        )  # fmt: skip
        assert done.returncode == 0, done.stderr
        assert f"{N_IMAGES} rows read, {N_IMAGES} inserted" in done.stdout
    with serve(url, tmp_path) as server:
        local = _images_by_label(server, "local")
        assert sorted(local) == list(range(N_IMAGES))
        for name in ("plain", "hf"):
            served = _images_by_label(server, name)
            assert sorted(served) == list(range(N_IMAGES))
            for label, pixels in served.items():
                assert np.array_equal(pixels, local[label]), (name, label)


def test_ingest_parquet_refuses_a_file_that_is_not_parquet_or_lacks_the_column(
    engine: Engine, tmp_path: Path
) -> None:
    """A clear one-line error, exit 2, and nothing written: for a file that is not Parquet,
    a missing payload column (its columns listed), a struct named without its field, and a
    column of text."""
    _, parquet = write_images(tmp_path)
    (parquet / "notes.parquet").write_bytes(b"this is not parquet at all" * 10)
    url = engine.url.render_as_string(hide_password=False)
    home = tmp_path / "home"

    def ingest(payload: str, *files: str) -> str:
        done = cli(
            "ingest", "parquet", "--dataset", "bad", "--root", str(parquet), "--split", "train",
            "--payload", payload, *files, url=url, home=home,
        )  # fmt: skip
        assert done.returncode == 2, (done.stdout, done.stderr)
        return done.stderr

    assert "notes.parquet is not a Parquet file" in ingest("png", "notes.parquet")
    missing = ingest("jpeg", "images-0.parquet")
    assert "has no column 'jpeg' for --payload" in missing and "png: binary" in missing
    assert "pass --payload image.bytes" in ingest("image", "images-0.parquet")
    assert "Ingest it with --text split" in ingest("split", "images-0.parquet")
    with engine.connect() as conn:
        assert conn.scalar(sa.text("SELECT count(*) FROM samples")) == 0


def test_undecodable_and_null_payloads_are_bad_samples_the_rest_are_served(
    engine: Engine, tmp_path: Path
) -> None:
    """A row whose bytes are not an image and a row whose payload is null are reported as
    failed samples (and recorded in the catalog); every other row is served."""
    root = tmp_path / "pq"
    root.mkdir()
    payloads: list[bytes | None] = [png(i) for i in range(12)]
    payloads[3] = b"not an image"
    payloads[8] = None
    table = pa.table({"png": pa.array(payloads, pa.binary()), "label": pa.array(range(12))})
    pq.write_table(table, root / "part.parquet", row_group_size=5)
    ingest_parquet(
        engine, dataset="flaky", root=root, files=["part.parquet"], payload="png",
        split="train", label="label",
    )  # fmt: skip
    url = engine.url.render_as_string(hide_password=False)
    with serve(url, tmp_path) as server, batchd.Loader(
        server.address, dataset="flaky", batch_size=4, pipeline=batchd.Image(size=8),
        device="cpu", shuffle=False, max_error_fraction=0.5,
    ) as loader:  # fmt: skip
        labels, failed = [], []
        for batch in loader:
            labels += batch["label"].tolist()
            failed += loader.last_failed_sample_ids
    assert sorted(labels) == [i for i in range(12) if i not in (3, 8)]
    with engine.connect() as conn:
        keys = dict(conn.execute(sa.text("SELECT id, key FROM samples")).all())
        kinds = dict(conn.execute(sa.text("SELECT sample_id, kind FROM sample_errors")).all())
    assert sorted(keys[i] for i in failed) == ["part.parquet#3", "part.parquet#8"]
    by_key = {keys[i]: kind for i, kind in kinds.items()}
    assert by_key == {"part.parquet#3": "corrupt", "part.parquet#8": "missing"}


# --------------------------------------------------------------------------- records


@pytest.fixture
def records(engine: Engine, tmp_path: Path) -> Iterator[RunningServer]:
    """A server on "pq-records" (Parquet) and "records" (the same records in a shard file)."""
    records_parquet(tmp_path / "pq-records")
    ingest_parquet(
        engine, dataset="pq-records", root=tmp_path / "pq-records", files=["*.parquet"],
        payload="record", split="train", label="label", key="key",
    )  # fmt: skip
    record_dataset(engine, tmp_path / "records", n=N_RECORDS)
    with serve(engine.url.render_as_string(hide_password=False), tmp_path) as server:
        yield server


def _loader(server: RunningServer, dataset: str = "pq-records", **kw: Any) -> batchd.Loader:
    """A Loader of ``dataset``'s arrays: the Parquet records are given to the array pipeline
    as raw numbers whether or not it says ``raw``; the shard's records are raw."""
    kw.setdefault("batch_size", BATCH)
    kw.setdefault("seed", 3)
    return batchd.Loader(
        server.address,
        dataset=dataset,
        pipeline=batchd.Array((RECORD_FLOATS,), "float32", raw=dataset == "records"),
        device="cpu",
        **kw,
    )


def _by_key(engine: Engine) -> dict[int, str]:
    with engine.connect() as conn:
        return dict(conn.execute(sa.text("SELECT id, key FROM samples")).all())


def test_parquet_records_equal_the_same_records_in_a_local_shard_each_once(
    records: RunningServer, engine: Engine
) -> None:
    """A shuffled epoch of the Parquet dataset serves each record once, with its label and
    values, exactly as the local dataset of the same records does."""
    keys = _by_key(engine)
    served: dict[str, tuple[int, list[float]]] = {}
    for dataset in ("pq-records", "records"):
        with _loader(records, dataset, shuffle=True) as loader:
            got = {}
            for batch in loader:
                assert loader.last_failed_sample_ids == ()
                for sid, label, array in zip(
                    batch["sample_id"].tolist(),
                    batch["label"].tolist(),
                    batch["array"].tolist(),
                    strict=True,
                ):
                    assert keys[sid] not in got
                    got[keys[sid]] = (label, array)
        if served:
            assert got == served
        served = got
    assert len(served) == N_RECORDS
    assert served["r000123"][0] == 3 and served["r000123"][1][:2] == [123000.0, 123001.0]


def test_resume_from_a_state_dict_yields_the_rest_of_a_parquet_run(records: RunningServer) -> None:
    """The resume contract (``tests/resume.py``) holds on a Parquet dataset, across epochs."""
    assert_resume_yields_the_rest(lambda: _loader(records, shuffle=True), epochs=2, stop_after=31)


def test_a_state_saved_at_4_ranks_resumes_at_3_each_parquet_sample_once(
    records: RunningServer, engine: Engine
) -> None:
    """Elastic resume: 4 ranks stop after 3 batches, 3 ranks finish the epoch; together they
    serve every Parquet sample, none twice beyond the padding."""
    before: list[int] = []
    state: dict[str, Any] = {}
    for rank in range(4):
        with _loader(records, rank=rank, world_size=4) as loader:
            it = iter(loader)
            for _ in range(3):
                before += next(it)["sample_id"].tolist()
            if rank == 0:
                state = loader.state_dict()
    after: list[int] = []
    for rank in range(3):
        with _loader(records, rank=rank, world_size=3) as loader:
            loader.load_state_dict(state)
            after += [i for b in loader for i in b["sample_id"].tolist()]
    with engine.connect() as conn:
        parquet_ids = set(
            conn.scalars(
                sa.text(
                    "SELECT s.id FROM samples s JOIN datasets d ON d.id = s.dataset_id "
                    "WHERE d.name = 'pq-records'"
                )
            )
        )
    assert set(before + after) == parquet_ids
    assert len(before) + len(after) - N_RECORDS < 3, "padding past world_size - 1"


def test_a_mix_of_a_parquet_and_a_local_dataset_serves_each_sample_once(
    records: RunningServer, engine: Engine
) -> None:
    """A 1:1 mix of the Parquet records and the local ones: every batch half from each, and
    each sample of the epoch once."""
    mix = batchd.Mix({"pq-records": 1, "records": 1})
    with batchd.Loader(
        records.address, sources=mix, batch_size=BATCH, seed=5, device="cpu",
        pipeline=batchd.Array((RECORD_FLOATS,), "float32", raw=True),
    ) as loader:  # fmt: skip
        served, sources = [], []
        for batch in loader:
            assert loader.last_failed_sample_ids == ()
            served += batch["sample_id"].tolist()
            sources += batch["source"].tolist()
            first = batch["array"][:, 0].tolist()
            labels = batch["label"].tolist()
            assert all(int(v // 1000) % 10 == lab for v, lab in zip(first, labels, strict=True))
    assert len(served) == len(set(served)) == 2 * N_RECORDS
    assert Counter(sources) == {0: N_RECORDS, 1: N_RECORDS}


# --------------------------------------------------------------------------- tokens


def test_token_lists_are_served_as_the_same_sequences_as_token_files(
    engine: Engine, tmp_path: Path
) -> None:
    """A list<int32> payload serves each row's tokens; the catalog's length is the list's
    length (the length column absent), which bucketing by length uses."""
    root = tmp_path / "tokens"
    root.mkdir()
    seqs = [(i * 100 + np.arange(i % 13 + 1)).astype("<i4") for i in range(N_TOKENS)]
    table = pa.table(
        {
            "ids": pa.array([s.tolist() for s in seqs], pa.list_(pa.int32())),
            "n": pa.array(range(N_TOKENS), pa.int64()),
        }
    )
    pq.write_table(table, root / "tokens.parquet", row_group_size=9)
    for i, s in enumerate(seqs):
        (root / f"t{i:04d}.bin").write_bytes(s.tobytes())
    manifest = tmp_path / "tokens.jsonl"
    manifest.write_text(
        "".join(
            json.dumps({"path": f"t{i:04d}.bin", "split": "train", "label": i, "length": len(s)})
            + "\n"
            for i, s in enumerate(seqs)
        )
    )
    ingest_manifest(engine, dataset="files", root=root, manifest=manifest)
    ingest_parquet(
        engine, dataset="lists", root=root, files=["tokens.parquet"], payload="ids",
        split="train", label="n",
    )  # fmt: skip
    with engine.connect() as conn:
        lengths = conn.execute(
            sa.text(
                "SELECT s.key, s.length FROM samples s JOIN datasets d ON d.id = s.dataset_id "
                "WHERE d.name = 'lists'"
            )
        ).all()
    assert {k: n for k, n in lengths} == {f"tokens.parquet#{i}": len(s) for i, s in enumerate(seqs)}
    with serve(engine.url.render_as_string(hide_password=False), tmp_path) as server:
        served = {}
        for dataset in ("lists", "files"):
            with batchd.Loader(
                server.address, dataset=dataset, batch_size=BATCH, device="cpu",
                pipeline=batchd.Tokens(max_len=16), sampling="bucketed", seed=1,
            ) as loader:  # fmt: skip
                got = {}
                for batch in loader:
                    for label, ids, n in zip(
                        batch["label"].tolist(),
                        batch["input_ids"].tolist(),
                        batch["length"].tolist(),
                        strict=True,
                    ):
                        got[label] = ids[:n]
            served[dataset] = got
        assert served["lists"] == served["files"] == {i: s.tolist() for i, s in enumerate(seqs)}
        packed = {}
        for dataset in ("lists", "files"):
            with batchd.Loader(
                server.address, dataset=dataset, batch_size=4, device="cpu", seed=2,
                pipeline=batchd.Tokens(max_len=64), pack=batchd.Pack(seq_len=10),
            ) as loader:  # fmt: skip
                packed[dataset] = []
                for batch in loader:
                    assert loader.last_failed_sample_ids == ()
                    packed[dataset].append(
                        {k: np.asarray(batch[k]).copy() for k in ("input_ids", "position_ids")}
                    )
        # Packing cuts the Parquet lists into the same pieces as the token files.
        assert len(packed["lists"]) == len(packed["files"]) > 0
        for a, b in zip(packed["lists"], packed["files"], strict=True):
            for key in a:
                assert np.array_equal(a[key], b[key]), key


# --------------------------------------------------------------------------- decode cache


def test_the_decode_cache_serves_parquet_rows_each_its_own_and_hits_in_epoch_two(
    sqlite_engine: Engine, tmp_path: Path
) -> None:
    """With the decode cache on, each Parquet image row is cached under its own key (rows of
    one row group share a byte range): the second epoch hits every image, and serves what the
    uncached path serves. Array rows take the batch path, which is not cached (as records in
    a shard), and are served the same way."""
    _, parquet = write_images(tmp_path)
    ingest_parquet(
        sqlite_engine, dataset="hf", root=parquet, files=["images-*.parquet"],
        payload="image.bytes", split_column="split", label="label",
    )  # fmt: skip
    records_parquet(tmp_path / "pq-records")
    ingest_parquet(
        sqlite_engine, dataset="pq-records", root=tmp_path / "pq-records", files=["*.parquet"],
        payload="record", split="train", label="label", key="key",
    )  # fmt: skip

    def hits(dataset: str) -> float:
        labels = {"dataset": dataset, "result": "hit"}
        return REGISTRY.get_sample_value("batchd_decode_cache_lookups_total", labels) or 0.0

    pipelines = {
        "hf": batchd.Image(size=16, resize=20),
        "pq-records": batchd.Array((RECORD_FLOATS,), "float32"),
    }
    url = sqlite_engine.url.render_as_string(hide_password=False)
    with serve(url, tmp_path, decode_cache_bytes=64 << 20) as server:
        for dataset, pipeline in pipelines.items():
            served = []
            for cache in (False, True, True):
                with batchd.Loader(
                    server.address, dataset=dataset, batch_size=BATCH, pipeline=pipeline,
                    device="cpu", shuffle=False, decode_cache=cache,
                ) as loader:  # fmt: skip
                    before = hits(dataset)
                    served.append([{k: v.numpy().copy() for k, v in b.items()} for b in loader])
                    assert loader.last_failed_sample_ids == ()
            assert hits(dataset) - before == (N_IMAGES if dataset == "hf" else 0)
            for batches in served[1:]:
                for got, want in zip(batches, served[0], strict=True):
                    for key in want:
                        np.testing.assert_array_equal(got[key], want[key], err_msg=dataset)
