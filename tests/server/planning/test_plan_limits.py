"""What building an epoch's plan may cost: a mix's stop far beyond its sources, weights whose
sum overflows, a degenerate seq_len and too many pieces are refused with what to do; a
scheduled mix's work is bounded; first-fit places a size at a time, as the document-at-a-time
first-fit did; placements are shared by the sessions that pack the same lengths; and the
plan budget charged to a client is above what its plans take."""

from __future__ import annotations

import bisect
import gc
import sys
import tracemalloc
from collections.abc import Callable
from dataclasses import dataclass
from types import FrameType
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import batchd
from batchd._wire.schedule import WeightSchedule
from batchd.errors import InvalidArgument
from batchd_server.planning import packing, placement
from batchd_server.planning.budget import plan_bytes
from batchd_server.planning.mixing import (
    MAX_MIX_PASSES,
    SHARE_RESOLUTION,
    MixOptions,
    MixSourceOptions,
    mix_counts,
    plan_mix_epoch,
)
from batchd_server.planning.one_split import OneSplit
from batchd_server.planning.pacing import collector_paused
from batchd_server.planning.packing import PackedMixing, PackOptions, placements
from batchd_server.planning.placement import PLACEMENT_CACHE
from batchd_server.planning.sampling import EpochStart, SamplerOptions
from batchd_server.planning.schedule import MAX_SCHEDULED_WORK, batch_counts

PROPERTY = settings(max_examples=150, deadline=None)


def _mix(*weights: float, stop: int = 0) -> MixOptions:
    sources = tuple(MixSourceOptions(dataset=f"d{i}", weight=w) for i, w in enumerate(weights))
    return MixOptions(sources=sources, stop_samples=stop)


@dataclass
class _Dataset:
    name: str


@dataclass
class _Split:
    """What planning reads of a split's arrays."""

    lengths: np.ndarray
    dataset: _Dataset

    def __post_init__(self) -> None:
        self.byte_lengths = np.full(self.lengths.size, -1, np.int64)
        self.row_groups = np.full(self.lengths.size, -1, np.int32)
        self.split = "train"
        self.weights = self.labels = None

    def __len__(self) -> int:
        return int(self.lengths.size)

    def path(self, i: int) -> str:
        return f"doc{i}.bin"


