"""Text in, tokens out, end to end: JSONL and Parquet text ingested with a tokenizer trained
in the test, served through ``batchd.Text`` + ``batchd.Pack`` on a real server at 2 ranks.
Every document's tokens come once per epoch and equal the tokenizer's own encoding with BOS
and EOS around it (documents longer than a row are split); a mid-epoch state resumes at 2
ranks with exactly the rest and at 1 rank with every token once. Chat transcripts packed the
same way keep their loss_mask aligned with their tokens, and no piece of a row crosses a
document. A tokenizer other than the ingest's, and a catalog without counts, are refused
saying how to re-ingest."""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import sqlalchemy as sa
from sqlalchemy.engine import Engine

import batchd
from batchd import errors
from batchd_server.api import RunningServer
from batchd_server.catalog.ingest import ingest_jsonl, ingest_parquet
from batchd_server.catalog.schema import datasets, samples

from serving import serve
from text_data import chats, documents, train_tokenizer, write_jsonl

# The plan does not depend on the catalog's backend: the embedded one is enough.
pytestmark = [pytest.mark.slow(seconds=90), pytest.mark.backend("sqlite")]

SEQ_LEN = 128
BATCH = 4
BOS, EOS = 1, 2


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("tok") / "tokenizer.json"
    train_tokenizer(path)
    return path.parent


@pytest.fixture
def catalog(engine: Engine, tmp_path: Path, tokenizer_dir: Path) -> dict[str, Any]:
    """The same documents as JSONL (two files, another field beside the text) and as a
    Parquet string column, ingested with the tokenizer; each document's text by key."""
    docs = documents(160, seed=3)
    tokenizer = str(tokenizer_dir / "tokenizer.json")
    root = tmp_path / "data"
    halves = [docs[:90], docs[90:]]
    for n, part in enumerate(halves):
        write_jsonl(root / f"part-{n}.jsonl", [{"id": i, "text": t} for i, t in enumerate(part)])
    ingest_jsonl(
        engine,
        dataset="jtext",
        root=root,
        files=["part-*.jsonl"],
        split="train",
        text="text",
        tokenizer=tokenizer,
        workers=2,
    )
    table = pa.table({"text": docs, "n": list(range(len(docs)))})
    pq.write_table(table, root / "docs.parquet", row_group_size=50)
    ingest_parquet(
        engine,
        dataset="ptext",
        root=root,
        files=["docs.parquet"],
        text="text",
        split="train",
        tokenizer=tokenizer,
        workers=2,
    )
    texts = {
        f"part-{n}.jsonl#{i + 1}": t for n, part in enumerate(halves) for i, t in enumerate(part)
    }
    texts.update({f"docs.parquet#{i}": t for i, t in enumerate(docs)})
    conversations = chats(60, seed=4)
    write_jsonl(root / "chat.jsonl", [{"messages": c} for c in conversations])
    ingest_jsonl(
        engine,
        dataset="chat",
        root=root,
        files=["chat.jsonl"],
        split="train",
        messages="messages",
        tokenizer=tokenizer,
        workers=1,
    )
    texts.update({f"chat.jsonl#{i + 1}": c for i, c in enumerate(conversations)})
    return {"engine": engine, "texts": texts, "tokenizer": tokenizer}


@pytest.fixture
def server(catalog: dict[str, Any], tmp_path: Path) -> Iterator[RunningServer]:
    url = catalog["engine"].url.render_as_string(hide_password=False)
    with serve(url, tmp_path) as srv:
        yield srv


def _keys(catalog: dict[str, Any], dataset: str) -> dict[int, str]:
    query = (
        sa.select(samples.c.id, samples.c.key)
        .join(datasets, datasets.c.id == samples.c.dataset_id)
        .where(datasets.c.name == dataset)
    )
    with catalog["engine"].connect() as conn:
        return {r.id: r.key for r in conn.execute(query).all()}


def _expected(catalog: dict[str, Any], dataset: str) -> dict[int, list[int]]:
    """Sample id -> the tokenizer's own encoding of its text, with BOS and EOS."""
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(catalog["tokenizer"])
    texts = catalog["texts"]
    return {
        d: [BOS, *tokenizer.encode(texts[k]).ids, EOS] for d, k in _keys(catalog, dataset).items()
    }


