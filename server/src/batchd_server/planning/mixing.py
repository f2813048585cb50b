"""Weighted mixing: one epoch over several splits, every batch drawn by weight.

NOTE [ Mixed order ]
~~~~~~~~~~~~~~~~~~~~
A mix has sources 0..S-1 (splits of datasets) with ``n_s`` rows each and a weight each. The
weights become integers ``W_s`` (their shares of 2**24, at least 1), so that every
comparison below is exact integer arithmetic and every replica computes the same order.

*Each source's own order.* Source s serves items j = 0, 1, 2, ...: item j is row
``perm(s, q)[j % n_s]`` of pass ``q = j // n_s``, where ``perm(s, q)`` is a permutation of the
source's rows seeded by (seed, epoch, MIX_PASS_TAG, s, q), or id order without shuffle. No
row repeats within a pass.

*The interleaving* is a smooth weighted round robin: item j of source s is due at
``(2j + 1) / W_s`` (the middle of its j-th slot on a clock that gives source s ``W_s`` slots
per unit), and the epoch serves items in order of (due time, source index). Over any prefix
of t items, a source's count is within (S + 1) / 2 of ``t * W_s / sum(W)`` (within 1 for two
sources). The number of items of one source due before a given item has a closed form, so
an item's rank in the epoch does too (``_ranks``): the order is built in O(S * L) without a
sort, and batch k's composition is a function of the options alone.

*The epoch* is the first L items of that order. ``stop_samples = 0`` ("first"): the items due
before the first source would need a row past its end, so every row of every source is
served at most once and the first source to run out is served whole. ``stop_samples = N``:
L = N, and a source that runs out begins its next pass (a new order of its rows).

Positions are global over the sources concatenated in order: source s's row r is position
``starts[s] + r``. The rest of an epoch (from a global cursor) is truncated or padded like a
single split's (``sampling.rest_of_order``), so ``drop_last``, padding and elastic resume
work unchanged, but it is dealt to the ranks in blocks (``deal_blocks``): rank r's batch k
is the r-th run of ``batch_size`` entries of global batch k, not every ``world_size``-th
entry, which would alias with the round robin's period (at 3:1 over 2 ranks, one rank would
get every sample of the smaller source). A contiguous run keeps the weights, so every
rank's every batch is within (S + 1) samples of its shares (within 2 for two sources).
Within each batch the rows are grouped by source (a stable sort), so that a worker decodes
each source's rows together.

A mix with a schedule (weights that change with the global step) orders its epochs
otherwise: NOTE [ Scheduled mix ] in ``planning/schedule.py``.
"""

from __future__ import annotations

import base64
import binascii
import json
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from fractions import Fraction
from typing import TYPE_CHECKING, Any, Final, Protocol

import numpy as np

from batchd._wire.mix import finite_sum, valid_weight
from batchd._wire.schedule import WeightSchedule
from batchd_server.errors import FailedPrecondition, InvalidArgument
from batchd_server.planning.pacing import Pace
from batchd_server.planning.sampling import (
    MIX_PASS_TAG,
    EpochPlan,
    EpochStart,
    Int64Array,
    SamplerOptions,
    num_batches,
    rest_of_order,
)
from batchd_server.planning.schedule import scheduled_order

if TYPE_CHECKING:
    from batchd_server.catalog.types import SplitArrays

__all__ = [
    "MAX_EPOCH_SAMPLES",
    "MAX_MIX_PASSES",
    "MAX_MIX_SOURCES",
    "SHARE_RESOLUTION",
    "MixOptions",
    "MixSourceOptions",
    "Mixing",
    "deal_blocks",
    "group_by_source",
    "mix_counts",
    "mix_token",
    "mixed_order",
    "parse_mix_token",
    "plan_mix_epoch",
    "source_starts",
]

SHARE_RESOLUTION: Final = 1 << 24
"""Weights are used as integer shares of this (the smallest share is 1)."""
MAX_MIX_SOURCES: Final = 64
MAX_EPOCH_SAMPLES: Final = 1 << 36
"""An epoch of a mix at most; keeps ``(2j + 1) * W`` within int64."""
MAX_MIX_PASSES: Final = 1 << 16
"""Passes over their rows that the sources of a mix make in one epoch, all together, at
most: each pass is a new order of a source's rows, drawn one by one (NOTE [ Mixed order ]).
A stop beyond that is far beyond the sources' sizes, which no training needs."""
_TOKEN_PREFIX: Final = "m1."


