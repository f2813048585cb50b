"""Ingest of text: JSONL lines and Parquet string columns as documents, their byte ranges the
field's value where it lies, their token counts (with --tokenizer) the tokenizer's own,
recorded with its identity; a value of the wrong type, a line that is not an object and a
string column given as a payload stop the ingest naming where and what to do; empty
documents are left out and listed."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import sqlalchemy as sa
from sqlalchemy.engine import Engine
from tokenizers import Tokenizer

from batchd_server.catalog.ingest import ingest_jsonl, ingest_parquet
from batchd_server.catalog.ingest.jsonl import field_span
from batchd_server.catalog.queries import resolve_dataset
from batchd_server.catalog.schema import datasets, samples
from batchd_server.errors import DataError

from text_data import chats, documents, train_tokenizer, write_jsonl

pytestmark = pytest.mark.backend("sqlite")


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, Tokenizer]:
    path = tmp_path_factory.mktemp("tok") / "tokenizer.json"
    return str(path), train_tokenizer(path)


@pytest.mark.parametrize(
    ("line", "field", "value"),
    [
        ('{"text": "a"}', "text", '"a"'),
        ('  { "id" : 3 , "text" :"x\\"y\\\\z\\n" }  ', "text", '"x\\"y\\\\z\\n"'),
        ('{"meta": {"text": "inner"}, "text": "outer"}', "text", '"outer"'),
        ('{"text": "first", "text": "last"}', "text", '"last"'),
        ('{"t\\u00e9xt": "esc", "téxt": "raw"}', "téxt", '"raw"'),
        ('{"messages": [{"role": "user", "content": "hi"}]}', "messages", None),
        ('{"other": 1}', "text", ""),
        ("{}", "text", ""),
    ],
)
def test_a_fields_value_is_found_where_it_lies(line: str, field: str, value: str | None) -> None:
    raw = line.encode()
    span = field_span(raw.decode("latin-1"), field)
    if value == "":
        assert span is None
        return
    assert span is not None
    found = raw[span[0] : span[1]]
    assert json.loads(found) == json.loads(line)[field]
    if value is not None:
        assert found == value.encode()


@pytest.mark.parametrize("line", ["[1, 2]", '{"a": 1', '{"a" 1}', '{"a": 1} x', '"text"'])
def test_a_line_that_is_not_one_json_object_is_refused(line: str) -> None:
    with pytest.raises(ValueError):
        field_span(line, "a")


def _rows(engine: Engine, name: str) -> list[Any]:
    query = (
        sa.select(samples)
        .join(datasets, datasets.c.id == samples.c.dataset_id)
        .where(datasets.c.name == name)
        .order_by(samples.c.id)
    )
    with engine.connect() as conn:
        return list(conn.execute(query).all())


def test_jsonl_documents_are_their_values_byte_ranges_with_the_tokenizers_counts(
    engine: Engine, tmp_path: Path, tokenizer: tuple[str, Tokenizer]
) -> None:
    path, tok = tokenizer
    docs = documents(40, seed=8)
    rows = [{"n": i, "text": t} for i, t in enumerate(docs)]
    rows.insert(5, {"n": -1, "text": ""})
    write_jsonl(tmp_path / "a.jsonl", rows)
    report = ingest_jsonl(
        engine,
        dataset="docs",
        root=tmp_path,
        files=["a.jsonl"],
        split="train",
        text="text",
        tokenizer=path,
        workers=2,
    )
    assert report.inserted == 40
    empty = "line 6: an empty document (left out: it has no tokens)"
    assert report.skipped == (f"{tmp_path}/a.jsonl, {empty}",)
    data = (tmp_path / "a.jsonl").read_bytes()
    got = _rows(engine, "docs")
    for row, text in zip(got, docs, strict=True):
        value = data[row.byte_offset : row.byte_offset + row.byte_length]
        assert json.loads(value) == text
        assert row.length == len(tok.encode(text).ids)
    ref = resolve_dataset(engine.connect(), "docs")
    assert ref.text_identity.startswith("text:sha256:")
    # The same version again with another tokenizer: refused, saying to use a new version.
    other = tmp_path / "other" / "tokenizer.json"
    train_tokenizer(other, vocab_size=300, seed=9)
    with pytest.raises(DataError, match="new --version"):
        ingest_jsonl(
            engine,
            dataset="docs",
            root=tmp_path,
            files=["a.jsonl"],
            split="train",
            text="text",
            tokenizer=str(other),
        )


@pytest.mark.parametrize(
    ("line", "says"),
    [
        ({"text": 5}, r"line 2: field 'text' \(--text\) holds '5'; it must be a string"),
        ({"body": "x"}, r"line 2: it has no field 'text' \(--text\)"),
        ([1], "line 2: it is not a JSON object"),
    ],
)
def test_a_bad_jsonl_line_stops_the_ingest_naming_it(
    engine: Engine, tmp_path: Path, line: Any, says: str
) -> None:
    write_jsonl(tmp_path / "a.jsonl", [{"text": "fine"}, line])
    with pytest.raises(DataError, match=says):
        ingest_jsonl(
            engine, dataset="bad", root=tmp_path, files=["a.jsonl"], split="train", text="text"
        )


def test_chat_messages_are_counted_as_their_rendered_tokens(
    engine: Engine, tmp_path: Path, tokenizer: tuple[str, Tokenizer]
) -> None:
    path, tok = tokenizer
    conversations = chats(10, seed=3)
    write_jsonl(tmp_path / "c.jsonl", [{"messages": c} for c in conversations])
    ingest_jsonl(
        engine,
        dataset="chat",
        root=tmp_path,
        files=["c.jsonl"],
        split="train",
        messages="messages",
        tokenizer=path,
        workers=1,
    )
    for row, c in zip(_rows(engine, "chat"), conversations, strict=True):
        rendered = "".join(f"<|{m['role']}|>\n{m['content']}<|end|>\n" for m in c)
        assert row.length == len(tok.encode(rendered).ids)
    write_jsonl(tmp_path / "bad.jsonl", [{"messages": "not a list"}])
    with pytest.raises(DataError, match="must be a list of"):
        ingest_jsonl(
            engine,
            dataset="chat2",
            root=tmp_path,
            files=["bad.jsonl"],
            split="train",
            messages="messages",
        )


def test_parquet_text_is_taken_only_as_a_string_column_given_as_text(
    engine: Engine, tmp_path: Path, tokenizer: tuple[str, Tokenizer]
) -> None:
    path, tok = tokenizer
    docs = documents(30, seed=2)
    table = pa.table({"text": [*docs[:3], "", None, *docs[3:]], "n": list(range(len(docs) + 2))})
    pq.write_table(table, tmp_path / "t.parquet", row_group_size=8)
    with pytest.raises(DataError, match=r"is string: text\. Ingest it with --text text"):
        ingest_parquet(
            engine, dataset="p", root=tmp_path, files=["t.parquet"], payload="text", split="x"
        )
    with pytest.raises(DataError, match=r"column 'n' \(--text\) is int64; text documents are"):
        ingest_parquet(engine, dataset="p", root=tmp_path, files=["t.parquet"], text="n", split="x")
    report = ingest_parquet(
        engine,
        dataset="p",
        root=tmp_path,
        files=["t.parquet"],
        text="text",
        split="train",
        tokenizer=path,
        workers=2,
    )
    assert report.inserted == 30
    assert [s.split(": ", 1)[1] for s in report.skipped] == [
        "an empty document (left out: it has no tokens)",
        "null (left out: it has no tokens)",
    ]
    got = _rows(engine, "p")
    assert [r.length for r in got] == [len(tok.encode(t).ids) for t in docs]
