"""Deterministic sampling: which samples each rank gets in each batch of an epoch.

A session's batches are a pure function of the split's size, the ``SamplerOptions``, the
epoch and (for the non-uniform modes) one column of the split. Every server replica computes
the same plan, so any replica can serve any rank, and resuming at batch k is ``plan.batch(k)``.

An epoch is planned in two steps, with the semantics of ``DistributedSampler`` and
``DataLoader(drop_last=...)`` together:

1. ``epoch_order`` builds the epoch's global order of sample positions, the same for every
   rank, then truncates it to whole global batches (``drop_last``) or pads it by wrapping
   around to the start until its length is a multiple of ``world_size``.
2. ``plan_epoch`` gives rank r every ``world_size``-th entry from entry r. Rank r's batch k is
   then drawn from entries [k * G, (k + 1) * G) of the global order, G = batch_size *
   world_size, so every rank has as many batches as the others and batch k has the same size
   on every rank. Ranks are disjoint except for the at most ``world_size - 1`` padding entries.

**Elastic resume.** Ranks consume the global order together, so how far an epoch got is
one number, ``start``: the entries of the global order consumed by all ranks so far. The rest
of the epoch for any world size M is entries ``start, start + 1, ...`` of the same order,
dealt to M ranks as above and padded (or dropped) for M; ``start = 0`` is the whole epoch.
Padding always wraps around to the epoch's start, so a plan from ``start`` is exactly the
tail of the plan from 0 when ``start`` is a whole number of global batches. Only
``bucketed`` orders depend on the world size (pools of global batches): the rest of such an
epoch keeps the world size it began with (``order_world_size``).

**Rotated epochs.** A Loader that joins its share group part way through an epoch serves
it in a rotated order: the global order from entry ``rotation`` on, then its first
``rotation`` entries (``sessions/share.py``). Every function here that takes ``rotation``
plans the rest of that rotated order, so an elastic resume of a rotated epoch is the same
arithmetic as any other; ``rotation = 0`` is the epoch's own order.

Randomness comes from ``Generator(PCG64(SeedSequence([seed, epoch, purpose tag])))``, so an
order depends on numpy's PCG64 stream and its ``permutation`` and ``random`` algorithms.
``tests/server/planning/test_sampling.py`` pins some orders: a numpy upgrade that changed
them would reorder the epochs of jobs that resume across it, and must be caught before it
ships.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Final

import numpy as np
import numpy.typing as npt

from batchd._wire.epoch import rest_of_epoch
from batchd._wire.ring import ceil_div
from batchd_server.errors import FailedPrecondition, InvalidArgument
from batchd_server.limits import INT64_MAX

__all__ = [
    "MIX_PASS_TAG",
    "SAMPLING_MODES",
    "EpochPlan",
    "EpochStart",
    "Int64Array",
    "SamplerOptions",
    "deal",
    "epoch_order",
    "num_batches",
    "plan_epoch",
    "rest_of_order",
    "samples_per_rank",
]

SAMPLING_MODES: Final[tuple[str, ...]] = ("uniform", "weighted", "class_balanced", "bucketed")

_MAX_BATCH_SIZE: Final = 1 << 16
# Without drop_last the global order is padded to a multiple of world_size, so an absurd
# world_size would allocate that many entries; no real job has more ranks than this.
_MAX_WORLD_SIZE: Final = 1 << 16
# Keeps a pool's size (bucket_batches * batch_size * world_size) within int64 arithmetic.
_MAX_BUCKET_BATCHES: Final = 1 << 20
_MAX_SEED: Final = (1 << 64) - 1

# Purpose tags of the random streams. They are part of every order's identity: changing one
# reorders every epoch of every job, including jobs resuming across a server upgrade.
_SHUFFLE_TAG: Final = 1
_DRAW_TAG: Final = 2
_BATCH_ORDER_TAG: Final = 3
MIX_PASS_TAG: Final = 4
"""A weighted mix's per-source orders (``batchd_server.planning.mixing``)."""

Int64Array = npt.NDArray[np.int64]
"""The planning package's arrays of positions, orders and counts."""


