"""Samples of several fields, end to end (real server, real workers, the public client): a
WebDataset shard of key -> {.jpg, .txt, .cls} and a Parquet file of (image bytes, caption,
label) each load as dict batches of an image, a tokenized caption and the label. Every
sample comes once per epoch over 2 ranks with its own image and caption; a mid-epoch resume
and a 2 -> 1 rank resume give identical batches; a sample missing its caption is one bad
sample of kind missing_field (skipped, the epoch delivers the rest; or the error under
"raise"), or served with caption.present 0 when the field is optional; the decode cache and
share= serve the same batches."""

from __future__ import annotations

import io
import tarfile
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from PIL import Image
from s3server import bucket_in_env
from sqlalchemy.engine import Engine
from tokenizers import Tokenizer

import batchd
from batchd import errors
from batchd_server.catalog.ingest import ingest_parquet, ingest_tar
from batchd_server.metrics import REGISTRY

from resume import assert_resume_yields_the_rest
from serving import serve
from text_data import train_tokenizer

# The first test runs on both catalogs (the members' ranges are read from the rows' attrs, a
# JSON column of each); the others' behaviour does not depend on the catalog's backend.
pytestmark = [pytest.mark.slow(seconds=90)]
SQLITE = pytest.mark.backend("sqlite")

N = 24
NO_CAPTION = 5
"""The sample whose caption is missing (no .txt member; a null caption in Parquet)."""
SIZE = 16
MAX_LEN = 12
BOS, EOS = 1, 2
BUCKET = "fields"


def _colour(i: int) -> tuple[int, int, int]:
    return (10 * i, 250 - 10 * i, 40 + 5 * i)


def _caption(i: int) -> str:
    return f"a photo of thing {i} with colour {i * 7}"


def _jpeg(i: int) -> bytes:
    out = io.BytesIO()
    Image.new("RGB", (24 + i, 20 + i), _colour(i)).save(out, format="PNG")
    return out.getvalue()


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("tok") / "tokenizer.json"
    train_tokenizer(path)
    return path