def _documents(n: int, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return np.minimum(rng.lognormal(6.0, 1.1, n).astype(np.int64) + 1, 8000)


# -- mixes -------------------------------------------------------------------------------------


def test_a_stop_far_beyond_the_sources_is_refused_with_a_stop_that_fits() -> None:
    """stop=2**36 over a 10-row source would permute it billions of times: refused, naming
    the passes, the source and about the largest stop within MAX_MIX_PASSES, which plans."""
    mix = _mix(0.5, 0.5, stop=1 << 36)
    with pytest.raises(InvalidArgument, match=r"source 0 alone, of 10 rows") as refused:
        mix.counts([10, 1000])
    message = str(refused.value)
    assert f"more than the {MAX_MIX_PASSES} a mix may make" in message
    largest = int(message.split("use stop_samples <= ")[1].split()[0])
    counts = mix_counts([10, 1000], mix.units, largest)
    assert sum(-(-c // n) for c, n in zip(counts, (10, 1000), strict=True)) <= MAX_MIX_PASSES
    with pytest.raises(InvalidArgument, match="use stop_samples <="):
        mix_counts([10, 1000], mix.units, largest * 9 // 8)


def test_weights_whose_sum_overflows_are_refused_as_invalid_arguments() -> None:
    """Two weights near the largest float are each finite but their sum is not: a clear
    InvalidArgument on the server, in the client's Mix and in a schedule point, never an
    OverflowError."""
    with pytest.raises(InvalidArgument, match="add up to more than the largest float"):
        _mix(1e308, 1e308)
    with pytest.raises(InvalidArgument, match="add up to more than the largest float"):
        batchd.Mix({"a": 1e308, "b": 1e308})
    with pytest.raises(InvalidArgument, match="add up to more than the largest float"):
        WeightSchedule((1.0, 1.0), ((10, (1e308, 1e308)),))
    assert _mix(1e307, 1e307).units == (SHARE_RESOLUTION // 2, SHARE_RESOLUTION // 2)


def test_a_scheduled_mix_past_its_work_bound_is_refused_with_the_remedy() -> None:
    """64 sources in global batches of 1 over 2**20 samples: more source-batches than the
    server composes one by one; refused naming the largest stop, which plans."""
    base = tuple(1.0 for _ in range(64))
    sources = tuple(MixSourceOptions(dataset=f"d{i}", weight=1.0) for i in range(64))
    schedule = WeightSchedule(base, ((3, tuple(float(i + 1) for i in range(64))),))
    mix = MixOptions(sources=sources, stop_samples=1 << 20, schedule=schedule)
    options = SamplerOptions(batch_size=1)
    with pytest.raises(InvalidArgument, match="a smaller stop") as refused:
        plan_mix_epoch([1 << 15] * 64, mix, options, 0)
    most = MAX_SCHEDULED_WORK // 66
    assert f"at most {most} samples" in str(refused.value)


def _scanned(credits: list[int], units: Any, g: int, resolution: int) -> list[int]:
    """A batch's composition as it was computed before: a scan of every source per sample."""
    eligible = [s for s, u in enumerate(units) if u > 0]
    for s in eligible:
        credits[s] += g * units[s]
    take = [0] * len(units)
    for s in eligible:
        take[s] = max(0, credits[s] // resolution)
    total = sum(take)
    while total < g:
        s = max(eligible, key=lambda i: (credits[i] - take[i] * resolution, -i))
        take[s] += 1
        total += 1
    while total > g:
        s = min(
            (i for i in eligible if take[i] > 0),
            key=lambda i: (credits[i] - take[i] * resolution, -i),
        )
        take[s] -= 1
        total -= 1
    for s in eligible:
        credits[s] -= take[s] * resolution
    return take


@given(
    weights=st.lists(
        st.lists(st.sampled_from([0.0, 0.0, 0.1, 1.0, 2.0, 5.0]), min_size=5, max_size=5),
        min_size=1,
        max_size=6,
    ),
    sources=st.integers(1, 5),
    interpolate=st.sampled_from(["step", "linear"]),
    length=st.integers(1, 300),
    global_batch=st.integers(1, 9),
    resolution=st.sampled_from([7, 100, SHARE_RESOLUTION]),
)
@PROPERTY
def test_each_batch_is_composed_as_the_scan_of_every_source_composed_it(
    weights: list[list[float]],
    sources: int,
    interpolate: str,
    length: int,
    global_batch: int,
    resolution: int,
) -> None:
    """The heap picks the samples the scan picked, in every case (a batch short or over,
    sources weighed 0 at some steps), so every scheduled epoch is the one it was."""
    points = tuple(
        (3 * (i + 1), tuple(w[:sources]) if any(w[:sources]) else (1.0,) * sources)
        for i, w in enumerate(weights)
    )
    schedule = WeightSchedule((1.0,) * sources, points, interpolate)
    got = batch_counts(
        schedule, length=length, global_batch=global_batch, first_step=2, resolution=resolution
    )
    credits = [0] * sources
    for b in range(got.shape[0]):
        g = min(global_batch, length - b * global_batch)
        want = _scanned(credits, schedule.units_at(2 + b, resolution), g, resolution)
        assert got[b].tolist() == want


# -- packing -----------------------------------------------------------------------------------


def test_a_degenerate_seq_len_is_refused_with_the_minimum() -> None:
    """seq_len=1 would make a piece of every token: refused on both sides, naming 8."""
    with pytest.raises(InvalidArgument, match="seq_len=1 must be from 8 to"):
        PackOptions(seq_len=1)
    with pytest.raises(InvalidArgument, match="seq_len=7 must be between 8 and"):
        batchd.Pack(seq_len=7)
    assert PackOptions(seq_len=8).seq_len == batchd.Pack(seq_len=8).seq_len == 8


def test_too_many_pieces_are_refused_naming_the_smallest_seq_len_that_fits(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """100 documents of 100 tokens cut at 8 make 1,300 pieces; over a bound of 1,000 the open
    is refused naming seq_len >= 10 (10 pieces each), which packs."""
    monkeypatch.setattr(packing, "MAX_PACK_PIECES", 1000)
    split = _Split(np.full(100, 100, np.int64), _Dataset("web"))
    one = OneSplit(MixSourceOptions(dataset="web", weight=1.0))
    with pytest.raises(InvalidArgument, match=r"into 1300 pieces.*use seq_len >= 10"):
        PackedMixing(one, PackOptions(seq_len=8), [split], [(2, 4096)])
    assert PackedMixing(one, PackOptions(seq_len=10), [split], [(2, 4096)]).source_rows == (1000,)


@pytest.mark.parametrize("method", ["best_fit", "concat"])
def test_the_pieces_of_several_sources_are_the_sum_of_each_ones(method: str) -> None:
    """What a packed mix is charged and bounded by adds up its sources' pieces."""
    a, b = _documents(3000, seed=5), _documents(2000, seed=6)
    pack = PackOptions(seq_len=512, method=method)
    each = [packing.pack_pieces([n], pack) for n in (a, b)]
    assert packing.pack_pieces([a, b], pack) == tuple(map(sum, zip(*each, strict=True)))
    for n, (pieces, _) in zip((a, b), each, strict=True):
        rows = packing.pack_documents(np.arange(n.size, dtype=np.int64), n, pack)
        assert rows.positions.size <= pieces


def _first_fit_one_by_one(lengths: list[int], capacity: int) -> list[int]:
    """First-fit decreasing as it was computed before: a max-tree walked per document."""
    size = 1
    while size < max(len(lengths), 1):
        size *= 2
    tree = [capacity] * (2 * size)
    out: list[int] = []
    for length in lengths:
        node = 1
        while node < size:
            node *= 2
            if tree[node] < length:
                node += 1
        out.append(node - size)
        tree[node] -= length
        node //= 2
        while node:
            tree[node] = max(tree[2 * node], tree[2 * node + 1])
            node //= 2
    return out


@given(
    lengths=st.lists(st.integers(1, 700), min_size=0, max_size=700),
    capacity=st.integers(2, 701),
    coarse=st.integers(1, 60),
)
@PROPERTY
def test_first_fit_places_every_remainder_where_first_fit_one_by_one_did(
    lengths: list[int], capacity: int, coarse: int
) -> None:
    """Sizes a few or many, rows over several blocks: the same row for every remainder, so
    packed epochs are the ones they were."""
    items = sorted((min(capacity - 1, max(1, n // coarse)) for n in lengths), reverse=True)
    got = placement.place(np.asarray(items, np.int64), "first_fit", capacity)
    assert got.tolist() == _first_fit_one_by_one(items, capacity)


def _best_fit_one_by_one(lengths: list[int], capacity: int) -> list[int]:
    """Best-fit decreasing as it was computed before, into a list at once."""
    rooms: list[int] = []
    buckets: dict[int, list[int]] = {}
    out: list[int] = []
    opened = 0
    for length in lengths:
        i = bisect.bisect_left(rooms, length)
        if i < len(rooms):
            room = rooms[i]
            bucket = buckets[room]
            row = bucket.pop()
            if not bucket:
                del rooms[i]
                del buckets[room]
        else:
            room, row = capacity, opened
            opened += 1
        out.append(row)
        left = room - length
        if left:
            if left not in buckets:
                buckets[left] = []
                bisect.insort(rooms, left)
            buckets[left].append(row)
    return out


def test_best_fit_in_chunks_places_every_remainder_where_it_did_at_once() -> None:
    """40,000 remainders, more than a chunk: the same rows as the loop over them all."""
    rng = np.random.default_rng(8)
    items = np.sort(rng.integers(1, 3000, 40_000))[::-1].astype(np.int64)
    got = placement.place(items, "best_fit", 3001)
    assert got.tolist() == _best_fit_one_by_one(items.tolist(), 3001)


def _lines_run(module_files: tuple[str, ...], call: Callable[[], object]) -> int:
    """Python lines run in ``module_files`` during ``call()``."""
    count = 0

    def tracer(frame: FrameType, event: str, _: object) -> Any:
        nonlocal count
        if not frame.f_code.co_filename.endswith(module_files):
            return None
        if event == "line":
            count += 1
        return tracer

    sys.settrace(tracer)
    try:
        call()
    finally:
        sys.settrace(None)
    return count


def test_first_fit_takes_python_steps_per_size_not_per_document() -> None:
    """20,000 documents of 50 lengths: placing them runs some lines per length, not per
    document (which would be hundreds of thousands)."""
    PLACEMENT_CACHE.clear()
    rng = np.random.default_rng(4)
    lengths = rng.choice(np.arange(1000, 51_000, 1000), 20_000).astype(np.int64)
    pack = PackOptions(seq_len=2048 * 3, method="first_fit")
    files = ("planning/placement.py", "planning/packing.py")
    lines = _lines_run(files, lambda: placements(lengths, pack))
    assert lines < 100 * 50, lines


def test_a_second_session_of_the_same_lengths_reuses_the_placement() -> None:
    """Two packed sessions of one split (a job's two ranks): the second places nothing
    anew, and packs the same rows; another seq_len places anew."""
    PLACEMENT_CACHE.clear()
    split = _Split(_documents(5000, seed=2), _Dataset("web"))
    one = OneSplit(MixSourceOptions(dataset="web", weight=1.0))
    first = PackedMixing(one, PackOptions(seq_len=1024), [split], [(2, 8192)])
    assert (PLACEMENT_CACHE.misses, PLACEMENT_CACHE.hits) == (1, 0)
    second = PackedMixing(one, PackOptions(seq_len=1024), [split], [(2, 8192)])
    assert (PLACEMENT_CACHE.misses, PLACEMENT_CACHE.hits) == (1, 1)
    options = SamplerOptions(batch_size=4, seed=3)
    a = first.plan([split], options, EpochStart(1, 0, 1))
    b = second.plan([split], options, EpochStart(1, 0, 1))
    assert np.array_equal(a.positions, b.positions)
    assert np.array_equal(a.batch(5), b.batch(5))
    PackedMixing(one, PackOptions(seq_len=512), [split], [(2, 8192)])
    assert (PLACEMENT_CACHE.misses, PLACEMENT_CACHE.hits) == (2, 1)


# -- the budget --------------------------------------------------------------------------------


def _peak_bytes(build: Callable[[], object]) -> int:
    tracemalloc.start()
    try:
        kept = build()
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    del kept
    return peak


@pytest.mark.parametrize("kind", ["split", "mix", "mix with a stop", "packed mix", "packed concat"])
def test_the_plan_budget_is_above_what_a_session_s_plans_take(kind: str) -> None:
    """The bytes charged to a client before an open are at least the peak of building two
    epochs' plans (what a session keeps), their batch tables included."""
    n = 200_000
    options = SamplerOptions(batch_size=32, seed=1)
    one = OneSplit(MixSourceOptions(dataset="web", weight=1.0))
    tokens = ("tokens", {"max_len": 8192, "dtype": "uint16"})
    pack = None
    if kind.startswith("packed"):
        pack = PackOptions(seq_len=2048, method="concat" if "concat" in kind else "best_fit")
    if kind in ("split", "packed concat"):
        inner: Any = one
        splits = [_Split(_documents(n), _Dataset("web"))]
    else:
        inner = _mix(0.7, 0.3, stop=n if "stop" in kind else 0)
        splits = [_Split(_documents(n // 2, seed=s), _Dataset(f"d{s}")) for s in (1, 2)]
    budget = plan_bytes(inner, pack, tokens, splits)

    def build() -> object:
        planned = packing.packed_mixing(inner, pack, tokens, splits)
        plans = [planned.plan(splits, options, EpochStart(e, 0, 1)) for e in (0, 1)]
        for plan in plans:
            plan.catalog_plan()
        return planned, plans

    PLACEMENT_CACHE.clear()
    assert _peak_bytes(build) <= budget


def test_the_collector_waits_while_any_plan_is_built_and_runs_again_after() -> None:
    """Nested (two opens planning at once): off until the last is built, then back on; a
    collector someone turned off stays off."""
    assert gc.isenabled()
    with collector_paused():
        assert not gc.isenabled()
        with collector_paused():
            assert not gc.isenabled()
        assert not gc.isenabled()
    assert gc.isenabled()
    gc.disable()
    try:
        with collector_paused():
            pass
        assert not gc.isenabled()
    finally:
        gc.enable()