def _loader(server: RunningServer, dataset: str, tokenizer: str, **kw: Any) -> batchd.Loader:
    return batchd.Loader(
        server.address,
        dataset=dataset,
        batch_size=BATCH,
        pipeline=batchd.Text(tokenizer=tokenizer),
        pack=batchd.Pack(seq_len=SEQ_LEN),
        device="cpu",
        seed=7,
        **kw,
    )


def _tokens(batch: dict[str, Any], expected: dict[int, list[int]]) -> list[tuple[int, int]]:
    """The batch's (document, position) tokens, each checked against the tokenizer."""
    ids, pos, doc = (np.asarray(batch[k]) for k in ("input_ids", "position_ids", "document_id"))
    assert ids.shape[1] == SEQ_LEN
    out = []
    for r, t in zip(*np.nonzero(doc >= 0), strict=True):
        d, p = int(doc[r, t]), int(pos[r, t])
        assert int(ids[r, t]) == expected[d][p], (d, p)
        out.append((d, p))
    return out


def _every_token(expected: dict[int, list[int]]) -> set[tuple[int, int]]:
    return {(d, p) for d, ids in expected.items() for p in range(len(ids))}


@pytest.mark.parametrize("dataset", ["jtext", "ptext"])
def test_two_ranks_serve_every_documents_tokens_once_and_resume_exactly(
    server: RunningServer, catalog: dict[str, Any], dataset: str
) -> None:
    """2 ranks: every (document, position) once (the tail's wrap-around aside), equal to the
    tokenizer's encoding; a state after 3 steps resumes at 2 ranks with exactly the rest and
    at 1 rank with every token once."""
    expected = _expected(catalog, dataset)
    assert max(len(t) for t in expected.values()) > SEQ_LEN, "some documents are split"
    tok = catalog["tokenizer"]
    per_rank = []
    for rank in range(2):
        with _loader(server, dataset, tok, rank=rank, world_size=2) as loader:
            per_rank.append([_tokens(b, expected) for b in loader])
    assert len(per_rank[0]) == len(per_rank[1])
    served = Counter(t for rank in per_rank for batch in rank for t in batch)
    assert set(served) == _every_token(expected)
    assert sum(c - 1 for c in served.values()) <= BATCH * SEQ_LEN  # the wrapped tail only

    states = []
    for rank in range(2):
        with _loader(server, dataset, tok, rank=rank, world_size=2) as loader:
            it = iter(loader)
            for _ in range(3):
                next(it)
            states.append(loader.state_dict())
    for rank in range(2):
        with _loader(server, dataset, tok, rank=rank, world_size=2) as loader:
            loader.load_state_dict(states[rank])
            assert [_tokens(b, expected) for b in loader] == per_rank[rank][3:]

    with _loader(server, dataset, tok) as loader:
        loader.load_state_dict(states[0])
        rest = Counter(t for b in loader for t in _tokens(b, expected))
    together = Counter(t for rank in per_rank for batch in rank[:3] for t in batch) + rest
    assert set(together) == _every_token(expected)
    assert max(together.values()) == 1


def test_another_tokenizer_or_no_counts_is_refused_saying_how_to_reingest(
    server: RunningServer, catalog: dict[str, Any], tmp_path: Path
) -> None:
    other = tmp_path / "other" / "tokenizer.json"
    train_tokenizer(other, vocab_size=300, seed=9)
    with pytest.raises(errors.InvalidArgument, match=r"re-ingest .*--tokenizer"):
        _loader(server, "jtext", str(other))
    root = tmp_path / "plain"
    write_jsonl(root / "a.jsonl", [{"text": "hello there"}, {"text": "general"}])
    ingest_jsonl(
        catalog["engine"], dataset="plain", root=root, files=["a.jsonl"], split="train", text="text"
    )
    with pytest.raises(errors.InvalidArgument, match=r"no token counts.*--tokenizer"):
        _loader(server, "plain", catalog["tokenizer"])
    # Unpacked, the same documents need no counts: each is tokenized as it is served.
    with batchd.Loader(
        server.address,
        dataset="plain",
        batch_size=2,
        shuffle=False,
        pipeline=batchd.Text(tokenizer=catalog["tokenizer"], max_len=64),
        device="cpu",
    ) as loader:
        (batch,) = list(loader)
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(catalog["tokenizer"])
    for row, text in enumerate(["hello there", "general"]):
        want = [BOS, *tokenizer.encode(text).ids, EOS]
        assert int(batch["length"][row]) == len(want)
        assert np.asarray(batch["input_ids"])[row, : len(want)].tolist() == want