@dataclass(frozen=True, kw_only=True)
class MixSourceOptions:
    """One source of a mix, validated on construction.

    Raises:
        InvalidArgument: the weight is not a finite number > 0.
    """

    dataset: str
    version: str | None = None
    split: str = "train"
    weight: float
    pipeline_kind: str | None = None
    """The source's own pipeline (``build_pipeline``'s kind); None: the session's."""
    pipeline_options: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        weight = self.weight
        if not valid_weight(weight):
            raise InvalidArgument(
                f"mix source {self.name!r} has weight={weight!r}; weights must be finite "
                "numbers > 0 (leave a source out of the mix rather than weigh it 0)"
            )

    @property
    def name(self) -> str:
        """``dataset:split``, with ``@version`` when one is asked for."""
        version = f"@{self.version}" if self.version else ""
        return f"{self.dataset}:{self.split}{version}"


class Mixing(Protocol):
    """How a session's sources make its epochs: a weighted mix of splits (``MixOptions``),
    or the one split of a session that asked for no mix, a mix of one
    (``one_split.OneSplit``). A session's task positions are global over its sources' rows
    concatenated in order, whichever it is."""

    @property
    def sources(self) -> tuple[MixSourceOptions, ...]:
        """The sources, in order."""
        ...

    @property
    def labels_rows(self) -> bool:
        """Whether each batch says which source each row came from (its ``source`` field)."""
        ...

    def counts(self, sizes: Sequence[int]) -> tuple[int, ...]:
        """Samples of each source in one epoch (all ranks), from each source's rows.

        Raises:
            FailedPrecondition, InvalidArgument: the sources cannot make an epoch.
        """
        ...

    def plan(
        self, splits: Sequence[SplitArrays], options: SamplerOptions, at: EpochStart
    ) -> EpochPlan:
        """This rank's batches of the epoch ``at`` says, from where it says.

        Raises:
            InvalidArgument, FailedPrecondition: as the planning function says.
        """
        ...

    def pins(self, token: str | None) -> Sequence[tuple[str | None, str | None]]:
        """Each source's (version, snapshot token) that the session's snapshot ``token``
        pins, None where it pins none; all None without a token.

        Raises:
            InvalidArgument: ``token`` is not a snapshot of this kind of session.
        """
        ...

    def token(self, pins: Sequence[tuple[str, str]]) -> str:
        """The session's snapshot token, from each source's (version, snapshot token)."""
        ...


