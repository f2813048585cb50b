"""A packed session's pipeline: rows of ``seq_len`` tokens, filled from the pieces a task
names, written in place.

:func:`session_pipeline` is where a session's pipeline is built, on the server (its fields
make the ring's layout) and in each worker: the decoding pipeline itself, or, for a packed
session, :class:`PackedPipeline` around its Tokens pipeline. Its fill (:func:`run_packed`)
reads through the same row readers as every session (``workers/rows.py``: local files,
objects through the node cache, Parquet rows), and a document read on its own goes through
the decode cache where the session has one.

A packed session's task carries its batch's pieces (``planning.packing.PackedRows.pieces``):
for each, the row of the batch, the document's position (global over the sources), its
first token and how many. The worker reads exactly those tokens (a byte range inside the
document's record or file: a document cut into several pieces is never read whole) and
writes every field of the batch once, vectorised over the batch's tokens:

- ``input_ids`` ``(rows, seq_len)``: the tokens, ``pad_id`` after each row's last piece;
- ``position_ids`` int32: each token's position in its document (a later piece of a long
  document continues where the earlier one stopped), 0 on padding;
- ``segment_ids`` int32: 1, 2, ... for the pieces of a row, 0 on padding;
- ``document_id`` int64: the catalog sample id of each token, -1 on padding;
- ``cu_seqlens`` int32 ``(segments + 1,)``: the boundaries of every piece and of every row's
  padding over the flattened ``(rows * seq_len)`` batch, for varlen attention kernels;
- ``length`` int32 ``(rows,)``: each row's tokens before its padding;
- ``sample_id``, ``label`` (and ``source`` in a mix): of each row's first document.

A text session's documents (``pipelines/text.py``) are tokenized, not stored as tokens: the
worker reads each document of the batch whole, once, tokenizes them together and cuts the
pieces from their tokens; a chat session's rows carry its ``loss_mask`` beside ``input_ids``
(0 on padding), cut the same way.

A piece that cannot be read (or whose document holds fewer tokens than the catalog said)
is a bad sample of its document: under ``on_error="raise"`` the batch fails; under "skip"
and "replace" the piece is left out and its row ends earlier (a packed row has no room for a
substitute's other length).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from functools import partial
from typing import Any, Final, Protocol

import numpy as np
import numpy.typing as npt

from batchd_server.catalog.types import SampleColumns
from batchd_server.errors import InvalidArgument
from batchd_server.pipelines.base import BadSample, Block, FieldSpec, Pipeline, SampleInfo
from batchd_server.pipelines.text import TextPipeline
from batchd_server.pipelines.tokens import TokensPipeline
from batchd_server.planning.packing import PackOptions
from batchd_server.workers.fields import SampleField
from batchd_server.workers.task import SOURCE_FIELD, BatchTask, Filled, SampleFailure, SessionSpec

__all__ = [
    "PackedContext",
    "PackedPipeline",
    "packed_fill",
    "run_packed",
    "session_pipeline",
    "tokens_of",
]

_ROW_FIELDS: Final = ("input_ids", "position_ids", "segment_ids", "document_id")
"""The packed fields of shape ``(rows, seq_len)``."""
KEPT_TOKENS: Final = 1 << 22
"""Tokens of partly used documents a worker keeps per text session (16 MiB of int32)."""


class _Source(Protocol):
    columns: SampleColumns
    fields: tuple[SampleField, ...]

    def path(self, position: int) -> str: ...


class PackedContext(Protocol):
    """What filling packed rows needs of a worker's ``SessionContext``."""

    spec: SessionSpec
    where: npt.NDArray[np.int64]

    def slot_block(self, slot: int) -> Block: ...

    def locate(self, position: int) -> tuple[_Source, int]: ...

    def piece_ids(
        self, positions: npt.NDArray[np.int64]
    ) -> tuple[npt.NDArray[np.int64], npt.NDArray[np.int64], npt.NDArray[np.int64]]: ...


def tokens_of(pipeline: Pipeline, what: str = "the session's pipeline") -> TokensPipeline:
    """``pipeline`` as the Tokens pipeline packing needs.

    Raises:
        InvalidArgument: it is another kind, saying what to pass.
    """
    if not isinstance(pipeline, TokensPipeline):
        raise InvalidArgument(
            f"pack needs a tokens pipeline, but {what} is a {type(pipeline).__name__}; pass "
            "pipeline=batchd.Tokens(max_len=..., dtype=...) with pack=batchd.Pack(...)"
        )
    return pipeline