@pytest.fixture
def catalog(engine: Engine, tmp_path: Path) -> Engine:
    """Dataset "wds": two shards of key -> .png, .txt, .cls (NO_CAPTION without its .txt);
    dataset "pq": the same as Parquet rows (its caption null)."""
    root = tmp_path / "data"
    root.mkdir()
    for s in range(2):
        with tarfile.open(root / f"pairs-train-{s}.tar", "w") as tar:
            for i in range(s * N // 2, (s + 1) * N // 2):
                members = [("png", _jpeg(i)), ("cls", str(i % 3).encode())]
                if i != NO_CAPTION:
                    members.append(("txt", _caption(i).encode()))
                for ext, data in members:
                    info = tarfile.TarInfo(f"k{i:03d}.{ext}")
                    info.size = len(data)
                    tar.addfile(info, io.BytesIO(data))
    ingest_tar(engine, dataset="wds", root=root, shards=["pairs-train-*.tar"])
    table = pa.table(
        {
            "image": [_jpeg(i) for i in range(N)],
            "caption": [None if i == NO_CAPTION else _caption(i) for i in range(N)],
            "label": [i % 3 for i in range(N)],
            "n": list(range(N)),
        }
    )
    pq.write_table(table, root / "pairs.parquet", row_group_size=7)
    ingest_parquet(
        engine, dataset="pq", root=root, files=["pairs.parquet"], payload="image",
        split="train", label="label", key="n",
    )  # fmt: skip
    return engine


def _pipeline(tokenizer: Path, dataset: str, *, optional: bool = False) -> dict[str, Any]:
    image, caption = ("png", "txt") if dataset.endswith("wds") else ("image", "caption")
    return {
        "image": batchd.Field(image, batchd.Image(size=SIZE)),
        "caption": batchd.Field(
            caption, batchd.Text(str(tokenizer), max_len=MAX_LEN), optional=optional
        ),
    }


def _loader(server: Any, tokenizer: Path, dataset: str, **options: Any) -> batchd.Loader:
    optional = options.pop("optional", False)
    options = {
        "batch_size": 5,
        "seed": 3,
        "shuffle": True,
        "device": "cpu",
        "max_error_fraction": 0.2,
        **options,
    }
    return batchd.Loader(
        server.address, dataset=dataset, pipeline=_pipeline(tokenizer, dataset, optional=optional),
        **options,
    )  # fmt: skip


def _index(tokenizer: Path, batch: dict[str, Any], key_of: dict[int, int]) -> list[int]:
    """Each row's sample index, checked against its image's colour, its caption's tokens
    and its label."""
    tok = Tokenizer.from_file(str(tokenizer))
    out = []
    for row, sample_id in enumerate(batch["sample_id"].tolist()):
        i = key_of[sample_id]
        pixel = batch["image"][row, :, SIZE // 2, SIZE // 2].numpy().astype(int)
        assert np.abs(pixel - np.array(_colour(i))).max() <= 2, (i, pixel)
        assert int(batch["label"][row]) == i % 3
        length = int(batch["caption.length"][row])
        ids = batch["caption"][row, :length].tolist()
        assert batch["caption.attention_mask"][row, :length].all()
        want = [BOS, *tok.encode(_caption(i)).ids, EOS][:MAX_LEN]
        assert ids == want, (i, ids, want)
        out.append(i)
    return out


def _keys(server: Any, tokenizer: Path, dataset: str) -> dict[int, int]:
    """sample id -> sample index, from one epoch of labels-free ids (ids are in key order)."""
    with _loader(server, tokenizer, dataset, shuffle=False, batch_size=N, on_error="skip") as lo:
        ids = sorted(i for b in lo for i in b["sample_id"].tolist())
        failed = lo.last_failed_sample_ids
    everything = sorted([*ids, *failed])
    return {sample_id: i for i, sample_id in enumerate(everything)}


@pytest.mark.parametrize("dataset", ["wds", "pq"])
def test_a_sample_of_several_fields_loads_as_a_dict_batch_once_per_epoch_over_2_ranks(
    catalog: Engine, tmp_path: Path, tokenizer: Path, dataset: str
) -> None:
    url = catalog.url.render_as_string(hide_password=False)
    with serve(url, tmp_path) as server:
        key_of = _keys(server, tokenizer, dataset)
        assert len(key_of) == N
        served: list[int] = []
        failed: list[int] = []
        for rank in range(2):
            with _loader(server, tokenizer, dataset, rank=rank, world_size=2) as loader:
                for batch in loader:
                    assert set(batch) == {
                        "image", "caption", "caption.attention_mask", "caption.length",
                        "sample_id", "label",
                    }  # fmt: skip
                    assert tuple(batch["image"].shape[1:]) == (3, SIZE, SIZE)
                    served += _index(tokenizer, batch, key_of)
                    failed += [key_of[s] for s in loader.last_failed_sample_ids]
        counts = Counter(served)
        assert set(counts) == set(range(N)) - {NO_CAPTION}
        assert failed == [NO_CAPTION]
        assert sum(counts.values()) - (N - 1) < 2, "samples repeated beyond the padding"

        with (
            _loader(server, tokenizer, dataset, on_error="raise") as loader,
            pytest.raises(errors.DataLoss, match="missing_field"),
        ):
            for _ in loader:
                pass

        with _loader(server, tokenizer, dataset, optional=True, batch_size=N) as loader:
            (batch,) = list(loader)
        present = dict(
            zip(batch["sample_id"].tolist(), batch["caption.present"].tolist(), strict=True)
        )
        assert [key_of[s] for s, p in present.items() if not p] == [NO_CAPTION]
        row = batch["sample_id"].tolist().index(next(s for s, i in key_of.items() if i == 5))
        assert int(batch["caption.length"][row]) == 0


@SQLITE
@pytest.mark.parametrize("dataset", ["wds", "pq"])
def test_resume_and_elastic_resume_of_samples_of_fields_give_identical_batches(
    catalog: Engine, tmp_path: Path, tokenizer: Path, dataset: str
) -> None:
    url = catalog.url.render_as_string(hide_password=False)
    with serve(url, tmp_path) as server:
        key_of = _keys(server, tokenizer, dataset)
        assert_resume_yields_the_rest(
            lambda: _loader(server, tokenizer, dataset, rank=1, world_size=2),
            epochs=2,
            stop_after=3,
        )
        first: list[list[int]] = []
        state: dict[str, Any] = {}
        for rank in range(2):
            with _loader(server, tokenizer, dataset, rank=rank, world_size=2) as loader:
                it = iter(loader)
                for _ in range(1):
                    first.append(_index(tokenizer, next(it), key_of))
                if rank == 0:
                    state = loader.state_dict()
        with _loader(server, tokenizer, dataset) as loader:
            loader.load_state_dict(state)
            rest = [_index(tokenizer, b, key_of) for b in loader]
        with _loader(server, tokenizer, dataset) as loader:
            loader.load_state_dict(state)
            again = [_index(tokenizer, b, key_of) for b in loader]
        assert rest == again
        counts = Counter(i for b in [*first, *rest] for i in b)
        assert set(counts) == set(range(N)) - {NO_CAPTION}
        assert max(counts.values()) == 1


def _lookups(result: str) -> float:
    labels = {"dataset": "wds", "result": result}
    return REGISTRY.get_sample_value("batchd_decode_cache_lookups_total", labels) or 0.0


@SQLITE
def test_the_decode_cache_and_share_serve_samples_of_fields_unchanged(
    catalog: Engine, tmp_path: Path, tokenizer: Path
) -> None:
    url = catalog.url.render_as_string(hide_password=False)
    with serve(url, tmp_path) as plain:
        key_of = _keys(plain, tokenizer, "wds")
        with _loader(plain, tokenizer, "wds", decode_cache=False) as loader:
            reference = [_index(tokenizer, b, key_of) for b in loader]
    (tmp_path / "cached").mkdir()
    with serve(url, tmp_path / "cached", decode_cache_bytes=64 << 20) as server:
        for _ in range(2):  # the first fills the cache, the second reads it
            with _loader(server, tokenizer, "wds") as loader:
                assert [_index(tokenizer, b, key_of) for b in loader] == reference
        assert _lookups("hit") >= N - 1, "the second epoch's images came from the cache"
        with (
            _loader(server, tokenizer, "wds", share="fields") as a,
            _loader(server, tokenizer, "wds", share="fields") as b,
        ):
            got_a = [_index(tokenizer, x, key_of) for x in a]
            got_b = [_index(tokenizer, x, key_of) for x in b]
        assert got_a == got_b == reference


@SQLITE
def test_samples_of_fields_on_an_object_store_load_as_on_a_local_root(
    catalog: Engine, tmp_path: Path, tokenizer: Path
) -> None:
    """The same shards and Parquet file under s3:// (SeaweedFS): each field read by ranged
    GETs, every sample once over 2 ranks, the missing caption one bad sample."""
    with bucket_in_env(BUCKET) as store:
        store.upload_tree(tmp_path / "data", BUCKET, "data")
        root = f"s3://{BUCKET}/data"
        ingest_tar(catalog, dataset="s3wds", root=root, shards=["pairs-train-*.tar"])
        ingest_parquet(
            catalog, dataset="s3pq", root=root, files=["pairs.parquet"], payload="image",
            split="train", label="label", key="n",
        )  # fmt: skip
        url = catalog.url.render_as_string(hide_password=False)
        with serve(url, tmp_path) as server:
            for local, remote in (("wds", "s3wds"), ("pq", "s3pq")):
                key_of = _keys(server, tokenizer, local)
                remote_keys = _keys(server, tokenizer, remote)
                # The same samples, ingested in the same order: the same sample indexes.
                served: list[int] = []
                failed: list[int] = []
                for rank in range(2):
                    pipeline = _pipeline(tokenizer, local)
                    with batchd.Loader(
                        server.address, dataset=remote, pipeline=pipeline, batch_size=5,
                        rank=rank, world_size=2, seed=3, device="cpu", max_error_fraction=0.2,
                    ) as loader:  # fmt: skip
                        for batch in loader:
                            served += _index(tokenizer, batch, remote_keys)
                            failed += [remote_keys[s] for s in loader.last_failed_sample_ids]
                assert len(key_of) == len(remote_keys) == N
                assert set(served) == set(range(N)) - {NO_CAPTION}
                assert failed == [NO_CAPTION]


@SQLITE
def test_a_mix_of_shards_and_parquet_reads_each_field_from_its_own_source(
    catalog: Engine, tmp_path: Path, tokenizer: Path
) -> None:
    """One session mixes the shards (fields from members) and the Parquet file (the same
    fields from columns, the source's own pipeline): each row decodes from its source."""
    url = catalog.url.render_as_string(hide_password=False)
    with serve(url, tmp_path) as server:
        wds, pq = _keys(server, tokenizer, "wds"), _keys(server, tokenizer, "pq")
        sources = batchd.Mix(
            [
                (batchd.Source("wds"), 0.5),
                (batchd.Source("pq", pipeline=_pipeline(tokenizer, "pq")), 0.5),
            ]
        )
        with batchd.Loader(
            server.address, sources=sources, pipeline=_pipeline(tokenizer, "wds"),
            batch_size=6, device="cpu", max_error_fraction=0.2,
        ) as loader:  # fmt: skip
            rows = []
            for batch in loader:
                _index(tokenizer, batch, {**wds, **pq})  # each row's image and caption
                rows += zip(batch["sample_id"].tolist(), batch["source"].tolist(), strict=True)
    ids = [i for i, _ in rows]
    assert len(ids) == len(set(ids)) > N
    assert all((i in pq) == (s == 1) for i, s in rows)
    assert {s for _, s in rows} == {0, 1}
