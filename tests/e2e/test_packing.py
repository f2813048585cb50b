"""Sequence packing end to end through the public client on a real server: two ranks of
best_fit at seq_len 512 over a few hundred documents of long-tailed lengths serve every
(document, position) token once per epoch, with position_ids, segment_ids and cu_seqlens
consistent with document_id; a mid-epoch state resumes exactly, and a state saved at two
ranks resumes at one with every token once; the other methods, a packed mix, and the
errors of a bad Pack."""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from sqlalchemy.engine import Engine

import batchd
from batchd import errors
from batchd_server.api import RunningServer
from batchd_server.catalog.ingest import ingest_manifest

from packing_data import documents_dataset, token_at
from serving import serve

# The plan does not depend on the catalog's backend: the embedded one is enough.
pytestmark = [pytest.mark.slow(seconds=60), pytest.mark.backend("sqlite")]

N_DOCS = 240
SEQ_LEN = 512
BATCH = 4


@pytest.fixture
def catalog(engine: Engine, tmp_path: Path) -> dict[str, Any]:
    """Two datasets of long-tailed documents, and each one's sample ids in key order."""
    lengths = {
        "web": documents_dataset(engine, tmp_path / "web", name="web", n=N_DOCS, seed=1),
        "code": documents_dataset(engine, tmp_path / "code", name="code", n=90, seed=2),
    }
    return {"engine": engine, "lengths": lengths}


@pytest.fixture
def server(catalog: dict[str, Any], tmp_path: Path) -> Iterator[RunningServer]:
    url = catalog["engine"].url.render_as_string(hide_password=False)
    with serve(url, tmp_path) as srv:
        yield srv


def _loader(server: RunningServer, rank: int = 0, world_size: int = 1, **kw: Any) -> batchd.Loader:
    kw.setdefault("dataset", "web")
    return batchd.Loader(
        server.address,
        batch_size=BATCH,
        rank=rank,
        world_size=world_size,
        pipeline=batchd.Tokens(max_len=8192, dtype="uint16"),
        pack=kw.pop("pack", batchd.Pack(seq_len=SEQ_LEN, method="best_fit")),
        device="cpu",
        seed=5,
        **kw,
    )


def _np(batch: dict[str, Any]) -> dict[str, np.ndarray]:
    return {k: np.asarray(v) for k, v in batch.items()}


def _tokens(batch: dict[str, np.ndarray], key_of: dict[int, tuple[str, int]]) -> list[tuple]:
    """The batch's (dataset, document, position) tokens, after checking that every field
    agrees with document_id."""
    ids, pos, seg, doc = (
        batch[k] for k in ("input_ids", "position_ids", "segment_ids", "document_id")
    )
    rows = ids.shape[0]
    assert ids.shape == (rows, SEQ_LEN) and ids.dtype == np.uint16
    assert pos.dtype == seg.dtype == batch["cu_seqlens"].dtype == np.int32
    assert doc.dtype == np.int64
    pad = seg == 0
    assert batch["length"].tolist() == (~pad).sum(axis=1).tolist()
    assert (doc[pad] == -1).all() and (pos[pad] == 0).all()
    cu = batch["cu_seqlens"]
    assert cu[0] == 0 and cu[-1] == rows * SEQ_LEN and (np.diff(cu) > 0).all()
    flat_doc, flat_seg, flat_pos = doc.reshape(-1), seg.reshape(-1), pos.reshape(-1)
    for a, b in zip(cu[:-1].tolist(), cu[1:].tolist(), strict=True):
        assert a // SEQ_LEN == (b - 1) // SEQ_LEN, "a segment never crosses a row"
        assert (flat_doc[a:b] == flat_doc[a]).all() and (flat_seg[a:b] == flat_seg[a]).all()
        if flat_seg[a]:
            assert (np.diff(flat_pos[a:b]) == 1).all()
    out = []
    for r in range(rows):
        real = np.flatnonzero(~pad[r])
        # Real tokens first, padding after; segments numbered 1, 2, ... in order.
        assert real.size == 0 or real[-1] == real.size - 1
        segs = seg[r, real]
        assert segs.size == 0 or (segs[0] == 1 and (np.diff(segs) >= 0).all())
        assert (np.diff(segs) <= 1).all()
        for t in real.tolist():
            dataset, index = key_of[int(doc[r, t])]
            p = int(pos[r, t])
            assert ids[r, t] == token_at(index, p)
            out.append((dataset, index, p))
    return out