@dataclass(frozen=True, kw_only=True)
class SamplerOptions:
    """How a session draws its batches; validated on construction.

    Raises:
        InvalidArgument: A value is of the wrong type or out of its range.
    """

    batch_size: int
    """Samples per batch on each rank, 1 to 65536."""
    shuffle: bool = True
    """uniform and bucketed: a new order every epoch. The weighted modes always draw at random."""
    seed: int = 0
    """0 <= seed < 2**64; with the epoch it determines every random choice."""
    rank: int = 0
    """This process's rank, 0 <= rank < world_size."""
    world_size: int = 1
    """The number of ranks, 1 to 65536."""
    drop_last: bool = False
    """Drop the tail that does not fill a batch on every rank, instead of padding it."""
    mode: str = "uniform"
    """One of ``SAMPLING_MODES``."""
    bucket_batches: int = 64
    """bucketed: sort pools of this many global batches by length (1 to 2**20)."""

    def __post_init__(self) -> None:
        _require_int("batch_size", self.batch_size, 1, _MAX_BATCH_SIZE)
        _require_bool("shuffle", self.shuffle)
        _require_int("seed", self.seed, 0, _MAX_SEED)
        _require_int("world_size", self.world_size, 1, _MAX_WORLD_SIZE)
        _require_int("rank", self.rank, 0, self.world_size - 1, what="world_size - 1")
        _require_bool("drop_last", self.drop_last)
        if self.mode not in SAMPLING_MODES:
            raise InvalidArgument(
                f"sampling mode {self.mode!r} is unknown; use one of {', '.join(SAMPLING_MODES)}"
            )
        _require_int("bucket_batches", self.bucket_batches, 1, _MAX_BUCKET_BATCHES)


@dataclass(frozen=True)
class EpochStart:
    """Where a plan of an epoch starts: ``epoch`` from entry ``start`` of its global order on
    (an elastic resume), the order built for ``order_world_size`` ranks where it depends on
    them (a session's plans are cached by it; None: the plan's own ``world_size``); the
    order rotated to begin at its entry ``rotation`` (a rotated epoch, ``start`` counting
    from there; 0: the epoch's own)."""

    epoch: int
    start: int = 0
    order_world_size: int | None = None
    rotation: int = 0


@dataclass(frozen=True, eq=False)
class EpochPlan:
    """One rank's batches of one epoch.

    Attributes:
        positions: The rank's sample positions (indexes into the split's arrays) in the order
            they are served; read-only. Batch k is ``positions[k * batch_size:][:batch_size]``.
        batch_size: Samples per batch; only the last batch may have fewer.
        num_batches: Batches in the epoch, the same on every rank.
    """

    positions: Int64Array
    batch_size: int
    num_batches: int

    def __post_init__(self) -> None:
        assert self.positions.ndim == 1, "positions are flat"
        assert self.num_batches == ceil_div(self.positions.size, self.batch_size), "batch count"
        self.positions.setflags(write=False)

    def batch(self, k: int) -> Int64Array:
        """The positions of batch ``k``, a read-only view.

        Raises:
            IndexError: ``k`` is not in ``[0, num_batches)``.
        """
        if not 0 <= k < self.num_batches:
            raise IndexError(
                f"batch {k} is out of range: this epoch has {self.num_batches} batches, "
                f"numbered from 0 to {self.num_batches - 1}"
            )
        start = k * self.batch_size
        return self.positions[start : start + self.batch_size]

    def catalog_plan(self) -> EpochPlan:
        """These batches as the catalog rows they read, batch by batch (what a prefetch of
        their bytes follows): the plan itself, whose positions are catalog rows."""
        return self


def samples_per_rank(n: int, options: SamplerOptions, *, start: int = 0) -> int:
    """Samples each rank gets in an epoch of a split of ``n`` samples, padding included
    (from global position ``start`` on: an elastic resume)."""
    return _rest(n, options, start)[0]


def num_batches(n: int, options: SamplerOptions, *, start: int = 0) -> int:
    """Batches each rank gets in an epoch of a split of ``n`` samples (from ``start`` on).

    With ``drop_last`` this is 0 when the split cannot fill one batch on every rank.
    """
    return _rest(n, options, start)[1]


