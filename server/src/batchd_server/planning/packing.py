"""Sequence packing: an epoch's documents as rows of ``seq_len`` tokens, planned up front.

NOTE [ Packed rows ]
~~~~~~~~~~~~~~~~~~~~
The catalog knows every document's length (its ``length`` column, else its byte range over
the token size), truncated to the Tokens pipeline's ``max_len``. So before an epoch starts the
server packs the epoch's documents, in the epoch's order, into *rows* of ``seq_len`` tokens;
a row is a list of *pieces* (document position, first token, tokens). From then on a row is
what a sample was: the rows are the units of the epoch's global order, dealt to the ranks a
``batch_size`` at a time, truncated (``drop_last``) or padded by wrapping around, and resumed
from a global cursor counted in rows (``sampling.rest_of_order``), so exactly-once, the tail
rule, resume and elastic resume carry over unchanged.

*Methods.* ``best_fit`` and ``first_fit``: a document longer than ``seq_len`` is cut into
whole ``seq_len`` pieces (each a full row) and its remainder; the remainders are placed
longest first (ties in the epoch's order), each into the fullest row it fits
(``best_fit``) or the first opened row it fits (``first_fit``), a new row when none has
room: best-fit- and first-fit-decreasing over the whole epoch, which leave far less padding
than packing a stream through a few open bins. ``concat``: the documents in the epoch's order,
concatenated and cut every ``seq_len`` tokens (only the epoch's last row is padded).

*The row count is the same every epoch.* Clients count an epoch's batches from one number of
rows per session (``_wire.epoch``). A method whose rows depend only on the multiset of the
documents' lengths gives that: the decreasing methods place lengths in an order fixed by the
lengths alone (which document of a length takes which place follows the epoch's order), and
``concat`` makes ceil(tokens / seq_len) rows. Each epoch serves every document once, so the
multiset is the epoch's own. This is why the weighted sampling modes (draws with
replacement) cannot be packed, and why a mix packs each source over all its documents and
mixes *rows* (``plan_mix_epoch`` over each source's rows, a schedule included): its weights
are shares of rows (of tokens, nearly), and ``stop`` counts rows.

*Row order.* Rows follow the epoch's document order: a row comes where its earliest
document does, and within a row its pieces are in the epoch's order, so a shuffled epoch
serves shuffled rows and an unshuffled one serves the documents roughly in id order.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any, Final, TypeAlias

import numpy as np

from batchd._wire.pack import MAX_SEQ_LEN, MIN_SEQ_LEN, PACK_METHODS
from batchd_server.errors import InvalidArgument
from batchd_server.pipelines.registry import build_pipeline
from batchd_server.pipelines.tokens import TokensPipeline
from batchd_server.planning.mixing import (
    Mixing,
    MixOptions,
    MixSourceOptions,
    deal_blocks,
    plan_mix_epoch,
    source_starts,
)
from batchd_server.planning.placement import place, place_lengths
from batchd_server.planning.sampling import (
    EpochPlan,
    EpochStart,
    Int64Array,
    SamplerOptions,
    epoch_order,
    num_batches,
)
from batchd_server.planning.sampling import rest_of_order as rest_of_global_order

if TYPE_CHECKING:
    from batchd_server.catalog.types import SplitArrays

__all__ = [
    "MAX_PACK_PIECES",
    "PACK_TAG",
    "LengthRule",
    "PackOptions",
    "PackedMixing",
    "PackedPlan",
    "PackedRows",
    "document_lengths",
    "pack_documents",
    "pack_pieces",
    "packed_mixing",
    "placements",
    "source_lengths",
    "source_tokens",
]

LengthRule: TypeAlias = "tuple[int, int] | Callable[[SplitArrays], Int64Array]"
"""How a source's documents' lengths are found: (token size in bytes, max_len) of a Tokens
pipeline's records, or a function of the split (a Text pipeline's ``packing_lengths``, from
the counts its tokenizer recorded at ingest)."""
PACK_TAG: Final = 5
"""A packed mix's per-source document orders (a random stream's purpose tag; see sampling)."""
MAX_PACK_PIECES: Final = 1 << 26
"""Pieces (a document, or a ``seq_len`` piece of one) a session's sources may pack into, in
all: each costs the plan some 100 bytes per epoch kept, and its placement a step."""
PIECE_COLUMNS: Final = 4
"""A task's piece: (row in the batch, document position, first token, tokens), int64."""