class PackedPipeline(Pipeline):
    """A packed session's batches: rows of ``seq_len`` tokens cut from documents that
    ``tokens`` decodes (see the module docs for the fields).

    Raises:
        InvalidArgument: ``tokens`` is not a Tokens pipeline.
    """

    def __init__(self, tokens: Pipeline, seq_len: int) -> None:
        self.tokens = tokens_of(tokens)
        self.seq_len = seq_len
        self.masked = any(f.name == "loss_mask" for f in self.tokens.fields())
        """The documents' tokens have a loss mask (chat), which the rows carry."""
        self.read: Callable[..., Read] = (
            partial(_read_encoded, held=KeptDocuments())
            if isinstance(self.tokens, TextPipeline)
            else _read_pieces
        )
        """How the pieces' tokens are had: their bytes (token records) or their documents'
        encodings (text)."""

    def fields(self) -> list[FieldSpec]:
        """A packed batch's fields (one row's shape at most)."""
        seq_len, int32 = self.seq_len, np.dtype("<i4")
        return [
            FieldSpec("input_ids", self.tokens.dtype, (seq_len,)),
            FieldSpec("position_ids", int32, (seq_len,)),
            FieldSpec("segment_ids", int32, (seq_len,)),
            FieldSpec("document_id", np.dtype("<i8"), (seq_len,)),
            # At most one piece per token plus the row's padding, over all rows: seq_len + 1
            # a row is room enough for ``rows * seq_len + 1`` boundaries.
            FieldSpec("cu_seqlens", int32, (seq_len + 1,)),
            # Each row's tokens before padding: what a mix's per-source accounting sums.
            FieldSpec("length", int32, ()),
            *([FieldSpec("loss_mask", np.dtype(np.uint8), (seq_len,))] if self.masked else []),
        ]

    def decode_into(self, data: memoryview, sample: SampleInfo, row: Block) -> None:
        """A document's tokens, as its Tokens pipeline decodes them (packing cuts them)."""
        self.tokens.decode_into(data, sample, row)


def session_pipeline(decoder: Pipeline, pack: PackOptions | None) -> Pipeline:
    """A session's pipeline, built once where the session is: ``decoder`` (what decodes its
    samples), or its packed rows when the session packs.

    Raises:
        InvalidArgument: ``pack`` is given and ``decoder`` is not a Tokens pipeline.
    """
    return decoder if pack is None else PackedPipeline(decoder, pack.seq_len)


def packed_fill(context: PackedContext, pipeline: Pipeline) -> Callable[[BatchTask], Filled] | None:
    """How a worker fills a task's slot for a session whose pipeline is ``pipeline``: its
    packed rows, or None when it is not packed (one row per sample)."""
    if not isinstance(pipeline, PackedPipeline):
        return None
    return partial(run_packed, context, pipeline)


def run_packed(context: PackedContext, packed: PackedPipeline, task: BatchTask) -> Filled:
    """Fill ``task``'s slot with its packed rows (see the module's docs)."""
    started_at = time.monotonic()
    seq_len = packed.seq_len
    pieces = np.frombuffer(task.positions, np.int64).reshape(-1, 4)
    rows = int(pieces[:, 0].max()) + 1 if pieces.size else 0
    block = context.slot_block(task.slot)
    read_start = time.perf_counter()
    pipeline = packed.tokens
    tokens, kept, failures, fatal = packed.read(context, pipeline, task, pieces)
    decode_start = time.perf_counter()
    boundaries = 0
    if not fatal:
        boundaries = _write(context, pipeline, block, pieces[kept], tokens, rows, seq_len)
    done = time.perf_counter()
    shapes: dict[str, tuple[int, ...]] = {
        name: (rows, seq_len) for name in (*_ROW_FIELDS, "loss_mask") if name in block
    }
    shapes["cu_seqlens"] = (boundaries,)
    for name in ("length", "sample_id", "label", SOURCE_FIELD):
        if name in block:
            shapes[name] = (rows,)
    del block
    times = (started_at, decode_start - read_start, done - decode_start, 0.0)
    return rows, shapes, failures, fatal, times