@dataclass(frozen=True, kw_only=True)
class MixOptions:
    """A weighted mix of splits, validated on construction.

    Raises:
        InvalidArgument: no source, too many, one listed twice, or ``stop_samples`` out of
            range.
    """

    sources: tuple[MixSourceOptions, ...]
    stop_samples: int = 0
    """0: the epoch ends where the first source runs out; N > 0: N samples per epoch."""
    schedule: WeightSchedule | None = None
    """Weights by global step (NOTE [ Scheduled mix ]); its base is the sources' weights."""

    def __post_init__(self) -> None:
        if not self.sources:
            raise InvalidArgument(
                "the mix has no source; give at least one, e.g. Mix({'a': 0.7, 'b': 0.3})"
            )
        if len(self.sources) > MAX_MIX_SOURCES:
            raise InvalidArgument(
                f"the mix has {len(self.sources)} sources; at most {MAX_MIX_SOURCES}"
            )
        seen: set[tuple[str, str | None, str]] = set()
        for source in self.sources:
            key = (source.dataset, source.version, source.split)
            if key in seen:
                raise InvalidArgument(
                    f"the mix lists {source.name!r} twice; list it once with the sum of "
                    "the weights (a sample must not be served twice in one epoch)"
                )
            seen.add(key)
        stop = self.stop_samples
        if isinstance(stop, bool) or not isinstance(stop, int) or stop < 0:
            raise InvalidArgument(
                f"stop_samples={stop!r} must be 0 (stop when the first source runs out) or "
                "a number of samples per epoch > 0"
            )
        if stop > MAX_EPOCH_SAMPLES:
            raise InvalidArgument(f"stop_samples={stop} must be at most {MAX_EPOCH_SAMPLES}")
        weights = tuple(s.weight for s in self.sources)
        if not finite_sum(weights):
            raise InvalidArgument(
                f"the mix's weights {weights} add up to more than the largest float; scale "
                "them down (only their ratios matter), e.g. to shares that sum to 1"
            )
        if self.schedule is not None and self.schedule.base != weights:
            raise InvalidArgument(
                f"the mix schedule's base weights {self.schedule.base} are not the sources' "
                f"weights {weights}"
            )

    @property
    def units(self) -> tuple[int, ...]:
        """The weights as integer shares of ``SHARE_RESOLUTION`` (each at least 1)."""
        total = math.fsum(s.weight for s in self.sources)
        return tuple(max(1, round(s.weight / total * SHARE_RESOLUTION)) for s in self.sources)

    @property
    def label(self) -> str:
        """The mix in logs and metric labels: its datasets sorted and joined by ``+`` (the
        order a client listed them in makes no new metric series)."""
        return "+".join(sorted(s.dataset for s in self.sources))

    # -- as a ``Mixing`` ---------------------------------------------------------------------

    @property
    def labels_rows(self) -> bool:
        return True

    def counts(self, sizes: Sequence[int]) -> tuple[int, ...]:
        """``mix_counts`` of the mix, a source without rows named."""
        for source, n in zip(self.sources, sizes, strict=True):
            if n <= 0:
                raise FailedPrecondition(
                    f"mix source {source.name!r} has no verified samples; ingest or verify "
                    "samples of that split, or leave it out of the mix"
                )
        return mix_counts(sizes, self.units, self.stop_samples)

    def plan(
        self, splits: Sequence[SplitArrays], options: SamplerOptions, at: EpochStart
    ) -> EpochPlan:
        """``plan_mix_epoch``; a mix's order depends on the world size only under a schedule
        (its steps are global batches)."""
        return plan_mix_epoch(
            [len(s) for s in splits],
            self,
            options,
            at.epoch,
            start=at.start,
            order_world_size=at.order_world_size,
            rotation=at.rotation,
        )

    def pins(self, token: str | None) -> Sequence[tuple[str | None, str | None]]:
        if token is None:
            return [(None, None)] * len(self.sources)
        return parse_mix_token(token, len(self.sources))

    def token(self, pins: Sequence[tuple[str, str]]) -> str:
        return mix_token(pins)


def source_starts(sizes: Sequence[int]) -> Int64Array:
    """Each source's first global position (the sources' rows concatenated in order)."""
    return np.concatenate([[0], np.cumsum(sizes[:-1], dtype=np.int64)]).astype(np.int64)


def mix_counts(sizes: Sequence[int], units: Sequence[int], stop_samples: int) -> tuple[int, ...]:
    """Items of each source in one epoch of the mix (see NOTE [ Mixed order ]).

    Raises:
        FailedPrecondition: a source has no rows.
        InvalidArgument: the epoch would be longer than ``MAX_EPOCH_SAMPLES``.
    """
    assert len(sizes) == len(units) and units and min(units) >= 1, "one unit >= 1 per source"
    empty = [s for s, n in enumerate(sizes) if n <= 0]
    if empty:
        raise FailedPrecondition(
            f"source {empty[0]} of the mix has no verified samples; ingest or verify samples "
            "of that split, or leave it out of the mix"
        )
    if stop_samples:
        counts = tuple(_first_rank_at_least(s, stop_samples, units) for s in range(len(sizes)))
        _check_passes(sizes, units, counts, stop_samples)
        return counts
    # The first source to run out: the smallest due time of a source's item n_s (a row
    # past its end), ties to the lowest index as in the order itself.
    first = min(range(len(sizes)), key=lambda s: Fraction(2 * sizes[s] + 1, units[s]))
    counts = tuple(
        sizes[s] if s == first else _due_before(s, first, sizes[first], units)
        for s in range(len(sizes))
    )
    if sum(counts) > MAX_EPOCH_SAMPLES:
        raise InvalidArgument(
            f"one epoch of the mix would have {sum(counts)} samples, more than "
            f"{MAX_EPOCH_SAMPLES}; set stop_samples"
        )
    return counts