def _key_of(server: RunningServer) -> dict[int, tuple[str, int]]:
    """Sample id -> (dataset, document index), from what the server serves unpacked."""
    found = {}
    for dataset in ("web", "code"):
        with batchd.Loader(
            server.address,
            dataset=dataset,
            batch_size=64,
            shuffle=False,
            pipeline=batchd.Tokens(max_len=1, dtype="uint16"),
            device="cpu",
        ) as loader:
            for b in loader:
                for sid, label in zip(
                    np.asarray(b["sample_id"]).tolist(),
                    np.asarray(b["label"]).tolist(),
                    strict=True,
                ):
                    found[sid] = (dataset, label)
    return found


def _every_token(lengths: list[int], dataset: str = "web") -> Counter[tuple]:
    return Counter((dataset, i, p) for i, n in enumerate(lengths) for p in range(n))


def _run(loader: batchd.Loader, key_of: dict, steps: int | None = None) -> list[tuple]:
    tokens = []
    for k, batch in enumerate(loader):
        if steps is not None and k == steps:
            break
        tokens += _tokens(_np(batch), key_of)
    return tokens


def test_two_ranks_of_best_fit_serve_every_token_once_and_resume_exactly(
    server: RunningServer, catalog: dict[str, Any]
) -> None:
    """The acceptance: 2 ranks, every (document, position) once, fields consistent, equal
    batch counts; a state after 3 steps resumes at 2 ranks with exactly the rest, and at 1
    rank with every token once."""
    key_of = _key_of(server)
    want = _every_token(catalog["lengths"]["web"])
    per_rank, counts = [], []
    for rank in range(2):
        with _loader(server, rank, 2) as loader:
            counts.append(len(loader))
            per_rank.append([_tokens(_np(b), key_of) for b in loader])
    assert counts[0] == counts[1] == len(per_rank[0]) == len(per_rank[1])
    served = Counter(t for rank in per_rank for batch in rank for t in batch)
    # Without drop_last the tail is padded by wrapping around: at most one row repeats.
    repeated = {t for t, c in served.items() if c > 1}
    assert set(served) == set(want)
    assert len(repeated) <= SEQ_LEN

    # Interrupted after 3 steps, resumed at 2 ranks: exactly the rest, batch for batch.
    states = []
    for rank in range(2):
        with _loader(server, rank, 2) as loader:
            it = iter(loader)
            for _ in range(3):
                next(it)
            states.append(loader.state_dict())
    assert states[0]["consumed"] == states[1]["consumed"] == 3 * BATCH * 2
    for rank in range(2):
        with _loader(server, rank, 2) as loader:
            loader.load_state_dict(states[0])
            rest = [_tokens(_np(b), key_of) for b in loader]
        assert rest == per_rank[rank][3:]

    # Resumed at 1 rank: the first 3 steps of both ranks and the rest cover every token once.
    with _loader(server, 0, 1) as loader:
        loader.load_state_dict(states[0])
        rest_one = Counter(t for b in loader for t in _tokens(_np(b), key_of))
    first = Counter(t for rank in per_rank for batch in rank[:3] for t in batch)
    together = first + rest_one
    assert set(together) == set(want)
    assert all(c == 1 for c in together.values())


@pytest.mark.parametrize("method", ["first_fit", "concat"])
def test_first_fit_and_concat_serve_every_token_once(
    server: RunningServer, catalog: dict[str, Any], method: str
) -> None:
    key_of = _key_of(server)
    with _loader(
        server, pack=batchd.Pack(seq_len=SEQ_LEN, method=method), drop_last=False
    ) as loader:
        served = Counter(_run(loader, key_of))
    assert served == _every_token(catalog["lengths"]["web"])


def test_a_packed_mix_serves_each_token_at_most_once_and_resumes_exactly(
    server: RunningServer, catalog: dict[str, Any]
) -> None:
    """A mix packs each source's documents and mixes rows: no token repeats (stop='first'),
    every row is of one source, and a mid-epoch state resumes with the same batches."""
    key_of = _key_of(server)
    mix = batchd.Mix({"web": 0.5, "code": 0.5})
    with _loader(server, dataset=None, sources=mix) as loader:
        batches = [_np(b) for b in loader]
    tokens = [t for b in batches for t in _tokens(b, key_of)]
    assert max(Counter(tokens).values()) == 1
    for b in batches:
        firsts = [key_of[int(d)][0] for d in b["document_id"][:, 0]]
        assert [mix.names[s] for s in b["source"].tolist()] == firsts
        for r in range(b["document_id"].shape[0]):
            real = b["document_id"][r][b["segment_ids"][r] > 0]
            assert len({key_of[int(d)][0] for d in real}) == 1
    code = _every_token(catalog["lengths"]["code"], "code")
    assert set(code) <= set(tokens)  # the smaller source is served whole
    with _loader(server, dataset=None, sources=mix) as loader:
        it = iter(loader)
        for _ in range(2):
            next(it)
        state = loader.state_dict()
    with _loader(server, dataset=None, sources=mix) as loader:
        loader.load_state_dict(state)
        rest = [_tokens(_np(b), key_of) for b in loader]
    assert rest == [_tokens(b, key_of) for b in batches[2:]]