@dataclass(frozen=True, kw_only=True)
class PackOptions:
    """How a session packs its documents, validated on construction.

    Raises:
        InvalidArgument: ``seq_len`` out of range or an unknown method.
    """

    seq_len: int
    """Tokens per row, ``MIN_SEQ_LEN`` to ``MAX_SEQ_LEN``."""
    method: str = "best_fit"
    """One of ``PACK_METHODS``."""

    def __post_init__(self) -> None:
        seq_len = self.seq_len
        if isinstance(seq_len, bool) or not isinstance(seq_len, int):
            raise InvalidArgument(f"pack seq_len={seq_len!r} must be an integer")
        if not MIN_SEQ_LEN <= seq_len <= MAX_SEQ_LEN:
            raise InvalidArgument(
                f"pack seq_len={seq_len} must be from {MIN_SEQ_LEN} to {MAX_SEQ_LEN} (a row "
                f"of fewer than {MIN_SEQ_LEN} tokens is no training sequence)"
            )
        if self.method not in PACK_METHODS:
            raise InvalidArgument(
                f"pack method={self.method!r} is unknown; use one of {', '.join(PACK_METHODS)}"
            )


@dataclass(frozen=True, eq=False)
class PackedRows:
    """An epoch's rows: row i's pieces are ``[row_offsets[i], row_offsets[i + 1])`` of the
    piece columns (document position, first token, tokens), in the order they fill the row."""

    row_offsets: Int64Array
    positions: Int64Array
    starts: Int64Array
    lengths: Int64Array

    def __post_init__(self) -> None:
        assert self.row_offsets[0] == 0 and self.row_offsets[-1] == self.positions.size
        for array in (self.row_offsets, self.positions, self.starts, self.lengths):
            array.setflags(write=False)

    @property
    def rows(self) -> int:
        return self.row_offsets.size - 1

    def pieces(self, rows: Int64Array) -> Int64Array:
        """The pieces of ``rows`` (row indexes, any order, repeats allowed) as a task's
        ``(pieces, PIECE_COLUMNS)`` table: the index into ``rows``, then the piece."""
        first = self.row_offsets[rows]
        counts = self.row_offsets[rows + 1] - first
        total = int(counts.sum())
        owner = np.repeat(np.arange(rows.size, dtype=np.int64), counts)
        before = np.cumsum(counts) - counts
        index = np.repeat(first - before, counts) + np.arange(total, dtype=np.int64)
        table = np.empty((total, PIECE_COLUMNS), np.int64)
        table[:, 0] = owner
        table[:, 1] = self.positions[index]
        table[:, 2] = self.starts[index]
        table[:, 3] = self.lengths[index]
        return table

    def shifted(self, by: int) -> PackedRows:
        """These rows with every document position plus ``by`` (a mix's later source)."""
        return replace(self, positions=self.positions + by)


