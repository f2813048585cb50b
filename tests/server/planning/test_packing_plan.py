"""The packed plan of NOTE [ Packed rows ] as a pure function: every token of every document
once per epoch across the ranks, rows within seq_len, the same row count for every order,
determinism, resume from a global row cursor at another world size, mixes of rows, and the
options' validation."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from batchd._wire.pack import MIN_SEQ_LEN
from batchd.errors import InvalidArgument
from batchd_server.planning.mixing import MixOptions, MixSourceOptions
from batchd_server.planning.one_split import OneSplit
from batchd_server.planning.packing import (
    PackedMixing,
    PackedRows,
    PackOptions,
    document_lengths,
    pack_documents,
    placements,
)
from batchd_server.planning.sampling import EpochStart, SamplerOptions

PROPERTY = settings(max_examples=120, deadline=None)
METHODS = ("best_fit", "first_fit", "concat")


@dataclass
class _Dataset:
    name: str


@dataclass
class _Split:
    """What packing reads of a split's arrays."""

    lengths: np.ndarray
    byte_lengths: np.ndarray
    dataset: _Dataset
    split: str = "train"
    row_groups: np.ndarray | None = None
    """-1 (no Parquet rows) unless given."""

    def __post_init__(self) -> None:
        if self.row_groups is None:
            self.row_groups = np.full(len(self.lengths), -1, np.int32)

    def __len__(self) -> int:
        return len(self.lengths)

    def path(self, i: int) -> str:
        return f"doc{i}.bin"


def _split(lengths: Any, name: str = "web") -> Any:
    lengths = np.asarray(lengths, np.int32)
    return _Split(lengths, np.full(lengths.size, -1, np.int64), _Dataset(name))