def test_a_bad_pack_fails_with_what_to_do(server: RunningServer) -> None:
    with pytest.raises(errors.InvalidArgument, match="seq_len"):
        batchd.Pack(seq_len=0)
    with pytest.raises(errors.InvalidArgument, match="'best_fit', 'first_fit', 'concat'"):
        batchd.Pack(seq_len=8, method="worst_fit")
    with pytest.raises(errors.InvalidArgument, match=r"pipeline=batchd\.Tokens"):
        batchd.Loader(
            server.address,
            dataset="web",
            batch_size=2,
            pipeline=batchd.Array((4,), "float32"),
            pack=batchd.Pack(seq_len=8),
        )
    with pytest.raises(errors.InvalidArgument, match="sampling='uniform'"):
        _loader(server, sampling="weighted")
    # A state of an unpacked Loader does not resume a packed one.
    with batchd.Loader(
        server.address,
        dataset="web",
        batch_size=2,
        pipeline=batchd.Tokens(max_len=8, dtype="uint16"),
        device="cpu",
    ) as plain:
        state = plain.state_dict()
    with _loader(server) as loader, pytest.raises(errors.InvalidArgument, match="pack"):
        loader.load_state_dict(state)


def test_a_document_shorter_than_its_catalog_length_is_a_bad_sample_under_the_policy(
    server: RunningServer, catalog: dict[str, Any], tmp_path: Path
) -> None:
    """A document whose file holds fewer tokens than the catalog's length: under "skip" its
    piece is left out (reported, the rest of the row intact); under "raise" the epoch
    fails with DataLoss naming it."""
    root = tmp_path / "liar"
    root.mkdir()
    honest, liar = np.arange(1, 41, dtype="<u2"), np.arange(100, 110, dtype="<u2")
    (root / "a.bin").write_bytes(honest.tobytes())
    (root / "b.bin").write_bytes(liar.tobytes())
    rows = [
        {"key": "a", "path": "a.bin", "split": "train", "length": 40},
        {"key": "b", "path": "b.bin", "split": "train", "length": 30},
    ]
    manifest = tmp_path / "liar.jsonl"
    manifest.write_text("".join(json.dumps(r) + "\n" for r in rows))
    ingest_manifest(catalog["engine"], dataset="liar", root=root, manifest=manifest)
    skipping = _loader(
        server, dataset="liar", pack=batchd.Pack(seq_len=128), max_error_fraction=1.0
    )
    with skipping as loader:
        (batch,) = [_np(b) for b in loader]
        failed = loader.last_failed_sample_ids
    assert len(failed) == 1
    real = batch["segment_ids"][0] > 0
    assert batch["input_ids"][0][real].tolist() == honest.tolist()
    assert set(batch["document_id"][0][real].tolist()) == {int(batch["sample_id"][0])}
    assert failed[0] not in batch["document_id"][0].tolist()
    raising = _loader(server, dataset="liar", pack=batchd.Pack(seq_len=128), on_error="raise")
    with raising, pytest.raises(errors.DataLoss, match=r"b\.bin"):
        list(raising)


def test_a_packed_mix_with_a_schedule_counts_rows_and_tokens_per_source_and_resumes(
    server: RunningServer, catalog: dict[str, Any]
) -> None:
    """Under a schedule the mix's rows follow the weights in force; the per-source accounting
    counts rows as samples and the rows' tokens; a mid-epoch state resumes exactly."""
    key_of = _key_of(server)
    mix = batchd.Mix({"web": 0.5, "code": 0.5}, schedule=[(3, {"web": 0.1, "code": 0.9})])
    with _loader(server, dataset=None, sources=mix) as loader:
        batches = [_np(b) for b in loader]
        stats = loader.stats().sources
    tokens = [t for b in batches for t in _tokens(b, key_of)]
    assert sum(s.samples for s in stats) == sum(b["source"].size for b in batches)
    per_source = Counter(t[0] for t in tokens)
    assert {s.name: s.tokens for s in stats} == {
        "web": per_source["web"],
        "code": per_source["code"],
    }
    late = np.concatenate([b["source"] for b in batches[3:]])
    assert np.count_nonzero(late == 1) > 2 * np.count_nonzero(late == 0)
    with _loader(server, dataset=None, sources=mix) as loader:
        it = iter(loader)
        for _ in range(4):
            next(it)
        state = loader.state_dict()
    with _loader(server, dataset=None, sources=mix) as loader:
        loader.load_state_dict(state)
        rest = [_tokens(_np(b), key_of) for b in loader]
    assert rest == [_tokens(b, key_of) for b in batches[4:]]