def _check_passes(
    sizes: Sequence[int], units: Sequence[int], counts: Sequence[int], stop_samples: int
) -> None:
    """Refuse an epoch whose sources pass over their rows more than ``MAX_MIX_PASSES`` times
    in all (a ``stop_samples`` far beyond their sizes)."""
    passes = sum(-(-count // n) for count, n in zip(counts, sizes, strict=True))
    if passes <= MAX_MIX_PASSES:
        return
    most = max(range(len(sizes)), key=lambda s: -(-counts[s] // sizes[s]))

    def passes_at(stop: int) -> int:
        return sum(-(-_first_rank_at_least(s, stop, units) // n) for s, n in enumerate(sizes))

    # A stop that fits, for the message: the passes grow about in proportion to the stop,
    # so a proportional one nearly fits; a few smaller steps find one that does.
    low = max(1, stop_samples * MAX_MIX_PASSES // passes)
    while low > 1 and passes_at(low) > MAX_MIX_PASSES:
        low = low * 15 // 16
    raise InvalidArgument(
        f"stop_samples={stop_samples} would pass over the sources' rows {passes} times in one "
        f"epoch (source {most} alone, of {sizes[most]} rows, {-(-counts[most] // sizes[most])} "
        f"times), more than the {MAX_MIX_PASSES} a mix may make; use stop_samples <= {low} "
        "(about the most these sources and weights allow), give the small sources less "
        "weight, or leave them out"
    )


def mixed_order(
    sizes: Sequence[int],
    units: Sequence[int],
    *,
    seed: int,
    epoch: int,
    shuffle: bool,
    stop_samples: int,
) -> Int64Array:
    """One epoch of the mix as global positions, before dealing to ranks (NOTE [ Mixed
    order ]); its length is ``sum(mix_counts(...))``."""
    counts = mix_counts(sizes, units, stop_samples)
    starts = source_starts(sizes)
    order = np.empty(sum(counts), np.int64)
    for s, count in enumerate(counts):
        ranks = _ranks(s, np.arange(count, dtype=np.int64), units)
        order[ranks] = starts[s] + _rows(s, count, sizes[s], seed, epoch, shuffle)
    return order


def plan_mix_epoch(
    sizes: Sequence[int],
    mix: MixOptions,
    options: SamplerOptions,
    epoch: int,
    *,
    start: int = 0,
    order_world_size: int | None = None,
    rotation: int = 0,
) -> EpochPlan:
    """This rank's batches of one epoch of the mix from global entry ``start`` on, each
    batch's rows grouped by source; under a schedule, the epoch's order built for
    ``order_world_size`` ranks (default ``options.world_size``).

    Raises:
        InvalidArgument: ``options.mode`` is not "uniform", or as ``mix_counts``.
        FailedPrecondition: as ``mix_counts``.
    """
    if options.mode != "uniform":
        raise InvalidArgument(
            f"sampling={options.mode!r} cannot be used with a mix: the mix's weights decide "
            "how samples are drawn; use sampling='uniform'"
        )
    if mix.schedule is None:
        order = mixed_order(
            sizes,
            mix.units,
            seed=options.seed,
            epoch=epoch,
            shuffle=options.shuffle,
            stop_samples=mix.stop_samples,
        )
    else:
        seed, shuffle = options.seed, options.shuffle
        order = scheduled_order(
            sizes,
            mix.schedule,
            lambda s, count: _rows(s, count, sizes[s], seed, epoch, shuffle),
            length=sum(mix_counts(sizes, mix.units, mix.stop_samples)),
            options=options,
            epoch=epoch,
            order_world_size=order_world_size,
            resolution=SHARE_RESOLUTION,
        )
    rest = rest_of_order(order, options, start=start, rotation=rotation)
    plan = deal_blocks(rest, options, num_batches(order.size, options, start=start))
    return group_by_source(plan, source_starts(sizes))


def deal_blocks(rest: Int64Array, options: SamplerOptions, batches: int) -> EpochPlan:
    """Rank ``options.rank``'s plan of ``batches`` batches from ``rest`` (a multiple of
    ``world_size`` entries, as ``rest_of_order`` returns it): its batch k is the rank's run of
    global batch k (``batch_size`` entries each; the short last global batch is split into
    equal runs)."""
    world, size, rank = options.world_size, options.batch_size, options.rank
    assert rest.size % world == 0, "the rest is padded or truncated for the world size"
    per_rank = rest.size // world
    whole = per_rank // size
    head = rest[: whole * size * world].reshape(whole, world, size)[:, rank, :].reshape(-1)
    tail = rest[whole * size * world :]
    short = tail.size // world
    positions = np.concatenate([head, tail[rank * short : (rank + 1) * short]])
    return EpochPlan(positions, size, batches)


def group_by_source(plan: EpochPlan, starts: Int64Array) -> EpochPlan:
    """``plan`` with each batch's rows stably sorted by source."""
    positions = plan.positions
    if starts.size == 1 or positions.size == 0:
        return plan
    source = np.searchsorted(starts[1:], positions, side="right")
    batch = np.arange(positions.size) // plan.batch_size
    grouped = positions[np.lexsort((source, batch))]
    return EpochPlan(grouped, plan.batch_size, plan.num_batches)


# -- the order's arithmetic -------------------------------------------------------------------


def _due_before(other: int, s: int, j: int, units: Sequence[int]) -> int:
    """Items of source ``other`` served before item ``j`` of source ``s`` (Python ints)."""
    if other == s:
        return j
    # Item i of `other` comes first iff (2i + 1) / W_other < (2j + 1) / W_s, or equal and
    # other < s: (2i + 1) * W_s <= x (or < x), x = (2j + 1) * W_other. And
    # #{i >= 0 : (2i + 1) * w <= y} = (y + w) // (2 * w) for y >= 0.
    w = units[s]
    x = (2 * j + 1) * units[other]
    return (x + w) // (2 * w) if other < s else (x - 1 + w) // (2 * w)


def _ranks(s: int, items: Int64Array, units: Sequence[int]) -> Int64Array:
    """Each item of source ``s``'s position in the (endless) mixed order; as ``_due_before``,
    vectorised."""
    ranks = items.copy()
    w = np.int64(units[s])
    odd = 2 * items + 1
    for other in range(len(units)):
        if other == s:
            continue
        x = odd * np.int64(units[other])
        x += w if other < s else w - 1
        x //= 2 * w
        ranks += x
    return ranks


def _rank(s: int, j: int, units: Sequence[int]) -> int:
    return sum(_due_before(other, s, j, units) for other in range(len(units)))


def _first_rank_at_least(s: int, target: int, units: Sequence[int]) -> int:
    """The first item of source ``s`` whose rank is >= ``target``: the source's items among the
    first ``target`` of the order (ranks grow with the item, and rank(s, target) >= target)."""
    low, high = 0, target
    while low < high:
        mid = (low + high) // 2
        if _rank(s, mid, units) >= target:
            high = mid
        else:
            low = mid + 1
    return low


def _rows(s: int, count: int, n: int, seed: int, epoch: int, shuffle: bool) -> Int64Array:
    """Source ``s``'s rows for its items 0..count-1: its passes over its ``n`` rows."""
    passes = []
    pace = Pace()
    for q in range(-(-count // n)):
        pace()
        take = min(n, count - q * n)
        if shuffle:
            sequence = np.random.SeedSequence([seed, epoch, MIX_PASS_TAG, s, q])
            perm = np.random.Generator(np.random.PCG64(sequence)).permutation(n)
            passes.append(perm[:take].astype(np.int64, copy=False))
        else:
            passes.append(np.arange(take, dtype=np.int64))
    if not passes:
        return np.empty(0, np.int64)
    return passes[0] if len(passes) == 1 else np.concatenate(passes)


# -- snapshot tokens ----------------------------------------------------------------------------


def mix_token(pins: Sequence[tuple[str, str]]) -> str:
    """The snapshot token of a mixed session: each source's (version, snapshot token), in
    source order, as one opaque string."""
    payload = json.dumps([list(pin) for pin in pins], separators=(",", ":")).encode()
    return _TOKEN_PREFIX + base64.urlsafe_b64encode(payload).decode("ascii").rstrip("=")


def parse_mix_token(token: str, sources: int) -> list[tuple[str, str]]:
    """The pins ``mix_token`` wrote, one per source.

    Raises:
        InvalidArgument: ``token`` is not a mix's token, or is one of another number of
            sources.
    """
    pins: object = None
    if token.startswith(_TOKEN_PREFIX):
        text = token[len(_TOKEN_PREFIX) :]
        try:
            raw = base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))
            pins = json.loads(raw.decode("utf-8"))
        except (binascii.Error, UnicodeDecodeError, ValueError):
            pins = None
    if not (
        isinstance(pins, list)
        and all(
            isinstance(p, list) and len(p) == 2 and all(isinstance(x, str) for x in p) for p in pins
        )
    ):
        raise InvalidArgument(
            f"snapshot {token[:80]!r} is not the snapshot of a mix; pass the snapshot of a "
            "Loader on the same mix (Loader.snapshot), or none to read the sources as they "
            "are now"
        )
    if len(pins) != sources:
        raise InvalidArgument(
            f"the snapshot is of a mix of {len(pins)} sources, this mix has {sources}; pass "
            "the snapshot of a Loader on the same mix"
        )
    return [(p[0], p[1]) for p in pins]