def _long_tailed(n: int, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return np.minimum(rng.lognormal(5.0, 1.1, n).astype(np.int64) + 1, 4000)


def _cover(rows: PackedRows, lengths: np.ndarray, row_ids: Any = None) -> np.ndarray:
    """How often each token of every document (concatenated) is served by ``row_ids``."""
    starts = np.concatenate([[0], np.cumsum(lengths)])
    cover = np.zeros(int(starts[-1]), np.int64)
    ids = range(rows.rows) if row_ids is None else row_ids
    for r in ids:
        a, b = rows.row_offsets[r], rows.row_offsets[r + 1]
        for p, s, n in zip(rows.positions[a:b], rows.starts[a:b], rows.lengths[a:b], strict=True):
            cover[starts[p] + s : starts[p] + s + n] += 1
    return cover


@given(
    lengths=st.lists(st.integers(0, 300), min_size=1, max_size=80),
    seq_len=st.integers(MIN_SEQ_LEN, 128),
    method=st.sampled_from(METHODS),
    seed=st.integers(0, 1000),
)
@PROPERTY
def test_every_token_of_every_document_is_in_exactly_one_row(
    lengths: list[int], seq_len: int, method: str, seed: int
) -> None:
    """Whatever the lengths, seq_len and method: each token once, no row over seq_len, and
    the decreasing methods never split a document shorter than seq_len."""
    n = np.asarray(lengths, np.int64)
    order = np.random.default_rng(seed).permutation(n.size).astype(np.int64)
    rows = pack_documents(order, n, PackOptions(seq_len=seq_len, method=method))
    assert (_cover(rows, n) == 1).all()
    per_row = np.diff(np.concatenate([[0], np.cumsum(rows.lengths)])[rows.row_offsets])
    assert (per_row <= seq_len).all() and (per_row > 0).all()
    if method != "concat":
        for p in np.flatnonzero(n):
            pieces = np.flatnonzero(rows.positions == p)
            assert sorted(rows.lengths[pieces].tolist()) == sorted(
                [seq_len] * int(n[p] // seq_len) + ([int(n[p] % seq_len)] if n[p] % seq_len else [])
            )
    else:
        assert (per_row[:-1] == seq_len).all()


@given(
    lengths=st.lists(st.integers(0, 500), min_size=1, max_size=60),
    seq_len=st.integers(MIN_SEQ_LEN, 200),
    method=st.sampled_from(METHODS),
)
@PROPERTY
def test_the_row_count_does_not_depend_on_the_order(
    lengths: list[int], seq_len: int, method: str
) -> None:
    """Every order of the same documents makes as many rows: a session's row count holds
    for every epoch."""
    n = np.asarray(lengths, np.int64)
    pack = PackOptions(seq_len=seq_len, method=method)
    counts = {
        pack_documents(np.random.default_rng(s).permutation(n.size).astype(np.int64), n, pack).rows
        for s in range(4)
    }
    assert len(counts) == 1


@given(
    lengths=st.lists(st.integers(0, 500), min_size=1, max_size=60),
    seq_len=st.integers(MIN_SEQ_LEN, 200),
    method=st.sampled_from(METHODS),
    seed=st.integers(0, 100),
)
@PROPERTY
def test_places_computed_once_pack_any_order_as_placing_afresh_does(
    lengths: list[int], seq_len: int, method: str, seed: int
) -> None:
    """The places of the lengths, computed from any order once, give every epoch the rows
    packing that epoch afresh gives."""
    n = np.asarray(lengths, np.int64)
    pack = PackOptions(seq_len=seq_len, method=method)
    places = placements(n, pack)
    order = np.random.default_rng(seed).permutation(n.size).astype(np.int64)
    fresh, cached = pack_documents(order, n, pack), pack_documents(order, n, pack, places=places)
    for name in ("row_offsets", "positions", "starts", "lengths"):
        assert np.array_equal(getattr(fresh, name), getattr(cached, name))


def test_rows_follow_the_epochs_order_and_the_plan_is_deterministic() -> None:
    n = _long_tailed(500)
    order = np.random.default_rng(3).permutation(n.size).astype(np.int64)
    pack = PackOptions(seq_len=512)
    a, b = pack_documents(order, n, pack), pack_documents(order.copy(), n, pack)
    for name in ("row_offsets", "positions", "starts", "lengths"):
        assert np.array_equal(getattr(a, name), getattr(b, name))
    rank = np.empty(n.size, np.int64)
    rank[order] = np.arange(n.size)
    earliest = [
        int(rank[a.positions[a.row_offsets[r] : a.row_offsets[r + 1]]].min()) for r in range(a.rows)
    ]
    assert earliest == sorted(earliest)


@pytest.mark.parametrize("method", ["best_fit", "first_fit"])
def test_the_decreasing_methods_pad_under_one_percent_of_long_tailed_documents(method: str) -> None:
    n = _long_tailed(3000)
    for seq_len in (512, 2048):
        rows = pack_documents(
            np.arange(n.size, dtype=np.int64), n, PackOptions(seq_len=seq_len, method=method)
        )
        padding = 1 - n.sum() / (rows.rows * seq_len)
        assert padding < 0.01, (seq_len, padding)


def _options(**kw: Any) -> SamplerOptions:
    return SamplerOptions(**{"batch_size": 4, "seed": 7, **kw})


def _rows_of(plan: Any) -> list[int]:
    return plan.positions.tolist()


@pytest.mark.parametrize("drop_last", [False, True])
@pytest.mark.parametrize("method", METHODS)
def test_ranks_together_serve_every_token_once_and_resume_at_another_world_size(
    method: str, drop_last: bool
) -> None:
    """2 ranks: every row once (the tail padded by wrapping, or dropped); a cursor saved at
    2 ranks resumes at 1 and at 3 ranks with exactly the rows the 2 ranks had left."""
    n = _long_tailed(300, seed=1)
    split = _split(n)
    packed = PackedMixing(
        OneSplit(MixSourceOptions(dataset="web", weight=1.0)),
        PackOptions(seq_len=512, method=method),
        [split],
        [(2, 8192)],
    )
    (total,) = packed.counts([n.size])
    at = EpochStart(2, 0, 2)
    plans = [
        packed.plan([split], _options(rank=r, world_size=2, drop_last=drop_last), at)
        for r in range(2)
    ]
    assert plans[0].num_batches == plans[1].num_batches
    served = sorted(_rows_of(plans[0]) + _rows_of(plans[1]))
    whole = plans[0].rows
    assert whole.rows == total
    if drop_last:
        assert len(set(served)) == len(served) and len(served) == total - total % 8
    else:
        assert set(served) == set(range(total)) and len(served) - total < 2
        assert (_cover(whole, n) == 1).all()
    # Two steps in, 2 ranks consumed 2 * 4 * 2 rows of the global order: the rest, at any
    # world size, is exactly the rows after those (padded by wrapping, or its tail dropped).
    consumed = 2 * 4 * 2
    for world in (1, 2, 3):
        at_m = EpochStart(2, consumed, world)
        rest = [
            packed.plan([split], _options(rank=r, world_size=world, drop_last=drop_last), at_m)
            for r in range(world)
        ]
        resumed = [r for p in rest for r in _rows_of(p)]
        if drop_last:
            assert sorted(resumed) == list(range(consumed, consumed + len(resumed)))
            assert total - consumed - len(resumed) < 4 * world
        else:
            assert set(range(consumed, total)) <= set(resumed)
            assert set(resumed) - set(range(consumed, total)) <= set(range(world))
            assert len(resumed) - (total - consumed) < world


def test_a_packed_plans_batch_is_the_pieces_of_its_rows() -> None:
    n = _long_tailed(200, seed=2)
    split = _split(n)
    packed = PackedMixing(
        OneSplit(MixSourceOptions(dataset="web", weight=1.0)),
        PackOptions(seq_len=256),
        [split],
        [(2, 8192)],
    )
    plan = packed.plan([split], _options(), EpochStart(0, 0, 1))
    pieces = plan.batch(0).reshape(-1, 4)
    rows = plan.positions[:4]
    assert sorted(set(pieces[:, 0].tolist())) == [0, 1, 2, 3]
    for i, r in enumerate(rows.tolist()):
        mine = pieces[pieces[:, 0] == i]
        a, b = plan.rows.row_offsets[r], plan.rows.row_offsets[r + 1]
        assert mine[:, 1].tolist() == plan.rows.positions[a:b].tolist()
        assert mine[:, 3].sum() <= 256


def test_a_packed_plans_catalog_plan_reads_each_batchs_documents() -> None:
    """What the node cache prefetches for a packed session: batch k of the catalog plan is
    exactly the documents of batch k's pieces (repeats of the last filling it out)."""
    split = _split(_long_tailed(300, seed=3))
    packed = PackedMixing(
        OneSplit(MixSourceOptions(dataset="web", weight=1.0)),
        PackOptions(seq_len=256),
        [split],
        [(2, 8192)],
    )
    plan = packed.plan([split], _options(), EpochStart(0, 0, 1))
    documents = plan.catalog_plan()
    assert documents.num_batches == plan.num_batches
    assert documents is plan.catalog_plan()
    for k in range(plan.num_batches):
        read = plan.batch(k).reshape(-1, 4)[:, 1]
        got = documents.batch(k)
        assert got[: read.size].tolist() == read.tolist()
        assert set(got[read.size :].tolist()) <= {int(read[-1])}


def test_a_packed_mix_mixes_rows_of_each_source_and_serves_each_token_at_most_once() -> None:
    """A mix packs each source over all its documents and mixes rows by weight; with
    stop='first' no token repeats in the epoch, and the counts are the same every epoch."""
    a, b = _long_tailed(200, seed=4), _long_tailed(500, seed=5)
    splits = [_split(a, "a"), _split(b, "b")]
    mix = MixOptions(
        sources=(
            MixSourceOptions(dataset="a", weight=1.0),
            MixSourceOptions(dataset="b", weight=1.0),
        )
    )
    packed = PackedMixing(mix, PackOptions(seq_len=512), splits, [(2, 8192), (2, 8192)])
    counts = packed.counts([a.size, b.size])
    assert counts[0] == packed.source_rows[0] and counts[1] <= packed.source_rows[1]
    for epoch in (0, 1):
        plan = packed.plan(splits, _options(), EpochStart(epoch, 0, 1))
        assert plan.positions.size - sum(counts) < 4
        served = plan.positions[: sum(counts)]
        assert len(set(served.tolist())) == served.size
        both = np.concatenate([a, b])
        assert _cover(plan.rows, both, served.tolist()).max() == 1
        in_a = np.count_nonzero(served < packed.source_rows[0])
        assert in_a == counts[0]


def test_options_and_lengths_are_validated_with_what_to_do() -> None:
    with pytest.raises(InvalidArgument, match="seq_len=0"):
        PackOptions(seq_len=0)
    with pytest.raises(InvalidArgument, match="best_fit, first_fit, concat"):
        PackOptions(seq_len=8, method="worst_fit")
    split = _split([3, -1, 4])
    with pytest.raises(InvalidArgument, match="give 'length'"):
        document_lengths(split, 2, 100)
    with_bytes = replace(split, byte_lengths=np.array([-1, 10, -1], np.int64))
    assert document_lengths(with_bytes, 2, 4).tolist() == [3, 4, 4]
    # A Parquet row's byte range is its row group's payload chunk: no length comes of it.
    parquet = replace(with_bytes, row_groups=np.array([-1, 0, -1], np.int32))
    with pytest.raises(InvalidArgument, match="ingest parquet: --length"):
        document_lengths(parquet, 2, 4)
    packed = PackedMixing(
        OneSplit(MixSourceOptions(dataset="web", weight=1.0)),
        PackOptions(seq_len=8),
        [with_bytes],
        [(2, 100)],
    )
    with pytest.raises(InvalidArgument, match="sampling='uniform'"):
        packed.plan([with_bytes], _options(mode="weighted"), EpochStart(0, 0, 1))


def test_a_packed_mix_saved_at_two_ranks_resumes_at_one_with_every_row_once() -> None:
    a, b = _long_tailed(150, seed=6), _long_tailed(300, seed=7)
    splits = [_split(a, "a"), _split(b, "b")]
    mix = MixOptions(
        sources=(
            MixSourceOptions(dataset="a", weight=2.0),
            MixSourceOptions(dataset="b", weight=1.0),
        )
    )
    packed = PackedMixing(mix, PackOptions(seq_len=256), splits, [(2, 8192), (2, 8192)])
    total = sum(packed.counts([a.size, b.size]))
    two = [
        packed.plan(splits, _options(rank=r, world_size=2), EpochStart(1, 0, 2)) for r in range(2)
    ]
    steps = 3
    first = [r for p in two for r in _rows_of(p)[: steps * 4]]
    consumed = steps * 4 * 2
    one = packed.plan(splits, _options(), EpochStart(1, consumed, 1))
    rest = _rows_of(one)
    whole = _rows_of(packed.plan(splits, _options(), EpochStart(1, 0, 1)))[:total]
    # The two ranks' first steps are the order's first rows, the one rank's rest the others.
    assert sorted(first) == sorted(whole[:consumed])
    assert rest[: total - consumed] == whole[consumed:]
    assert len(set(whole)) == total
    # The source that runs out first ("a", at twice the weight) is served whole.
    assert set(range(packed.source_rows[0])) <= set(whole)
