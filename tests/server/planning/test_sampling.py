"""The sampler plans every rank's batches of an epoch: deterministic and exactly once."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import numpy as np
import numpy.typing as npt
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from batchd_server.errors import FailedPrecondition, InvalidArgument
from batchd_server.planning.sampling import (
    SAMPLING_MODES,
    EpochPlan,
    EpochStart,
    SamplerOptions,
    _sort_pools,
    epoch_order,
    num_batches,
    plan_epoch,
    samples_per_rank,
)

PROPERTY = settings(max_examples=150, deadline=None)
PERMUTING_MODES = ("uniform", "bucketed")
DRAWING_MODES = ("weighted", "class_balanced")


Columns = dict[str, npt.NDArray[Any]]
Setup = tuple[int, Columns, SamplerOptions, int]


def random_columns(n: int, seed: int = 0) -> Columns:
    """Weights (some 0, at least one not), labels from -1 to 4 and lengths below 1000."""
    rng = np.random.default_rng(seed)
    weights = rng.choice([0.0, 0.5, 1.0, 3.0], size=n).astype(np.float32)
    weights[rng.integers(n)] = 2.0
    labels = rng.integers(-1, 5, size=n)
    lengths = rng.integers(0, 1000, size=n).astype(np.int32)
    return {"weights": weights, "labels": labels, "lengths": lengths}


def all_ranks(n: int, options: SamplerOptions, epoch: int, **columns: Any) -> list[EpochPlan]:
    return [
        plan_epoch(n, dataclasses.replace(options, rank=rank), EpochStart(epoch), **columns)
        for rank in range(options.world_size)
    ]


@st.composite
def setups(draw: st.DrawFn, modes: tuple[str, ...] = SAMPLING_MODES, min_n: int = 1) -> Setup:
    n = draw(st.integers(min_n, 300))
    columns = random_columns(n, seed=draw(st.integers(0, 1000)))
    options = SamplerOptions(
        batch_size=draw(st.integers(1, 16)),
        shuffle=draw(st.booleans()),
        seed=draw(st.integers(0, (1 << 64) - 1)),
        world_size=draw(st.integers(1, 12)),
        drop_last=draw(st.booleans()),
        mode=draw(st.sampled_from(modes)),
        bucket_batches=draw(st.integers(1, 4)),
    )
    return n, columns, options, draw(st.integers(0, 1 << 40))


@PROPERTY
@given(setups())
def test_every_rank_has_as_many_batches_of_the_same_sizes(setup: Setup) -> None:
    """All ranks have num_batches batches; batch k has one size on all; only the last is short."""
    n, columns, options, epoch = setup
    plans = all_ranks(n, options, epoch, **columns)
    expected = num_batches(n, options)
    for plan in plans:
        assert plan.num_batches == expected
        assert plan.positions.size == samples_per_rank(n, options)
        sizes = [plan.batch(k).size for k in range(plan.num_batches)]
        assert sizes == [plan.batch(k).size for k in range(plans[0].num_batches)]
        assert all(size == options.batch_size for size in sizes[:-1])
        if sizes:
            assert 1 <= sizes[-1] <= options.batch_size
            assert not options.drop_last or sizes[-1] == options.batch_size


@PROPERTY
@given(setups(modes=PERMUTING_MODES))
def test_ranks_are_disjoint_and_cover_the_split_but_padding_or_drop(setup: Setup) -> None:
    """Each sample once per epoch, plus < world_size padding repeats, or less the dropped tail."""
    n, columns, options, epoch = setup
    served = np.concatenate([plan.positions for plan in all_ranks(n, options, epoch, **columns)])
    counts = np.bincount(served, minlength=n)
    assert counts.size == n
    if options.drop_last:
        assert counts.max(initial=0) <= 1
        assert n - counts.sum() == n % (options.batch_size * options.world_size)
    else:
        assert counts.min() >= 1
        padding = counts.sum() - n
        assert padding == -n % options.world_size < options.world_size


@PROPERTY
@given(setups(modes=DRAWING_MODES))
def test_draws_are_positions_of_samples_that_can_be_drawn(setup: Setup) -> None:
    """Weighted modes serve valid positions, never a sample of weight 0."""
    n, columns, options, epoch = setup
    for plan in all_ranks(n, options, epoch, **columns):
        assert plan.positions.dtype == np.int64
        assert ((plan.positions >= 0) & (plan.positions < n)).all()
        if options.mode == "weighted":
            assert (columns["weights"][plan.positions] > 0).all()


@PROPERTY
@given(setups())
def test_ranks_stripe_one_rank_independent_global_order(setup: Setup) -> None:
    """Interleaving the ranks' positions gives epoch_order, which no rank changes."""
    n, columns, options, epoch = setup
    order = epoch_order(n, options, epoch, **columns)
    other_rank = dataclasses.replace(options, rank=options.world_size - 1)
    assert np.array_equal(order, epoch_order(n, other_rank, epoch, **columns))
    assert order.size == samples_per_rank(n, options) * options.world_size
    for rank, plan in enumerate(all_ranks(n, options, epoch, **columns)):
        assert np.array_equal(plan.positions, order[rank :: options.world_size])