def _rest(n: int, options: SamplerOptions, start: int) -> tuple[int, int]:
    _require_samples(n)
    _require_int("start", start, 0, None)
    return rest_of_epoch(
        n,
        start,
        batch_size=options.batch_size,
        world_size=options.world_size,
        drop_last=options.drop_last,
    )


def epoch_order(
    n: int,
    options: SamplerOptions,
    epoch: int,
    *,
    start: int = 0,
    order_world_size: int | None = None,
    weights: npt.ArrayLike | None = None,
    labels: npt.ArrayLike | None = None,
    lengths: npt.ArrayLike | None = None,
    rotation: int = 0,
) -> Int64Array:
    """The global order of one epoch from entry ``start`` on, the same for every rank,
    truncated or padded for ``options.world_size``.

    Its length is ``samples_per_rank(n, options, start=start) * options.world_size``; rank r
    serves entries r, r + world_size, ... of it.

    Args:
        n: Samples in the split.
        options: How to sample; ``options.rank`` does not matter here.
        epoch: The epoch, >= 0.
        start: Entries of the epoch's order consumed already, by every rank together (an
            elastic resume; 0 is the whole epoch).
        order_world_size: ``bucketed``: the world size the epoch's order was built for (the
            one that started the epoch); default ``options.world_size``.
        weights: mode "weighted": one finite weight >= 0 per sample (float32 or float64).
        labels: mode "class_balanced": one label per sample (int64; -1, no label, is a class).
        lengths: mode "bucketed": one length >= 0 per sample (int32; -1 means unknown).
        rotation: The epoch's order begins at this entry and wraps around (a rotated epoch;
            ``start`` counts entries of the rotated order).

    Raises:
        FailedPrecondition: ``n`` is 0.
        InvalidArgument: ``epoch`` is out of range, or the column the mode needs is missing,
            of the wrong shape or type, or holds values the mode cannot use.
    """
    _require_samples(n)
    _require_int("epoch", epoch, 0, INT64_MAX)
    total = samples_per_rank(n, options, start=start) * options.world_size
    if order_world_size is None:
        order_world_size = options.world_size
    _require_int("order_world_size", order_world_size, 1, _MAX_WORLD_SIZE)
    if options.mode == "uniform":
        order = _uniform_order(n, options, epoch)
    elif options.mode == "weighted":
        order = _draw(_weights_column(weights, n), options.seed, epoch)
    elif options.mode == "class_balanced":
        order = _draw(_balancing_weights(labels, n), options.seed, epoch)
    else:
        assert options.mode == "bucketed", "SamplerOptions checks the mode"
        lengths_column = _lengths_column(lengths, n)
        order = _bucketed_order(lengths_column, options, epoch, order_world_size)
    return _rest_of_order(_rotated(order, rotation), total, start)


def rest_of_order(
    order: Int64Array, options: SamplerOptions, *, start: int = 0, rotation: int = 0
) -> Int64Array:
    """A whole epoch's global ``order`` (of any length >= 1, e.g. a weighted mix's) from
    entry ``start`` on, truncated or padded for ``options.world_size`` as ``epoch_order``
    does to the orders it builds (rotated by ``rotation`` entries first)."""
    total = samples_per_rank(order.size, options, start=start) * options.world_size
    return _rest_of_order(_rotated(order, rotation), total, start)


def _rotated(order: Int64Array, rotation: int) -> Int64Array:
    """``order`` from entry ``rotation`` on, then its first ``rotation`` entries."""
    _require_int("rotation", rotation, 0, max(order.size - 1, 0))
    if rotation == 0:
        return order
    return np.concatenate([order[rotation:], order[:rotation]])


def _rest_of_order(order: Int64Array, total: int, start: int) -> Int64Array:
    rest = order[start:]
    if total <= rest.size:
        return rest[:total]
    # Without drop_last, the padding is the order's start again (repeated when it is longer
    # than the order), whatever ``start`` is: the plan from a whole number of global batches
    # is then exactly the tail of the whole epoch's plan.
    return np.concatenate([rest, np.resize(order, total - rest.size)])


