"""Ingest text documents from JSONL files: one line, one document, served where it lies.

Each line is a JSON object; ``--text FIELD`` (a string) or ``--messages FIELD`` (a list of
``{"role", "content"}`` messages) names the document in it. A sample's byte range is that
field's *value* in the file (the JSON literal, quotes and escapes included): a worker reads
exactly it and ``batchd.Text`` / ``batchd.Chat`` decode it (``pipelines/text.py``). Nothing
is copied or rewritten; local and ``s3://`` roots are read alike (``find_files``).

With ``--tokenizer`` each document's token count is recorded too, counted in worker
processes (``token_counts.py``), which is what ``batchd.Pack`` plans an epoch from. Empty
documents are left out and listed in the report; a line that is not a JSON object, lacks the
field or holds a value of another type stops the ingest naming the file and line.
"""

from __future__ import annotations

import io
import json
import re
from collections.abc import Callable, Iterator
from dataclasses import replace
from json.decoder import scanstring  # type: ignore[attr-defined]
from pathlib import Path
from typing import IO, Any, Final

from sqlalchemy.engine import Engine

from batchd_server.catalog.ingest.load import IngestReport, Source, Target, find_files, load
from batchd_server.catalog.ingest.token_counts import (
    TextSpec,
    TokenCounter,
    chunked,
    text_attrs,
)
from batchd_server.catalog.manifest import SPLIT_MAX_CHARS, Row, check_name
from batchd_server.catalog.tar_shards import Shard
from batchd_server.errors import DataError
from batchd_server.storage.options import DEFAULT_RETRY_S

__all__ = ["field_span", "ingest_jsonl"]

_SPACE: Final = re.compile(r"[ \t\n\r]*")
_DECODER: Final = json.JSONDecoder()
_SKIPPED_SHOWN: Final = 20


def field_span(line: str, field: str) -> tuple[int, int] | None:
    """Where the value of the top-level ``field`` is in a JSON object ``line`` (the last one
    when the field repeats, as ``json.loads`` takes it); None when it has none.

    ``line`` is the line's bytes decoded as Latin-1, so that positions are byte positions:
    JSON's structure is ASCII, and its strings' other bytes are only carried along.

    Raises:
        ValueError: the line is not one JSON object.
    """
    i = _SPACE.match(line, 0).end()  # type: ignore[union-attr]
    if line[i : i + 1] != "{":
        raise ValueError("it is not a JSON object")
    i = _SPACE.match(line, i + 1).end()  # type: ignore[union-attr]
    found = None
    if line[i : i + 1] == "}":
        i += 1
    else:
        while True:
            if line[i : i + 1] != '"':
                raise ValueError(f"a key was expected at byte {i}")
            key, i = scanstring(line, i + 1)
            i = _SPACE.match(line, i).end()  # type: ignore[union-attr]
            if line[i : i + 1] != ":":
                raise ValueError(f"':' was expected at byte {i}")
            i = _SPACE.match(line, i + 1).end()  # type: ignore[union-attr]
            _, end = _DECODER.raw_decode(line, i)
            if _utf8(key) == field:
                found = (i, end)
            i = _SPACE.match(line, end).end()  # type: ignore[union-attr]
            if line[i : i + 1] == ",":
                i = _SPACE.match(line, i + 1).end()  # type: ignore[union-attr]
                continue
            if line[i : i + 1] != "}":
                raise ValueError(f"',' or '}}' was expected at byte {i}")
            i += 1
            break
    if line[i:].strip(" \t\n\r"):
        raise ValueError(f"there is more after the object, at byte {i}")
    return found


def _utf8(key: str) -> str:
    try:
        return key.encode("latin-1").decode("utf-8")
    except (UnicodeEncodeError, UnicodeDecodeError):
        return key  # escaped characters: scanstring decoded them already


def _check_value(spec: TextSpec, value: Any) -> str | None:
    """Why ``value`` is not a document of ``spec``'s kind, or None."""
    if spec.kind == "text":
        return None if isinstance(value, str) else f"a string, not {type(value).__name__}"
    ok = isinstance(value, list) and all(
        isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
        for m in value
    )
    return None if ok else 'a list of {"role": string, "content": string} messages'