def test_packed_chats_keep_their_loss_mask_aligned_and_rows_never_cross_documents(
    server: RunningServer, catalog: dict[str, Any]
) -> None:
    """Every (conversation, position) once, its token and loss_mask those of the chat
    pipeline's own encoding (whose mask the pipeline tests check against the assistant's
    text); each cu_seqlens segment lies in one document, positions counting from its start."""
    import json

    from batchd_server.pipelines.chat import ChatPipeline

    pipeline = ChatPipeline(catalog["tokenizer"])
    keys = _keys(catalog, "chat")
    encoded = dict(
        zip(
            keys,
            pipeline.encode_documents(
                [json.dumps(catalog["texts"][k]).encode() for k in keys.values()]
            ),
            strict=True,
        )
    )
    loader = batchd.Loader(
        server.address,
        dataset="chat",
        batch_size=BATCH,
        pipeline=batchd.Chat(tokenizer=catalog["tokenizer"]),
        pack=batchd.Pack(seq_len=SEQ_LEN),
        device="cpu",
        drop_last=False,
    )
    seen: Counter[tuple[int, int]] = Counter()
    with loader:
        for batch in loader:
            b = {k: np.asarray(v) for k, v in batch.items()}
            ids, mask, doc, pos = (
                b[k] for k in ("input_ids", "loss_mask", "document_id", "position_ids")
            )
            assert mask.shape == ids.shape and mask.dtype == np.uint8
            assert (mask[doc < 0] == 0).all()
            flat_doc, flat_pos, cu = doc.reshape(-1), pos.reshape(-1), b["cu_seqlens"]
            for a, e in zip(cu[:-1].tolist(), cu[1:].tolist(), strict=True):
                assert (flat_doc[a:e] == flat_doc[a]).all(), "a segment is one document"
                if flat_doc[a] >= 0:
                    assert flat_pos[a:e].tolist() == list(range(flat_pos[a], flat_pos[a] + e - a))
            for r, t in zip(*np.nonzero(doc >= 0), strict=True):
                d, p = int(doc[r, t]), int(pos[r, t])
                want_ids, want_mask = encoded[d]
                assert (int(ids[r, t]), int(mask[r, t])) == (int(want_ids[p]), int(want_mask[p]))
                seen[(d, p)] += 1
    assert set(seen) == {(d, p) for d, (i, _) in encoded.items() for p in range(i.size)}
    assert max(seen.values()) == 1
    assert sum(int(m.sum()) for _, m in encoded.values()) > 0


def test_an_empty_or_mistyped_document_served_is_a_named_bad_sample(
    server: RunningServer, catalog: dict[str, Any], tmp_path: Path
) -> None:
    """Documents that reach a worker (here byte ranges of a manifest) but are empty or not
    text: skipped and reported under on_error="skip", the epoch failing naming the kind
    under "raise"."""
    import json

    from batchd_server.catalog.ingest import ingest_manifest

    root = tmp_path / "odd"
    root.mkdir()
    parts = [b'"fine text"', b'""', b"5"]
    (root / "docs.txt").write_bytes(b"".join(parts))
    rows, offset = [], 0
    for n, part in enumerate(parts):
        rows.append({"key": f"k{n}", "path": "docs.txt", "split": "train", "length": 3})
        rows[-1].update(byte_offset=offset, byte_length=len(part))
        offset += len(part)
    manifest = tmp_path / "odd.jsonl"
    manifest.write_text("".join(json.dumps(r) + "\n" for r in rows))
    ingest_manifest(catalog["engine"], dataset="odd", root=root, manifest=manifest)

    def loader(**kw: Any) -> batchd.Loader:
        return batchd.Loader(
            server.address,
            dataset="odd",
            batch_size=3,
            shuffle=False,
            pipeline=batchd.Text(tokenizer=catalog["tokenizer"], max_len=32),
            device="cpu",
            **kw,
        )

    with loader(max_error_fraction=1.0) as skipping:
        (batch,) = list(skipping)
        assert len(skipping.last_failed_sample_ids) == 2
    assert np.asarray(batch["length"]).tolist()[:1] == [len(_expected_text(catalog, "fine text"))]
    with (
        loader(on_error="raise") as raising,
        pytest.raises(errors.DataLoss, match="empty document"),
    ):
        list(raising)


def _expected_text(catalog: dict[str, Any], text: str) -> list[int]:
    from tokenizers import Tokenizer

    return [BOS, *Tokenizer.from_file(catalog["tokenizer"]).encode(text).ids, EOS]