@PROPERTY
@given(setups())
def test_the_same_arguments_give_the_same_plan(setup: Setup) -> None:
    """Two plans from equal arguments (and copies of the columns) are identical."""
    n, columns, options, epoch = setup
    first = all_ranks(n, options, epoch, **columns)
    copied = {name: column.copy() for name, column in columns.items()}
    second = all_ranks(n, dataclasses.replace(options), epoch, **copied)
    for a, b in zip(first, second, strict=True):
        assert np.array_equal(a.positions, b.positions)
        assert (a.batch_size, a.num_batches) == (b.batch_size, b.num_batches)


@PROPERTY
@given(setups(min_n=50), st.data())
def test_a_new_epoch_or_seed_gives_a_new_order(setup: Setup, data: st.DataObject) -> None:
    """With 50 or more samples, a different epoch or seed reorders a random mode's epoch."""
    n, columns, options, epoch = setup
    if options.mode in PERMUTING_MODES:
        options = dataclasses.replace(options, shuffle=True)
    # At least four global batches: drop_last keeps most of the order, and bucketed has four
    # pools (one pool holding the whole split is sorted by length, the same in every epoch up
    # to the order of its batches).
    batch_size = max(1, min(options.batch_size, n // (4 * options.world_size)))
    options = dataclasses.replace(options, batch_size=batch_size, bucket_batches=1)
    order = epoch_order(n, options, epoch, **columns)
    next_epoch = epoch_order(n, options, epoch + 1, **columns)
    other_seed = data.draw(st.integers(0, (1 << 64) - 1).filter(lambda s: s != options.seed))
    reseeded = dataclasses.replace(options, seed=other_seed)
    assert not np.array_equal(order, next_epoch)
    assert not np.array_equal(order, epoch_order(n, reseeded, epoch, **columns))


@PROPERTY
@given(setups())
def test_resuming_at_batch_k_serves_exactly_the_rest_of_the_epoch(setup: Setup) -> None:
    """Batches k, k + 1, ... of a fresh plan are what the uninterrupted plan serves after k."""
    n, columns, options, epoch = setup
    uninterrupted = plan_epoch(n, options, EpochStart(epoch), **columns)
    resumed = plan_epoch(n, options, EpochStart(epoch), **columns)
    for k in range(uninterrupted.num_batches + 1):
        rest = [resumed.batch(j) for j in range(k, resumed.num_batches)]
        served = np.concatenate(rest) if rest else np.empty(0, np.int64)
        assert np.array_equal(served, uninterrupted.positions[k * options.batch_size :])


@PROPERTY
@given(
    st.lists(st.integers(0, 40), min_size=3, max_size=200),
    st.integers(1, 50),
)
def test_pools_sort_the_same_with_packed_keys_and_with_the_lexsort_fallback(
    keys: list[int], pool_size: int
) -> None:
    """Keys too wide to pack take np.lexsort, which sorts each pool identically (stably)."""
    small = np.array(keys, np.int64)
    packed = _sort_pools(small, pool_size)
    # 63-bit keys and at least 2 index bits cannot be packed into 64 bits.
    fallback = _sort_pools(small + (1 << 62), pool_size)
    assert np.array_equal(packed, fallback)
    pools = np.arange(small.size) // pool_size
    assert np.array_equal(pools[packed], pools)
    assert np.array_equal(packed, np.lexsort((np.arange(small.size), small, pools)))


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
@pytest.mark.parametrize("drop_last", [False, True])
def test_unshuffled_batches_equal_distributed_sampler_with_a_batch_sampler(
    world_size: int, drop_last: bool
) -> None:
    """Rank r's batches are torch's DistributedSampler(shuffle=False) batched with drop_last."""
    # Imported here: torch is the reference, not a dependency of the sampler.
    from torch.utils.data import BatchSampler, DistributedSampler

    for n in (1, 3, 7, 10, 23, 64):
        for batch_size in (1, 2, 3, 5):
            options = SamplerOptions(
                batch_size=batch_size, shuffle=False, world_size=world_size, drop_last=drop_last
            )
            for rank, plan in enumerate(all_ranks(n, options, 0)):
                dataset: Any = range(n)  # a sized sequence is all DistributedSampler reads
                reference: DistributedSampler[int] = DistributedSampler(
                    dataset, world_size, rank, shuffle=False, drop_last=drop_last
                )
                expected = list(BatchSampler(reference, batch_size, drop_last=drop_last))
                served = [plan.batch(k).tolist() for k in range(plan.num_batches)]
                assert served == expected, (n, batch_size, rank)


def test_a_world_larger_than_the_split_wraps_around_more_than_once() -> None:
    """n=3 on 8 ranks: every rank gets one sample, the order repeated as needed."""
    options = SamplerOptions(batch_size=4, shuffle=False, world_size=8)
    plans = all_ranks(3, options, 0)
    assert [plan.positions.tolist() for plan in plans] == [[0], [1], [2], [0], [1], [2], [0], [1]]


def test_drop_last_with_fewer_samples_than_one_batch_per_rank_gives_no_batches() -> None:
    """7 samples, 2 ranks of batch 4: nothing fills a batch on every rank, so nothing is served."""
    options = SamplerOptions(batch_size=4, world_size=2, drop_last=True)
    plan = plan_epoch(7, options, EpochStart(0))
    assert (plan.num_batches, plan.positions.size) == (0, 0)
    assert epoch_order(7, options, 0).size == 0


def test_batches_are_read_only_views_and_those_outside_the_epoch_raise_index_error() -> None:
    """batch(k) is a read-only slice of the positions; batch(-1), batch(num_batches) raise."""
    plan = plan_epoch(10, SamplerOptions(batch_size=4), EpochStart(0))
    assert plan.batch(2).tolist() == plan.positions[8:].tolist()
    for k in (-1, 3):
        with pytest.raises(IndexError, match=f"batch {k} is out of range.*3 batches"):
            plan.batch(k)
    # Sessions share a plan between threads: nobody may reorder it in place.
    with pytest.raises(ValueError, match="read-only"):
        plan.positions[0] = 1
    with pytest.raises(ValueError, match="read-only"):
        plan.batch(0)[0] = 1


def test_orders_of_a_fixed_seed_and_epoch_never_change() -> None:
    """Pinned orders: a numpy or code change that reorders them would break resumed jobs."""
    weights = np.array([1, 0, 2, 1, 0, 3, 1, 1, 2, 0, 1, 1], np.float32)
    labels = np.array([0, 0, 0, 0, 0, 0, 1, 1, 1, 2, -1, -1])
    lengths = np.array([5, 1, 9, 3, 7, 2, 8, 4, 6, 0, 11, 10], np.int32)
    pinned = {
        "uniform": [10, 2, 3, 4, 6, 11, 5, 1, 0, 9, 8, 7],
        "weighted": [2, 5, 10, 11, 3, 6, 2, 5, 3, 8, 0, 0],
        "class_balanced": [4, 8, 10, 11, 6, 9, 4, 6, 5, 10, 1, 1],
        # The uniform order's pools of 8 sorted by length, then its 3 batches of 4 shuffled.
        "bucketed": [6, 2, 11, 10, 1, 5, 3, 4, 9, 7, 0, 8],
    }
    for mode, expected in pinned.items():
        options = SamplerOptions(batch_size=2, seed=2024, world_size=2, mode=mode, bucket_batches=2)
        order = epoch_order(12, options, 7, weights=weights, labels=labels, lengths=lengths)
        assert order.tolist() == expected, mode


def test_weighted_draws_follow_the_weights() -> None:
    """Samples with weights 0, 1, 2, 3 are drawn 0, 1/6, 2/6 and 3/6 of the time."""
    n = 60_000
    weights = np.tile(np.arange(4, dtype=np.float64), n // 4)
    options = SamplerOptions(batch_size=64, world_size=3, mode="weighted", seed=11)
    served = np.concatenate([plan.positions for plan in all_ranks(n, options, 5, weights=weights)])
    shares = np.bincount(weights[served].astype(np.int64), minlength=4) / served.size
    # The standard deviation of each share is about 0.002; the bound is five of them.
    np.testing.assert_allclose(shares, [0, 1 / 6, 2 / 6, 3 / 6], atol=0.01)
    # The weights sum to 1.5 n, so n draws pick each sample of weight 3 twice on average.
    per_sample = np.bincount(served, minlength=n)[weights == 3]
    assert abs(per_sample.mean() - 2) < 0.05


@pytest.mark.parametrize("classes", [(-1, 1, 0), (-(1 << 40), 7, 1 << 50)])
def test_class_balanced_draws_every_class_equally_often(classes: tuple[int, int, int]) -> None:
    """Classes of 1%, 9% and 90% of the samples are drawn a third of the time each.

    -1 (no label) is a class of its own; labels far from 0..n take the np.unique path.
    """
    n = 30_000
    labels = np.full(n, classes[2])
    labels[: n // 10] = classes[1]
    labels[: n // 100] = classes[0]
    options = SamplerOptions(batch_size=32, world_size=2, mode="class_balanced", seed=3)
    served = np.concatenate([plan.positions for plan in all_ranks(n, options, 0, labels=labels)])
    shares = [np.count_nonzero(labels[served] == label) / served.size for label in classes]
    np.testing.assert_allclose(shares, [1 / 3, 1 / 3, 1 / 3], atol=0.02)


@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_bucketed_batches_have_a_smaller_length_spread_than_uniform_batches(
    world_size: int,
) -> None:
    """Each global batch k (rank r's batch k for every r) holds samples of similar lengths."""
    n = 4096
    lengths = np.random.default_rng(1).integers(0, 1000, n).astype(np.int32)

    def mean_spread(mode: str) -> float:
        options = SamplerOptions(batch_size=16, world_size=world_size, mode=mode, seed=9)
        plans = all_ranks(n, options, 2, lengths=lengths)
        spreads = []
        for k in range(plans[0].num_batches):
            batch_lengths = lengths[np.concatenate([plan.batch(k) for plan in plans])]
            spreads.append(int(np.ptp(batch_lengths)))
        return float(np.mean(spreads))

    assert mean_spread("bucketed") < mean_spread("uniform") / 10


def test_bucketed_shuffles_the_batch_order_and_without_shuffle_sorts_each_pool() -> None:
    """shuffle: batch lengths go up and down; no shuffle: they rise through each pool."""
    n, batch_size, bucket_batches = 1024, 8, 16
    lengths = np.random.default_rng(2).integers(0, 1000, n).astype(np.int32)
    for shuffle in (True, False):
        options = SamplerOptions(
            batch_size=batch_size, shuffle=shuffle, mode="bucketed", bucket_batches=bucket_batches
        )
        order = epoch_order(n, options, 0, lengths=lengths)
        assert sorted(order.tolist()) == list(range(n))
        pool_lengths = lengths[order].reshape(-1, batch_size * bucket_batches)
        rising = (np.diff(pool_lengths, axis=1) >= 0).all()
        assert rising == (not shuffle)


def test_an_empty_split_is_a_failed_precondition() -> None:
    """No verified samples: FailedPrecondition, from every entry point."""
    options = SamplerOptions(batch_size=4)
    calls: list[Callable[[], object]] = [
        lambda: samples_per_rank(0, options),
        lambda: num_batches(0, options),
        lambda: epoch_order(0, options, 0),
        lambda: plan_epoch(0, options, EpochStart(0)),
    ]
    for call in calls:
        with pytest.raises(FailedPrecondition, match="no verified samples"):
            call()


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"batch_size": 0}, "batch_size=0 must be an integer from 1 to 65536"),
        ({"batch_size": 65537}, "batch_size=65537"),
        ({"batch_size": 2.0}, r"batch_size=2\.0 must be an integer"),
        ({"batch_size": True}, "batch_size=True must be an integer"),
        ({"seed": -1}, "seed=-1 must be an integer from 0 to 18446744073709551615"),
        ({"seed": 1 << 64}, "seed=18446744073709551616"),
        ({"world_size": 0}, "world_size=0 must be an integer from 1 to 65536"),
        ({"rank": 2, "world_size": 2}, r"rank=2 must be an integer from 0 to world_size - 1 = 1"),
        ({"rank": -1}, "rank=-1"),
        ({"shuffle": 1}, "shuffle=1 must be True or False"),
        ({"drop_last": "yes"}, "drop_last='yes' must be True or False"),
        ({"mode": "random"}, "sampling mode 'random' is unknown; use one of uniform, weighted"),
        ({"bucket_batches": 0}, "bucket_batches=0 must be an integer from 1 to 1048576"),
    ],
)
def test_invalid_options_name_the_value_and_its_range(
    options: dict[str, Any], message: str
) -> None:
    """Every option is checked when SamplerOptions is built."""
    with pytest.raises(InvalidArgument, match=message):
        SamplerOptions(**{"batch_size": 4, **options})


@pytest.mark.parametrize(
    ("mode", "columns", "message"),
    [
        ("weighted", {}, "sampling 'weighted' needs the split's weights, but none were given"),
        ("class_balanced", {}, "needs the split's labels"),
        ("bucketed", {}, "needs the split's lengths"),
        ("weighted", {"weights": np.ones(3)}, r"weights has shape \(3,\).*one per sample, \(4,\)"),
        ("class_balanced", {"labels": np.ones(4)}, "labels have dtype float64.*needs integers"),
        ("weighted", {"weights": np.zeros(4)}, "all 4 weights are 0"),
        (
            "weighted",
            {"weights": np.array([1.0, -2.0, np.nan, 1.0])},
            r"2 of 4 weights are negative, infinite or NaN \(the first, at position 1, is -2\.0\)",
        ),
        (
            "bucketed",
            {"lengths": np.array([3, -1, -1, 5], np.int32)},
            r"2 of 4 samples have no length \(-1\).*set the length column",
        ),
    ],
)
def test_missing_or_unusable_columns_are_invalid_arguments(
    mode: str, columns: dict[str, Any], message: str
) -> None:
    """The column a mode reads must be there, one number per sample, usable by the mode."""
    options = SamplerOptions(batch_size=2, mode=mode)
    with pytest.raises(InvalidArgument, match=message):
        plan_epoch(4, options, EpochStart(0), **columns)


@pytest.mark.parametrize("epoch", [-1, 1 << 63, 1.5])
def test_an_invalid_epoch_is_an_invalid_argument(epoch: Any) -> None:
    """Epochs are integers from 0 to 2**63 - 1 (they travel as int64)."""
    with pytest.raises(InvalidArgument, match=f"epoch={epoch!r} must be an integer from 0"):
        plan_epoch(4, SamplerOptions(batch_size=2), EpochStart(epoch))