Read = tuple[
    tuple[npt.NDArray[Any], npt.NDArray[np.uint8] | None],
    npt.NDArray[np.bool_],
    list[SampleFailure],
    bool,
]
"""What reading a task's pieces gives: their tokens concatenated (and their loss mask, or
None), which pieces were read, the failures, whether the batch must fail."""


class KeptDocuments:
    """The encodings of documents a task used only part of (a document longer than a row:
    its other pieces are in other rows, often other tasks), kept by this worker for the
    session so that a later task of its own need not tokenize them again; least recently
    used first out past ``max_tokens``."""

    def __init__(self, max_tokens: int = KEPT_TOKENS) -> None:
        self.max_tokens = max_tokens
        self.tokens = 0
        self._kept: dict[int, Any] = {}

    def pop(self, position: int) -> Any:
        found = self._kept.pop(position, None)
        if found is not None:
            self.tokens -= found[0].size
        return found

    def keep(self, position: int, encoded: Any) -> None:
        size = int(encoded[0].size)
        if size > self.max_tokens:
            return
        self.pop(position)
        while self._kept and self.tokens + size > self.max_tokens:
            self.pop(next(iter(self._kept)))
        self._kept[position] = encoded
        self.tokens += size


def _read_pieces(
    context: PackedContext,
    tokens: TokensPipeline,
    task: BatchTask,
    pieces: npt.NDArray[np.int64],
) -> Read:
    """Every piece's tokens, concatenated; which pieces were read; the failures; whether
    the batch must fail (on_error="raise")."""
    if not task.one_by_one and not task.hung:
        together = _read_together(context, tokens, pieces)
        if together is not None:
            return (together, None), np.ones(len(pieces), np.bool_), [], False
    itemsize = tokens.dtype.itemsize
    out: list[npt.NDArray[Any]] = []
    kept = np.ones(len(pieces), np.bool_)
    failures: list[SampleFailure] = []
    hung = set(task.hung)
    for i, (_, position, start, count) in enumerate(pieces.tolist()):
        source, local = context.locate(position)
        columns = source.columns
        context.where[0] = position
        try:
            if position in hung:
                raise BadSample(
                    "timeout",
                    f"{source.path(local)}: reading it hung past the server's task deadline "
                    "(--task-timeout-s) twice; check the file and its file system",
                )
            data = _piece(context, source, local, task.epoch, start, count, itemsize)
            if len(data) != count * itemsize:
                raise BadSample(
                    "shape",
                    f"{source.path(local)}: {len(data)} bytes where the catalog's length "
                    f"promised {count * itemsize}; fix the length column or the file",
                )
            out.append(np.frombuffer(data, tokens.dtype).copy())
        except BadSample as e:
            kept[i] = False
            failures.append(
                SampleFailure(int(columns.ids[local]), source.path(local), e.kind, str(e))
            )
            if context.spec.on_error == "raise":
                return (np.empty(0, tokens.dtype), None), kept, failures, True
    context.where[0] = -1
    joined = np.concatenate(out) if out else np.empty(0, tokens.dtype)
    return (joined, None), kept, failures, False