def plan_epoch(
    n: int,
    options: SamplerOptions,
    at: EpochStart,
    *,
    weights: npt.ArrayLike | None = None,
    labels: npt.ArrayLike | None = None,
    lengths: npt.ArrayLike | None = None,
) -> EpochPlan:
    """This rank's batches of the epoch ``at`` says, from its entry ``at.start`` on; the
    columns and errors as for ``epoch_order``."""
    order = epoch_order(
        n,
        options,
        at.epoch,
        start=at.start,
        order_world_size=at.order_world_size,
        weights=weights,
        labels=labels,
        lengths=lengths,
        rotation=at.rotation,
    )
    return deal(order, options, num_batches(n, options, start=at.start))


def deal(order: Int64Array, options: SamplerOptions, batches: int) -> EpochPlan:
    """Rank ``options.rank``'s plan of ``batches`` batches: every ``world_size``-th entry of
    ``order`` (the rest of an epoch, as ``epoch_order`` or ``rest_of_order`` returned it)."""
    # A contiguous copy, so the plan neither strides through nor keeps the whole order.
    positions = np.ascontiguousarray(order[options.rank :: options.world_size])
    return EpochPlan(positions, options.batch_size, batches)


def _uniform_order(n: int, options: SamplerOptions, epoch: int) -> Int64Array:
    if not options.shuffle:
        return np.arange(n, dtype=np.int64)
    return _rng(options.seed, epoch, _SHUFFLE_TAG).permutation(n).astype(np.int64, copy=False)


def _draw(weights: npt.NDArray[np.float64], seed: int, epoch: int) -> Int64Array:
    """``len(weights)`` draws with replacement, sample i with probability ∝ ``weights[i]``."""
    n = weights.size
    # Scaled by the largest weight so that the sum of huge weights stays finite.
    cdf = np.cumsum(weights / weights.max())
    rng = _rng(seed, epoch, _DRAW_TAG)
    targets = rng.random(n)
    targets *= cdf[-1]
    # Sorted targets walk the cdf in order instead of jumping across it, which makes the
    # search an order of magnitude faster for large splits. Sorting i.i.d. draws and then
    # shuffling them by an independent permutation gives i.i.d. draws again. (Equal floats
    # are indistinguishable, so every sort algorithm, on every CPU, gives the same array.)
    targets.sort()
    drawn = np.searchsorted(cdf, targets, side="right")
    # side="right" never lands on a weight of 0; a target that rounded up to the total would
    # land past the end, and belongs to the last sample with a positive weight.
    last_drawable = int(np.searchsorted(cdf, cdf[-1], side="left"))
    np.minimum(drawn, last_drawable, out=drawn)
    rng.shuffle(drawn)
    return drawn.astype(np.int64, copy=False)


def _bucketed_order(
    lengths: Int64Array, options: SamplerOptions, epoch: int, world_size: int
) -> Int64Array:
    n = lengths.size
    order = _uniform_order(n, options, epoch)
    global_batch = options.batch_size * world_size
    order = order[_sort_pools(lengths[order], options.bucket_batches * global_batch)]
    if options.shuffle:
        # The short last global batch stays last, so rank r's batch k still comes from
        # global batch k on every rank, and drop_last drops exactly that batch.
        whole = n - n % global_batch
        batches = order[:whole].reshape(-1, global_batch)
        rng = _rng(options.seed, epoch, _BATCH_ORDER_TAG)
        order[:whole] = batches[rng.permutation(len(batches))].reshape(-1)
    return order


