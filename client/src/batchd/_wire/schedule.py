"""A mix's weights over training steps: the schedule both sides evaluate the same way.

A ``batchd.Mix`` may change its weights as training goes on: a schedule is the base weights
and a list of points ``(step, weights)``, steps strictly increasing, weights one per source
(>= 0, at least one > 0). A *step* is a global batch: one batch on every rank of the job.
Step ``s`` of epoch ``e`` is global batch ``e * B + k`` of the run, ``B`` the epoch's batches
per rank (``len(loader)`` at the world size that began the epoch), ``k`` the batch within it:
the counter a training loop keeps as its global step.

The weights in force at step ``s``:

- ``"step"``: the weights of the last point at or before ``s``; the base weights before the
  first point.
- ``"linear"``: the base weights before the first point; between two consecutive points,
  the straight line between their weights; the last point's weights from it on. A ramp from
  the start is a point at step 0.

The server turns them into exact integer shares (:meth:`WeightSchedule.units_at`) so that
every replica computes the same batches; both sides use the float shares
(:meth:`WeightSchedule.shares_at`) only to say what a source was expected to get, at the
step :func:`global_step` gives a batch.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Sequence
from dataclasses import dataclass
from fractions import Fraction
from typing import Final

from batchd._wire.epoch import rest_of_epoch
from batchd._wire.mix import finite_sum
from batchd.errors import InvalidArgument

__all__ = [
    "INTERPOLATIONS",
    "MAX_SCHEDULE_POINTS",
    "MAX_SCHEDULE_STEP",
    "WeightSchedule",
    "apportion",
    "global_step",
]

INTERPOLATIONS: Final = ("step", "linear")
MAX_SCHEDULE_POINTS: Final = 1024
MAX_SCHEDULE_STEP: Final = 1 << 62


def _finite_at_least_zero(weight: object) -> bool:
    return (
        not isinstance(weight, bool)
        and isinstance(weight, int | float)
        and math.isfinite(weight)
        and weight >= 0
    )


def apportion(weights: Sequence[int | float | Fraction], seats: int) -> tuple[int, ...]:
    """``seats`` integer shares in proportion to ``weights`` (>= 0, sum > 0), exactly: each
    share is the floor of its quota or one more, the ones more going to the largest
    remainders, ties to the lowest index (Hamilton's method in exact arithmetic). A weight
    of 0 gets 0."""
    if all(isinstance(w, int) for w in weights):
        numerators = [int(w) for w in weights]
    else:
        exact = [Fraction(w) for w in weights]
        scale = math.lcm(*(f.denominator for f in exact))
        numerators = [int(f * scale) for f in exact]
    total = sum(numerators)
    assert total > 0 and min(numerators) >= 0, "weights >= 0, some > 0"
    shares = [n * seats // total for n in numerators]
    remainders = [n * seats % total for n in numerators]
    left = seats - sum(shares)
    by_remainder = sorted(range(len(shares)), key=lambda i: (-remainders[i], i))
    for i in by_remainder[:left]:
        shares[i] += 1
    return tuple(shares)


def global_step(
    epoch: int,
    batch: int,
    *,
    rows: int,
    batch_size: int,
    world_size: int,
    drop_last: bool,
    start: int = 0,
    order_world_size: int = 0,
) -> int:
    """The global step of a rank's ``batch`` of ``epoch`` (see the module's docs):
    ``epoch * len(loader) + batch`` at the world size that began the epoch; after an elastic
    resume (a plan from entry ``start`` of an order built for ``order_world_size`` ranks), the
    global batch of that order the batch begins in. Both sides count a batch's step with
    it: the server's counters and the client's stats."""
    order_world = order_world_size or world_size
    per_epoch = rest_of_epoch(
        rows, 0, batch_size=batch_size, world_size=order_world, drop_last=drop_last
    )[1]
    within = (start + batch * batch_size * world_size) // (batch_size * order_world)
    return epoch * per_epoch + within


@dataclass(frozen=True)
class WeightSchedule:
    """The weights of a mix's sources as a function of the global step, validated.

    Attributes:
        base: The weights before the first point (the Mix's own), one per source, > 0.
        points: ``(step, weights)`` pairs, steps strictly increasing from 0, weights one per
            source in the base's order, each finite and >= 0, some > 0.
        interpolate: ``"step"`` or ``"linear"`` (see the module's docs).

    Raises:
        InvalidArgument: a point out of order, of another number of sources, or with a bad
            weight; an unknown interpolation; too many points.
    """

    base: tuple[float, ...]
    points: tuple[tuple[int, tuple[float, ...]], ...]
    interpolate: str = "step"

    def __post_init__(self) -> None:
        self._check()
        # Not a field: looked up for every global batch of a plan.
        object.__setattr__(self, "_steps", tuple(step for step, _ in self.points))

    def _check(self) -> None:
        if self.interpolate not in INTERPOLATIONS:
            raise InvalidArgument(
                f"interpolate={self.interpolate!r} must be one of {', '.join(INTERPOLATIONS)}"
            )
        if not self.points:
            raise InvalidArgument(
                "a mix schedule needs at least one (step, weights) point; leave schedule out "
                "for fixed weights"
            )
        if len(self.points) > MAX_SCHEDULE_POINTS:
            raise InvalidArgument(
                f"the mix schedule has {len(self.points)} points; at most {MAX_SCHEDULE_POINTS}"
            )
        sources = len(self.base)
        previous = -1
        for step, weights in self.points:
            if (
                isinstance(step, bool)
                or not isinstance(step, int)
                or not 0 <= step <= MAX_SCHEDULE_STEP
            ):
                raise InvalidArgument(
                    f"mix schedule step {step!r} must be an integer from 0 to "
                    f"{MAX_SCHEDULE_STEP} (a global batch: one batch on every rank)"
                )
            if step <= previous:
                raise InvalidArgument(
                    f"mix schedule steps must increase strictly; step {step} follows step "
                    f"{previous}"
                )
            previous = step
            if len(weights) != sources:
                raise InvalidArgument(
                    f"the mix schedule's point at step {step} has {len(weights)} weights; the "
                    f"mix has {sources} sources, and every point weighs each of them"
                )
            bad = [w for w in weights if not _finite_at_least_zero(w)]
            if bad:
                raise InvalidArgument(
                    f"the mix schedule's point at step {step} has weight {bad[0]!r}; weights "
                    "must be finite numbers >= 0"
                )
            if not finite_sum(weights):
                raise InvalidArgument(
                    f"the mix schedule's point at step {step} has weights that add up to more "
                    "than the largest float; scale them down (only their ratios matter)"
                )
            if not any(w > 0 for w in weights):
                raise InvalidArgument(
                    f"the mix schedule's point at step {step} weighs every source 0; give at "
                    "least one source a weight > 0"
                )

    @property
    def steps(self) -> tuple[int, ...]:
        """The points' steps."""
        steps: tuple[int, ...] = self.__dict__["_steps"]
        return steps

    def _segment(self, step: int) -> int:
        """Index of the last point at or before ``step``; -1 before the first."""
        return bisect.bisect_right(self.steps, step) - 1

    def shares_at(self, step: int) -> tuple[float, ...]:
        """Each source's share (summing to 1) of the samples of global batch ``step``."""
        i = self._segment(step)
        if i < 0:
            weights: Sequence[float] = self.base
        elif self.interpolate == "step" or i == len(self.points) - 1:
            weights = self.points[i][1]
        else:
            (x0, a), (x1, b) = self.points[i], self.points[i + 1]
            t = (step - x0) / (x1 - x0)
            weights = [wa / sum(a) * (1 - t) + wb / sum(b) * t for wa, wb in zip(a, b, strict=True)]
        total = math.fsum(weights)
        return tuple(w / total for w in weights)

    def units_at(self, step: int, resolution: int) -> tuple[int, ...]:
        """The shares of global batch ``step`` as integers summing to ``resolution``, exact:
        the same on every machine. A source weighed 0 there gets 0."""
        i = self._segment(step)
        if i < 0:
            return self._point_units(-1, resolution)
        if self.interpolate == "step" or i == len(self.points) - 1:
            return self._point_units(i, resolution)
        x0, x1 = self.points[i][0], self.points[i + 1][0]
        a, b = self._point_units(i, resolution), self._point_units(i + 1, resolution)
        # Between the points' integer shares: sum(a) == sum(b) == resolution, so the
        # numerators sum to resolution * (x1 - x0) and ``apportion`` needs no division.
        return apportion(
            [ua * (x1 - step) + ub * (step - x0) for ua, ub in zip(a, b, strict=True)], resolution
        )

    def _point_units(self, i: int, resolution: int) -> tuple[int, ...]:
        cache = self.__dict__.setdefault("_units", {})
        key = (i, resolution)
        if key not in cache:
            cache[key] = apportion(self.base if i < 0 else self.points[i][1], resolution)
        units: tuple[int, ...] = cache[key]
        return units

    def wire_points(self) -> list[tuple[int, list[float]]]:
        """The points as plain values (a saved state, a message)."""
        return [(step, list(weights)) for step, weights in self.points]
