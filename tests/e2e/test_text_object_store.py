"""Text under ``s3://`` roots, end to end: JSONL and Parquet text uploaded to a real
S3-compatible store (SeaweedFS, ``tests/s3server.py``), ingested with the command line as a
user runs it (``batchd-server ingest jsonl|parquet --text ... --tokenizer ...``), served
through ``batchd.Text`` + ``batchd.Pack`` by a real server whose workers read the documents'
byte ranges from the store: every document's tokens once, equal to the tokenizer's encoding
with BOS and EOS; the catalog's rows are those of the same files ingested locally."""

from __future__ import annotations

import os
import subprocess
import sys
from collections import Counter
from collections.abc import Iterator
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import sqlalchemy as sa
from s3server import bucket_in_env
from sqlalchemy.engine import Engine
from tokenizers import Tokenizer

import batchd
from batchd_server.api import RunningServer
from batchd_server.catalog import migrate
from batchd_server.catalog.db import make_engine
from batchd_server.catalog.ingest import ingest_jsonl

from serving import serve
from text_data import documents, train_tokenizer, write_jsonl

pytestmark = pytest.mark.slow(seconds=90)

BUCKET = "texts"
SEQ_LEN = 96


def batchd_server(*args: str, url: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "batchd_server.cli", *args],
        env={**os.environ, **env, "BATCHD_DATABASE_URL": url},
        capture_output=True,
        text=True,
        timeout=180,
    )


@pytest.fixture(scope="module")
def catalog(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    tmp = tmp_path_factory.mktemp("text-object-store")
    tokenizer = tmp / "tok" / "tokenizer.json"
    train_tokenizer(tokenizer)
    docs = documents(70, seed=11)
    data = tmp / "data"
    write_jsonl(data / "a-0.jsonl", [{"text": t} for t in docs[:40]])
    write_jsonl(data / "a-1.jsonl", [{"text": t} for t in docs[40:]])
    pq.write_table(pa.table({"body": docs}), data / "docs.parquet", row_group_size=16)
    url = f"sqlite:///{tmp / 'catalog.db'}"
    engine = make_engine(url)
    migrate.upgrade(engine)
    with bucket_in_env(BUCKET) as s3:
        s3.upload_tree(data, BUCKET, "data")
        env = s3.env()
        common = ["--split", "train", "--tokenizer", str(tokenizer), "--workers", "2"]
        for args in (
            ["jsonl", "--dataset", "s3jsonl", "--root", f"s3://{BUCKET}/data", "--text", "text",
             *common, "a-{0..1}.jsonl"],
            ["parquet", "--dataset", "s3parquet", "--root", f"s3://{BUCKET}/data", "--text",
             "body", *common, "*.parquet"],
        ):  # fmt: skip
            done = batchd_server("ingest", *args, url=url, env=env)
            assert done.returncode == 0, done.stderr
            assert "70 inserted" in done.stdout
        ingest_jsonl(
            engine,
            dataset="local",
            root=data,
            files=["a-*.jsonl"],
            split="train",
            text="text",
            tokenizer=str(tokenizer),
        )
        try:
            yield {"engine": engine, "docs": docs, "tokenizer": str(tokenizer), "s3": s3}
        finally:
            engine.dispose()


@pytest.fixture(scope="module")
def server(
    catalog: dict[str, Any], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[RunningServer]:
    url = catalog["engine"].url.render_as_string(hide_password=False)
    with serve(url, tmp_path_factory.mktemp("server")) as srv:
        yield srv


def _rows(engine: Engine, dataset: str) -> list[tuple[Any, ...]]:
    query = sa.text(
        "SELECT s.key, s.byte_offset, s.byte_length, s.length FROM samples s JOIN datasets d "
        "ON d.id = s.dataset_id WHERE d.name = :name ORDER BY s.id"
    )
    with engine.connect() as conn:
        return [tuple(r) for r in conn.execute(query, {"name": dataset})]


def test_the_stores_jsonl_catalogs_what_the_local_files_do(catalog: dict[str, Any]) -> None:
    assert _rows(catalog["engine"], "s3jsonl") == _rows(catalog["engine"], "local")


@pytest.mark.parametrize("dataset", ["s3jsonl", "s3parquet"])
def test_text_in_the_store_serves_every_documents_tokens_once(
    server: RunningServer, catalog: dict[str, Any], dataset: str
) -> None:
    tokenizer = Tokenizer.from_file(catalog["tokenizer"])
    # Sample ids in key order are the documents in file order (a-0 then a-1; row order).
    ids = [r[0] for r in _keyed_ids(catalog["engine"], dataset)]
    expected = {
        d: [1, *tokenizer.encode(t).ids, 2] for d, t in zip(ids, catalog["docs"], strict=True)
    }
    seen: Counter[tuple[int, int]] = Counter()
    with batchd.Loader(
        server.address,
        dataset=dataset,
        batch_size=3,
        pipeline=batchd.Text(tokenizer=catalog["tokenizer"]),
        pack=batchd.Pack(seq_len=SEQ_LEN),
        device="cpu",
    ) as loader:
        for batch in loader:
            assert loader.last_failed_sample_ids == ()
            tokens, doc, pos = (
                np.asarray(batch[k]) for k in ("input_ids", "document_id", "position_ids")
            )
            for r, t in zip(*np.nonzero(doc >= 0), strict=True):
                d, p = int(doc[r, t]), int(pos[r, t])
                assert int(tokens[r, t]) == expected[d][p]
                seen[(d, p)] += 1
    assert set(seen) == {(d, p) for d, e in expected.items() for p in range(len(e))}
    assert max(seen.values()) == 1


def _keyed_ids(engine: Engine, dataset: str) -> list[tuple[int, str]]:
    query = sa.text(
        "SELECT s.id, s.key FROM samples s JOIN datasets d ON d.id = s.dataset_id "
        "WHERE d.name = :name"
    )
    with engine.connect() as conn:
        rows = [(int(r[0]), str(r[1])) for r in conn.execute(query, {"name": dataset})]

    def order(row: tuple[int, str]) -> tuple[str, int]:
        path, number = row[1].rsplit("#", 1)
        return path, int(number)

    return sorted(rows, key=order)