def _read_encoded(
    context: PackedContext,
    tokens: TokensPipeline,
    task: BatchTask,
    pieces: npt.NDArray[np.int64],
    *,
    held: KeptDocuments,
) -> Read:
    """Every piece's tokens cut from its document's encoding: each document of the batch is
    read whole once (or taken from ``held``), and each source's documents are tokenized
    together (one ``encode_batch``, by the source's own pipeline: JSON values or a Parquet
    column's UTF-8); a document the batch uses only part of is kept for a later task."""
    documents, inverse = np.unique(pieces[:, 1], return_inverse=True)
    located = [context.locate(p) for p in documents.tolist()]
    encoded: dict[int, Any] = {}
    groups: dict[int, list[int]] = {}
    for d, (source, _) in enumerate(located):
        found = held.pop(int(documents[d]))
        if found is not None:
            encoded[d] = found
        else:
            groups.setdefault(id(source), []).append(d)
    for members in groups.values():
        source = located[members[0]][0]
        datas = _documents(context, source, task, documents, located, members, encoded)
        field = source.fields[0]
        text = field.pipeline
        assert isinstance(text, TextPipeline), "a text session's sources are text"
        for d, found in zip(datas, text.encode_documents(list(datas.values())), strict=True):
            if isinstance(found, BadSample):
                found = BadSample(found.kind, f"{source.path(located[d][1])}: {found}")
            encoded[d] = found
    context.where[0] = -1
    used = np.bincount(inverse, weights=pieces[:, 3], minlength=documents.size)
    for d, found in encoded.items():
        if not isinstance(found, BadSample) and used[d] < found[0].size:
            held.keep(int(documents[d]), found)
    out: list[npt.NDArray[Any]] = []
    masks: list[npt.NDArray[np.uint8]] = []
    kept = np.ones(len(pieces), np.bool_)
    failures: list[SampleFailure] = []
    failed: set[int] = set()
    for i, (d, start, count) in enumerate(
        zip(inverse.tolist(), pieces[:, 2].tolist(), pieces[:, 3].tolist(), strict=True)
    ):
        found = encoded[d]
        source, local = located[d]
        if not isinstance(found, BadSample) and start + count > found[0].size:
            found = encoded[d] = BadSample(
                "shape",
                f"{source.path(local)}: tokenizes to {found[0].size} tokens where the catalog's "
                f"count promised {start + count}; its counts are not this tokenizer's: "
                "re-ingest the text with --tokenizer and this tokenizer",
            )
        if isinstance(found, BadSample):
            kept[i] = False
            if d not in failed:
                failed.add(d)
                sample_id = int(source.columns.ids[local])
                failures.append(
                    SampleFailure(sample_id, source.path(local), found.kind, str(found))
                )
            if context.spec.on_error == "raise":
                return (np.empty(0, tokens.dtype), None), kept, failures, True
            continue
        ids, mask = found
        out.append(ids[start : start + count])
        if mask is not None:
            masks.append(mask[start : start + count])
    joined = np.concatenate(out) if out else np.empty(0, tokens.dtype)
    if not masks:
        return (joined, None), kept, failures, False
    return (joined, np.concatenate(masks)), kept, failures, False


def _documents(
    context: PackedContext,
    source: _Source,
    task: BatchTask,
    documents: npt.NDArray[np.int64],
    located: list[tuple[_Source, int]],
    members: list[int],
    failed: dict[int, Any],
) -> dict[int, Any]:
    """The bytes of ``members`` (indexes into ``documents``) of one source, each whole: in
    one batch read where the reader can, else one by one; a document that cannot be read
    goes into ``failed`` (its BadSample) instead."""
    rows = source.fields[0].rows
    local = np.array([located[d][1] for d in members], np.int64)
    hung = set(task.hung)
    if not task.one_by_one and not hung:
        got = rows.read_batch(local)
        if got is not None:
            data, starts, lengths, _ = got
            ends = (starts + lengths).tolist()
            return {
                d: bytes(data[s:e]) for d, s, e in zip(members, starts.tolist(), ends, strict=True)
            }
    datas: dict[int, Any] = {}
    for d, position in zip(members, local.tolist(), strict=True):
        context.where[0] = int(documents[d])
        try:
            if int(documents[d]) in hung:
                raise BadSample(
                    "timeout",
                    f"{source.path(position)}: reading it hung past the server's task deadline "
                    "(--task-timeout-s) twice; check the file and its file system",
                )
            datas[d] = bytes(rows.read(position))
        except BadSample as e:
            failed[d] = e
    return datas


def _piece(
    context: PackedContext,
    source: _Source,
    position: int,
    epoch: int,
    first: int,
    count: int,
    itemsize: int,
) -> memoryview:
    """Tokens ``[first, first + count)`` of the document at ``position``: from its decoded
    tokens where the decode cache holds them (or now holds them: the whole document is read
    and decoded once), else only the piece's own bytes.

    Raises:
        BadSample: the document cannot be read, or holds fewer tokens.
    """
    field = source.fields[0]
    pipeline, cached = field.decoder(position)
    if cached is None:
        return field.rows.read_part(position, first * itemsize, count * itemsize)
    tokens = tokens_of(pipeline, "a source's pipeline")
    columns = source.columns
    info = SampleInfo(
        sample_id=int(columns.ids[position]),
        label=int(columns.labels[position]),
        path=source.path(position),
        length=int(columns.lengths[position]),
        seed=context.spec.seed,
        epoch=epoch,
    )
    row: Block = {
        "input_ids": np.empty(tokens.max_len, tokens.dtype),
        "length": np.zeros((), np.int32),
    }
    offset, length = int(columns.byte_offsets[position]), int(columns.byte_lengths[position])
    cached.decode(info, offset, length, lambda: field.rows.read(position), row)
    kept = row["input_ids"][: int(row["length"])].view(np.uint8)
    return kept[first * itemsize : (first + count) * itemsize].data