def _sort_pools(keys: Int64Array, pool_size: int) -> Int64Array:
    """Indices that stable-sort each run of ``pool_size`` consecutive ``keys`` (all >= 0)."""
    n = keys.size
    index_bits = (n - 1).bit_length()
    key_bits = max(int(keys.max()), 1).bit_length()
    pool_bits = ((n - 1) // pool_size).bit_length()
    if index_bits + key_bits + pool_bits > 64:
        return np.lexsort((keys, np.arange(n) // pool_size)).astype(np.int64, copy=False)
    # Packing (pool, key, index) into one unique integer lets numpy's fastest (SIMD) sort do
    # the work. Ties are what make an unstable sort's result depend on the CPU it ran on;
    # unique keys leave nothing to break, so every replica computes the same order.
    index = np.arange(n, dtype=np.uint64)
    packed = index // np.uint64(pool_size)
    packed <<= np.uint64(key_bits)
    packed |= keys.astype(np.uint64)
    packed <<= np.uint64(index_bits)
    packed |= index
    packed.sort()
    packed &= np.uint64((1 << index_bits) - 1)
    return packed.astype(np.int64)


def _weights_column(weights: npt.ArrayLike | None, n: int) -> npt.NDArray[np.float64]:
    column = _column("weights", weights, n, "weighted", kinds="fiu").astype(np.float64, copy=False)
    bad = ~np.isfinite(column) | (column < 0)
    bad_count = int(np.count_nonzero(bad))
    if bad_count:
        first = int(np.flatnonzero(bad)[0])
        raise InvalidArgument(
            f"{bad_count} of {n} weights are negative, infinite or NaN (the first, at position "
            f"{first}, is {column[first]}); weights must be finite and >= 0"
        )
    if not column.any():
        raise InvalidArgument(
            f"all {n} weights are 0, so no sample can be drawn; give some samples a positive "
            "weight, or use sampling 'uniform'"
        )
    return column


def _balancing_weights(labels: npt.ArrayLike | None, n: int) -> npt.NDArray[np.float64]:
    """1 / (samples with the same label) for every sample."""
    column = _column("labels", labels, n, "class_balanced", kinds="iu").astype(np.int64)
    if column.min() >= -1 and column.max() < 4 * n + 1024:
        # The usual labels, small integers: counting beats np.unique's sort several times over.
        shifted = column + 1
        per_sample = np.bincount(shifted)[shifted]
    else:
        _, inverse, counts = np.unique(column, return_inverse=True, return_counts=True)
        per_sample = counts[inverse]
    return 1.0 / per_sample


def _lengths_column(lengths: npt.ArrayLike | None, n: int) -> Int64Array:
    column = _column("lengths", lengths, n, "bucketed", kinds="iu").astype(np.int64)
    unknown = int(np.count_nonzero(column < 0))
    if unknown:
        raise InvalidArgument(
            f"{unknown} of {n} samples have no length (-1), and sampling 'bucketed' needs "
            "every sample's length; set the length column in the catalog, or use sampling "
            "'uniform'"
        )
    return column


def _column(
    name: str, values: npt.ArrayLike | None, n: int, mode: str, *, kinds: str
) -> npt.NDArray[Any]:
    if values is None:
        raise InvalidArgument(f"sampling {mode!r} needs the split's {name}, but none were given")
    column = np.asarray(values)
    if column.shape != (n,):
        raise InvalidArgument(
            f"{name} has shape {column.shape}; sampling {mode!r} needs one per sample, ({n},)"
        )
    if column.dtype.kind not in kinds:
        wanted = "integers" if kinds == "iu" else "numbers"
        raise InvalidArgument(f"{name} have dtype {column.dtype}; sampling {mode!r} needs {wanted}")
    return column


def _rng(seed: int, epoch: int, tag: int) -> np.random.Generator:
    return np.random.Generator(np.random.PCG64(np.random.SeedSequence([seed, epoch, tag])))


def _require_samples(n: int) -> None:
    _require_int("n", n, 0, None)
    if n == 0:
        raise FailedPrecondition(
            "the split has no verified samples; ingest or verify samples of this split first"
        )


def _require_int(name: str, value: object, low: int, high: int | None, *, what: str = "") -> None:
    if (
        isinstance(value, int | np.integer)
        and not isinstance(value, bool | np.bool_)
        and low <= int(value)
        and (high is None or int(value) <= high)
    ):
        return
    if high is None:
        bound = f">= {low}"
    else:
        bound = f"from {low} to {what} = {high}" if what else f"from {low} to {high}"
    raise InvalidArgument(f"{name}={value!r} must be an integer {bound}")


def _require_bool(name: str, value: object) -> None:
    if not isinstance(value, bool | np.bool_):
        raise InvalidArgument(f"{name}={value!r} must be True or False")