def _documents(
    shard: Shard, spec: TextSpec, split: str, skipped: list[str]
) -> Iterator[tuple[tuple[Any, ...], bytes]]:
    """Each non-empty document of one file: (the row without its length, the value's bytes)."""
    flag = "--text" if spec.kind == "text" else "--messages"
    with shard.open() as opened:
        # An object's file is a raw one: its lines are read through a buffer.
        f: IO[bytes] = opened
        if isinstance(opened, io.RawIOBase):
            f = io.BufferedReader(opened, 1 << 22)
        offset = 0
        for number, raw in enumerate(f, 1):
            start, offset = offset, offset + len(raw)
            if not raw.strip():
                continue
            where = f"{shard.where}, line {number}"
            try:
                span = field_span(raw.decode("latin-1"), spec.field)
                if span is None:
                    raise ValueError(f"it has no field {spec.field!r} ({flag})")
                value_bytes = raw[span[0] : span[1]]
                value = json.loads(value_bytes)
            except ValueError as e:
                raise DataError(f"{where}: {e}; each line must be a JSON object") from e
            wrong = _check_value(spec, value)
            if wrong is not None:
                raise DataError(
                    f"{where}: field {spec.field!r} ({flag}) holds {str(value)[:60]!r}; it must "
                    f"be {wrong}"
                )
            if not value:
                skipped.append(f"{where}: an empty document (left out: it has no tokens)")
                continue
            key = f"{shard.rel}#{number}"
            row = (key, shard.rel, start + span[0], span[1] - span[0], None, split)
            yield row, value_bytes


def _row(line: int, row: tuple[Any, ...], length: int | None) -> Row:
    key, rel, offset, nbytes, label, split = row
    return (line, key, rel, offset, nbytes, label, split, length, 1.0, None, True, nbytes)


def ingest_jsonl(
    engine: Engine,
    *,
    dataset: str,
    version: str = "1",
    root: str | Path,
    files: list[str],
    split: str,
    text: str | None = None,
    messages: str | None = None,
    tokenizer: str | None = None,
    template: str | None = None,
    workers: int | None = None,
    description: str | None = None,
    progress: Callable[[int, int, int], None] | None = None,
    object_store_retry_s: float = DEFAULT_RETRY_S,
) -> IngestReport:
    """Add the documents of JSONL files (see the module docs).

    Args:
        root: A local directory or ``s3://BUCKET/PREFIX``.
        files: Paths, globs or brace ranges relative to ``root``.
        split: The split of every document.
        text, messages: The field of each line's document: text, or chat messages (one).
        tokenizer: A tokenizer.json: record each document's token count (for packing).
        template: A Jinja chat template file (``messages`` only); default the tokenizer's.
        workers: Processes that count tokens; default the CPUs this process may use.

    Raises:
        DataError: a bad line (file and line named; nothing is written), a pattern that
            matches nothing, or a tokenizer that cannot be used.
    """
    check_name("split", split, SPLIT_MAX_CHARS)
    if (text is None) == (messages is None):
        raise DataError("name the documents' field: --text FIELD or --messages FIELD (one)")
    if template is not None and messages is None:
        raise DataError("--template renders chat messages; it goes with --messages")
    template_text = Path(template).expanduser().read_text("utf-8") if template else None
    spec = TextSpec(
        kind="text" if text is not None else "chat",
        field=text if text is not None else str(messages),
        tokenizer=tokenizer,
        template=template_text,
    )
    stored_root, found = find_files(root, files, object_store_retry_s=object_store_retry_s)
    skipped: list[str] = []
    files_done = [0]

    def documents() -> Iterator[tuple[tuple[Any, ...], bytes]]:
        for shard in found:
            yield from _documents(shard, spec, split, skipped)
            files_done[0] += 1

    counter = TokenCounter(spec, workers) if tokenizer is not None else None
    identity = counter.identity if counter is not None else ""

    def rows() -> Iterator[Row]:
        line = 0
        if counter is None:
            for line, (row, _) in enumerate(documents(), 1):
                yield _row(line, row, None)
        else:
            chunks = (([r for r, _ in c], [d for _, d in c]) for c in chunked(documents()))
            with counter:
                for metas, counts in counter.counted(chunks):
                    for row, count in zip(metas, counts, strict=True):
                        line += 1
                        if isinstance(count, str):
                            raise DataError(f"{stored_root}/{row[1]}, {row[0]}: {count}")
                        yield _row(line, row, count)
                    if progress is not None and files_done[0] < len(found):
                        progress(files_done[0], len(found), line)
        if progress is not None:
            progress(len(found), len(found), line)

    report = load(
        engine,
        Target(dataset, version, description),
        Source(
            root=stored_root,
            rows=rows(),
            empty=f"no documents in {len(found)} JSONL file(s) under {stored_root}",
            attrs_update=lambda ref, attrs: text_attrs(ref, attrs, spec, identity),
        ),
    )
    shown = skipped[:_SKIPPED_SHOWN]
    if len(skipped) > len(shown):
        shown.append(f"... and {len(skipped) - len(shown)} more")
    return replace(report, skipped=tuple(shown)) if shown else report