def _read_together(
    context: PackedContext, tokens: TokensPipeline, pieces: npt.NDArray[np.int64]
) -> npt.NDArray[Any] | None:
    """Every piece's tokens in a few reads per source (``RowReader.read_parts``), when every
    piece lies inside its document's byte-range record; None when one does not, or a read
    fails: then each piece is read on its own, which finds and reports the bad one."""
    itemsize = tokens.dtype.itemsize
    located = [context.locate(int(p)) for p in pieces[:, 1].tolist()]
    runs: dict[int, list[int]] = {}
    for i, (source, _) in enumerate(located):
        runs.setdefault(id(source), []).append(i)
    parts: dict[int, npt.NDArray[Any]] = {}
    for members in runs.values():
        source = located[members[0]][0]
        local = np.array([located[i][1] for i in members], np.int64)
        first = pieces[members, 2] * itemsize
        count = pieces[members, 3] * itemsize
        got = source.fields[0].rows.read_parts(local, first, count)
        if got is None:
            return None
        data, starts = got
        for i, start, n in zip(members, starts.tolist(), count.tolist(), strict=True):
            parts[i] = data[start : start + n].view(tokens.dtype).copy()
    out = [parts[i] for i in range(len(pieces))]
    return np.concatenate(out) if out else np.empty(0, tokens.dtype)


def _write(
    context: PackedContext,
    pipeline: TokensPipeline,
    block: Block,
    pieces: npt.NDArray[np.int64],
    read: tuple[npt.NDArray[Any], npt.NDArray[np.uint8] | None],
    rows: int,
    seq_len: int,
) -> int:
    """Write the read pieces (in row order) and the padding of ``rows`` rows; the number of
    ``cu_seqlens`` boundaries written."""
    row, start, count = pieces[:, 0], pieces[:, 2], pieces[:, 3]
    area = rows * seq_len
    ids = block["input_ids"].reshape(-1)[:area]
    positions = block["position_ids"].reshape(-1)[:area]
    segments = block["segment_ids"].reshape(-1)[:area]
    documents = block["document_id"].reshape(-1)[:area]
    ids[:] = pipeline.pad_id
    positions[:] = 0
    segments[:] = 0
    documents[:] = -1
    # Each piece's column in its row: the tokens of the row's earlier pieces.
    ends = np.cumsum(count)
    row_first = np.searchsorted(row, row, side="left")
    before_row = (ends - count)[row_first]
    column = ends - count - before_row
    total = int(ends[-1]) if ends.size else 0
    step = np.arange(total, dtype=np.int64)
    local = step - np.repeat(ends - count, count)
    flat = np.repeat(row * seq_len + column, count) + local
    tokens, mask = read
    ids[flat] = tokens
    if mask is not None:
        loss = block["loss_mask"].reshape(-1)[:area]
        loss[:] = 0
        loss[flat] = mask
    positions[flat] = np.repeat(start, count) + local
    segments[flat] = np.repeat(np.arange(len(pieces)) - row_first + 1, count)
    sample_ids, labels, sources = context.piece_ids(pieces[:, 1])
    documents[flat] = np.repeat(sample_ids, count)
    # Each row's first piece names the row.
    firsts = (
        np.flatnonzero(np.r_[True, row[1:] != row[:-1]]) if len(pieces) else np.empty(0, np.int64)
    )
    block["sample_id"][:rows] = -1
    block["label"][:rows] = -1
    block["sample_id"][row[firsts]] = sample_ids[firsts]
    block["label"][row[firsts]] = labels[firsts]
    if SOURCE_FIELD in block:
        block[SOURCE_FIELD][:rows] = -1
        block[SOURCE_FIELD][row[firsts]] = sources[firsts]
    # cu_seqlens: every piece's start, every row's padding start, and each row's end.
    piece_starts = row * seq_len + column
    used = np.bincount(row, weights=count, minlength=rows).astype(np.int64)
    block["length"][:rows] = used
    padding_starts = np.flatnonzero(used < seq_len) * seq_len + used[used < seq_len]
    bounds = np.unique(
        np.concatenate([piece_starts, padding_starts, np.arange(rows + 1) * seq_len])
    )
    block["cu_seqlens"].reshape(-1)[: bounds.size] = bounds
    return int(bounds.size)