class PackedPlan(EpochPlan):
    """A rank's batches of packed rows: ``positions`` are row indexes into ``rows``, and
    ``batch(k)`` is batch k's pieces, flattened (``PackedRows.pieces``): what a task carries."""

    def __init__(self, plan: EpochPlan, rows: PackedRows) -> None:
        super().__init__(plan.positions, plan.batch_size, plan.num_batches)
        object.__setattr__(self, "rows", rows)

    rows: PackedRows

    def batch(self, k: int) -> Int64Array:
        return self.rows.pieces(super().batch(k)).reshape(-1)

    def catalog_plan(self) -> EpochPlan:
        """The documents each batch's pieces read, batch by batch: every batch padded to the
        most documents any has by repeating its last (a repeat reads nothing more). Made
        once per plan."""
        made: EpochPlan | None = self.__dict__.get("_catalog_plan")
        if made is not None:
            return made
        table = self.rows.pieces(self.positions)
        documents = table[:, 1]
        batch_of = table[:, 0] // self.batch_size
        counts = np.bincount(batch_of, minlength=self.num_batches)
        width = max(int(counts.max(initial=0)), 1)
        starts = np.cumsum(counts) - counts
        grid = np.zeros((self.num_batches, width), np.int64)
        if documents.size:
            grid[:] = documents[np.maximum(starts + counts - 1, 0)][:, None]
            grid[batch_of, np.arange(documents.size) - starts[batch_of]] = documents
        made = EpochPlan(grid.reshape(-1), width, self.num_batches)
        object.__setattr__(self, "_catalog_plan", made)
        return made


def document_lengths(split: SplitArrays, itemsize: int, max_len: int) -> Int64Array:
    """Each document's tokens as the Tokens pipeline will read them: the catalog's
    ``length``, else its byte range over ``itemsize``, at most ``max_len``.

    Raises:
        InvalidArgument: a document has neither (a whole-file sample without a length).
    """
    lengths = split.lengths.astype(np.int64)
    unknown = lengths < 0
    if unknown.any():
        # A Parquet row's byte range is its row group's payload chunk, not its tokens.
        from_bytes = np.where(split.row_groups >= 0, -1, split.byte_lengths // itemsize)
        lengths = np.where(unknown, from_bytes, lengths)
        missing = int(np.count_nonzero(lengths < 0))
        if missing:
            first = int(np.flatnonzero(lengths < 0)[0])
            raise InvalidArgument(
                f"{missing} of {len(split)} documents of {split.dataset.name}:{split.split} have "
                f"no length (the first: {split.path(first)!r}), and packing needs every "
                "document's length before the epoch; give 'length' (tokens) in the manifest "
                "(ingest parquet: --length, or a list payload), or ingest the tokens as "
                "byte-range records"
            )
    np.minimum(lengths, max_len, out=lengths)
    return lengths


def pack_documents(
    order: Int64Array,
    lengths: Int64Array,
    pack: PackOptions,
    *,
    places: Int64Array | None = None,
) -> PackedRows:
    """Pack the documents at ``order`` (positions, in the epoch's order) into rows; see
    NOTE [ Packed rows ]. ``lengths[p]`` is position p's tokens (0: the document is left
    out, it has nothing to serve).

    ``places``: ``placements(lengths, pack)`` of the same documents (in any order), to skip
    placing the lengths again: the places depend on the lengths alone."""
    seq_len = pack.seq_len
    order = order[lengths[order] > 0]
    sizes = lengths[order]
    if pack.method == "concat":
        return _concat(order, sizes, seq_len)
    full = sizes // seq_len
    rest = sizes % seq_len
    # Whole pieces: each its own row, the document's pieces in token order.
    whole_index = np.repeat(np.arange(order.size, dtype=np.int64), full)
    whole_start = (
        np.arange(whole_index.size, dtype=np.int64) - np.repeat(np.cumsum(full) - full, full)
    ) * seq_len
    # The remainders, longest first (ties in the epoch's order): which document takes which
    # place depends on the order, where the places are depends on the lengths alone.
    items = np.flatnonzero(rest)
    items = items[np.argsort(-rest[items], kind="stable")]
    if places is None:
        places = place(rest[items], pack.method, pack.seq_len)
    assert places.size == items.size, "places of these documents' lengths"
    item_rows = places
    opened = int(item_rows.max()) + 1 if item_rows.size else 0
    index = np.concatenate([items, whole_index])
    start = np.concatenate([full[items] * seq_len, whole_start])
    count = np.concatenate([rest[items], np.full(whole_index.size, seq_len, np.int64)])
    row = np.concatenate([item_rows, opened + np.arange(whole_index.size, dtype=np.int64)])
    return _ordered_rows(order, index, start, count, row, opened + whole_index.size)


def placements(lengths: Int64Array, pack: PackOptions) -> Int64Array | None:
    """The row of each remainder, longest first, for documents of these ``lengths``: what
    every order of them shares (None for ``concat``, which places nothing). Kept in
    ``placement.PLACEMENT_CACHE``, for every session that packs the same lengths."""
    if pack.method == "concat":
        return None
    return place_lengths(lengths, pack.method, pack.seq_len)


def pack_pieces(lengths: Sequence[Int64Array], pack: PackOptions) -> tuple[int, int]:
    """Pieces and rows (at most) that packing documents of these ``lengths`` (one array per
    source) makes: ``concat`` cuts a piece at every row's start besides every document's.

    Raises:
        InvalidArgument: more than ``MAX_PACK_PIECES`` pieces; the message names the
            smallest ``seq_len`` that packs these documents within the bound.
    """
    pieces, rows = _pieces(lengths, pack.seq_len, pack.method)
    if pieces <= MAX_PACK_PIECES:
        return pieces, rows
    low, high = pack.seq_len, MAX_SEQ_LEN + 1
    while low < high:
        mid = (low + high) // 2
        if _pieces(lengths, mid, pack.method)[0] <= MAX_PACK_PIECES:
            high = mid
        else:
            low = mid + 1
    documents = sum(int(np.count_nonzero(n)) for n in lengths)
    remedy = (
        f"use seq_len >= {low}"
        if low <= MAX_SEQ_LEN
        else "pack fewer documents per session (a split of them, or fewer mix sources)"
    )
    raise InvalidArgument(
        f"pack seq_len={pack.seq_len} cuts these {documents} documents into {pieces} pieces, "
        f"more than the {MAX_PACK_PIECES} a session may pack; {remedy}"
    )


def _pieces(lengths: Sequence[Int64Array], seq_len: int, method: str) -> tuple[int, int]:
    pieces = rows = 0
    for n in lengths:
        whole = int(np.sum(-(-n // seq_len)))
        if method == "concat":
            cut = -(-int(n.sum()) // seq_len)
            rows += cut
            pieces += int(np.count_nonzero(n)) + cut
        else:
            pieces += whole
            rows += whole
    return pieces, rows


def _ordered_rows(
    order: Int64Array,
    index: Int64Array,
    start: Int64Array,
    count: Int64Array,
    row: Int64Array,
    rows: int,
) -> PackedRows:
    """Rows in the order of their earliest piece (its index into ``order``, then its first
    token), each row's pieces in the epoch's order."""
    by_row = np.lexsort((start, index, row))
    index, start, count, row = index[by_row], start[by_row], count[by_row], row[by_row]
    sizes = np.bincount(row, minlength=rows)
    first = np.cumsum(sizes) - sizes
    row_order = np.lexsort((start[first], index[first]))
    rank = np.empty(rows, np.int64)
    rank[row_order] = np.arange(rows, dtype=np.int64)
    final = np.lexsort((start, index, rank[row]))
    offsets = np.zeros(rows + 1, np.int64)
    np.cumsum(sizes[row_order], out=offsets[1:])
    return PackedRows(offsets, order[index[final]], start[final], count[final])


def _concat(order: Int64Array, sizes: Int64Array, seq_len: int) -> PackedRows:
    ends = np.cumsum(sizes)
    total = int(ends[-1]) if ends.size else 0
    doc_starts = ends - sizes
    rows = -(-total // seq_len)
    # Both are sorted: a merge by one sort, then the repeats (a document that starts a row)
    # dropped; np.union1d would hash them, holding the GIL for seconds at a million.
    cuts = np.concatenate([doc_starts, np.arange(rows, dtype=np.int64) * seq_len])
    cuts.sort()
    cuts = cuts[np.concatenate([[True], cuts[1:] != cuts[:-1]])] if cuts.size else cuts
    cuts = cuts[cuts < total]
    lengths = np.diff(np.append(cuts, total))
    doc = np.searchsorted(doc_starts, cuts, side="right") - 1
    row = cuts // seq_len
    offsets = np.zeros(rows + 1, np.int64)
    np.cumsum(np.bincount(row, minlength=rows), out=offsets[1:])
    return PackedRows(offsets, order[doc], cuts - doc_starts[doc], lengths.astype(np.int64))


@dataclass(eq=False)
class PackedMixing:
    """A session's ``Mixing`` with its documents packed into rows (NOTE [ Packed rows ]):
    the inner mixing's sources, pins and tokens, with rows as its items.

    Args:
        inner: The session's sources: one split (``OneSplit``) or a ``MixOptions``.
        pack: How to pack.
        splits: Each source's split arrays, in order.
        tokens: Each source's (token size in bytes, max_len), from its Tokens pipeline; or
            what gives its documents' lengths (a Text pipeline's ``packing_lengths``).

    Raises:
        InvalidArgument: a document without a length, or too many pieces (``pack_pieces``).
    """

    inner: Mixing
    pack: PackOptions
    splits: Sequence[SplitArrays]
    tokens: Sequence[LengthRule]
    _lengths: list[Int64Array] = field(init=False)
    _places: list[Int64Array | None] = field(init=False)
    _rows: dict[tuple[int, int, bool], list[PackedRows]] = field(init=False, default_factory=dict)

    def __post_init__(self) -> None:
        assert len(self.splits) == len(self.tokens) == len(self.inner.sources)
        self._lengths = [
            source_lengths(split, rule)
            for split, rule in zip(self.splits, self.tokens, strict=True)
        ]
        pack_pieces(self._lengths, self.pack)
        # Where the lengths go, and so the rows, are the same every epoch (NOTE [ Packed
        # rows ]): placed once, each epoch only assigns its documents to the places.
        self._places = [placements(n, self.pack) for n in self._lengths]
        self.source_rows = tuple(
            pack_documents(np.arange(n.size, dtype=np.int64), n, self.pack, places=p).rows
            for n, p in zip(self._lengths, self._places, strict=True)
        )

    @property
    def sources(self) -> tuple[MixSourceOptions, ...]:
        return self.inner.sources

    @property
    def labels_rows(self) -> bool:
        return self.inner.labels_rows

    def counts(self, sizes: Sequence[int]) -> tuple[int, ...]:
        """Rows of each source in one epoch (all ranks): all its rows, or a mix's share."""
        del sizes  # documents; the rows are what an epoch counts
        if isinstance(self.inner, MixOptions):
            return self.inner.counts(self.source_rows)
        return self.source_rows

    def plan(
        self, splits: Sequence[SplitArrays], options: SamplerOptions, at: EpochStart
    ) -> EpochPlan:
        """This rank's rows of the epoch from global row ``at.start`` on."""
        if options.mode != "uniform":
            raise InvalidArgument(
                f"sampling={options.mode!r} cannot be packed: packing serves every document of "
                "an epoch once; use sampling='uniform'"
            )
        per_source = self._epoch_rows(options, at.epoch)
        doc_starts = source_starts([len(s) for s in splits])
        table = _concatenate(
            [rows.shifted(int(d)) for rows, d in zip(per_source, doc_starts, strict=True)]
        )
        if isinstance(self.inner, MixOptions):
            # The mix's own plan, over rows instead of documents (a schedule included).
            rows_plan = plan_mix_epoch(
                self.source_rows,
                self.inner,
                options,
                at.epoch,
                start=at.start,
                order_world_size=at.order_world_size,
                rotation=at.rotation,
            )
            return PackedPlan(rows_plan, table)
        order = np.arange(table.rows, dtype=np.int64)
        rest = rest_of_global_order(order, options, start=at.start, rotation=at.rotation)
        plan = deal_blocks(rest, options, num_batches(order.size, options, start=at.start))
        return PackedPlan(plan, table)

    def _epoch_rows(self, options: SamplerOptions, epoch: int) -> list[PackedRows]:
        key = (options.seed, epoch, options.shuffle)
        cached = self._rows.get(key)
        if cached is not None:
            return cached
        rows = []
        for s, lengths in enumerate(self._lengths):
            order = self._order(s, lengths.size, options, epoch)
            rows.append(pack_documents(order, lengths, self.pack, places=self._places[s]))
        while len(self._rows) >= 2:
            self._rows.pop(next(iter(self._rows)))
        self._rows[key] = rows
        return rows

    def _order(self, s: int, n: int, options: SamplerOptions, epoch: int) -> Int64Array:
        """Source ``s``'s documents in the epoch's order: a split's own epoch order, or a
        mix source's permutation of (seed, epoch, source)."""
        if not isinstance(self.inner, MixOptions):
            whole = replace(options, rank=0, world_size=1, drop_last=False)
            return epoch_order(n, whole, epoch)
        if not options.shuffle:
            return np.arange(n, dtype=np.int64)
        sequence = np.random.SeedSequence([options.seed, epoch, PACK_TAG, s])
        return np.random.Generator(np.random.PCG64(sequence)).permutation(n).astype(np.int64)

    def pins(self, token: str | None) -> Sequence[tuple[str | None, str | None]]:
        return self.inner.pins(token)

    def token(self, pins: Sequence[tuple[str, str]]) -> str:
        return self.inner.token(pins)


def _concatenate(parts: Sequence[PackedRows]) -> PackedRows:
    """The sources' rows one after another (source s's row i is row ``source_starts(rows)[s]
    + i``)."""
    if len(parts) == 1:
        return parts[0]
    piece_starts = np.cumsum([0, *(p.positions.size for p in parts[:-1])])
    offsets = np.concatenate(
        [[0], *(p.row_offsets[1:] + int(b) for p, b in zip(parts, piece_starts, strict=True))]
    ).astype(np.int64)
    return PackedRows(
        offsets,
        np.concatenate([p.positions for p in parts]),
        np.concatenate([p.starts for p in parts]),
        np.concatenate([p.lengths for p in parts]),
    )


def packed_mixing(
    mixing: Mixing,
    pack: PackOptions | None,
    pipeline: tuple[str, dict[str, Any]],
    splits: Sequence[SplitArrays],
) -> Mixing:
    """A session's mixing: ``mixing`` itself, or packed when ``pack`` is given.

    Args:
        pipeline: The session's pipeline (kind, options): it decodes every source without
            one of its own.

    Raises:
        InvalidArgument: a source's pipeline is not a Tokens pipeline, or a document has no
            length.
    """
    if pack is None:
        return mixing
    return PackedMixing(mixing, pack, splits, source_tokens(mixing, pipeline))


def source_lengths(split: SplitArrays, rule: LengthRule) -> Int64Array:
    """The lengths of ``split``'s documents by ``rule``."""
    return rule(split) if callable(rule) else document_lengths(split, *rule)


def source_tokens(mixing: Mixing, pipeline: tuple[str, dict[str, Any]]) -> list[LengthRule]:
    """Each source's :data:`LengthRule`, from its Tokens (or Text) pipeline (or the
    session's ``pipeline``).

    Raises:
        InvalidArgument: a source's pipeline is not a Tokens pipeline.
    """
    tokens: list[LengthRule] = []
    for source in mixing.sources:
        kind, options = (
            (source.pipeline_kind, source.pipeline_options) if source.pipeline_kind else pipeline
        )
        built = build_pipeline(kind, options)
        if not isinstance(built, TokensPipeline):
            raise InvalidArgument(
                f"pack needs a tokens pipeline, but {source.name!r} is decoded by a {kind!r} "
                "pipeline; pass pipeline=batchd.Tokens(max_len=..., dtype=...) with "
                "pack=batchd.Pack(...)"
            )
        # Text is counted by its tokenizer at ingest (pipelines/text.py), tokens by their bytes.
        counted = getattr(built, "packing_lengths", None)
        tokens.append(counted or (built.dtype.itemsize, built.max_len))
    return tokens
