"""A mix whose weights change with the global step: one epoch's order under a schedule.

NOTE [ Scheduled mix ]
~~~~~~~~~~~~~~~~~~~~~~
A schedule (``batchd._wire.schedule.WeightSchedule``) makes the weights a function of the
global step, the run's global batch counter. Global batch ``b`` of epoch ``e`` (entries
``[b * G, (b + 1) * G)`` of the epoch's global order, ``G = batch_size * world_size`` of the
world size that began the epoch) is step ``e * B + b``, ``B`` the epoch's batches per rank
at that world size. Everything below is a pure function of (sizes, schedule, seed, epoch,
G, B), so a plan from any cursor, on any replica, at any world size the rest is dealt to,
replays the same entries.

*The epoch's length* is the length the base weights give it (``mix_counts``): 0 stops
("first") where the first source would run out under the base weights, N stops after N.
The length is then the same every epoch, as ``len(loader)`` promises; a source the schedule
favours may run out before the epoch ends and begins its next pass over its rows in a new
order (``_rows``): no row repeats within a pass, as with ``stop=N``.

*Each global batch's composition* is decided batch by batch with carried credits, in exact
integer arithmetic. Batch ``b`` has the weights in force at its step as integer shares
``u_s`` summing to ``R = SHARE_RESOLUTION`` (``WeightSchedule.units_at``). Every source
earns ``g * u_s`` credits (``g`` the batch's entries, R credits a sample); the batch gives
each source weighed > 0 the whole samples its credit holds, the rest of the ``g`` to the
largest remainders (ties to the lowest index), and each source pays R a sample. A source
weighed 0 at ``b`` gets none of batch ``b``. The carry keeps every source's count since the
epoch's start within about one sample of the sum of its shares (the tests check two), so a
window of constant weights has their shares to a sample or two whatever its length.

*Within a global batch* the entries are interleaved by a smooth weighted round robin of the
batch's counts (item j of a source with c entries in the batch is due at (2j + 1) / c, ties
to the lower source; each item's rank in the batch has a closed form, as in NOTE [ Mixed
order ]), so that ``deal_blocks`` gives each rank a run that keeps the shares.
Each source's items are its next entries in its own order (its passes), batch after batch.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable, Sequence
from typing import Final

import numpy as np

from batchd._wire.epoch import rest_of_epoch
from batchd._wire.schedule import WeightSchedule
from batchd_server.errors import InvalidArgument
from batchd_server.planning.sampling import Int64Array, SamplerOptions

__all__ = ["MAX_SCHEDULED_BATCHES", "batch_counts", "scheduled_order"]

MAX_SCHEDULED_BATCHES: Final = 1 << 22
"""Global batches of one epoch of a scheduled mix at most: each costs a few Python steps
(about 20 s for this many), and a session plans its epochs as it starts them."""

_MAX_WORLD_SIZE: Final = 1 << 16
_MAX_GLOBAL_BATCH: Final = 1 << 31
"""Keeps ``(2j + 1) * count`` (the ranks within a global batch) within int64."""

RowsOf = Callable[[int, int], Int64Array]
"""``rows(s, count)``: source ``s``'s rows for its items 0..count-1 (its passes)."""


def batch_counts(
    schedule: WeightSchedule,
    *,
    length: int,
    global_batch: int,
    first_step: int,
    resolution: int,
) -> Int64Array:
    """Entries of each source in each global batch of an epoch of ``length`` entries whose
    first global batch is step ``first_step`` (NOTE [ Scheduled mix ]); shape (batches,
    sources)."""
    sources = len(schedule.base)
    batches = -(-length // global_batch)
    counts = np.zeros((batches, sources), np.int64)
    credits = [0] * sources
    last: tuple[int, tuple[int, ...]] | None = None
    for b in range(batches):
        g = min(global_batch, length - b * global_batch)
        step = first_step + b
        if last is None or schedule.interpolate == "linear" or last[0] != _window(schedule, step):
            last = (_window(schedule, step), schedule.units_at(step, resolution))
        counts[b] = _allocate(credits, last[1], g, resolution)
    return counts


def _window(schedule: WeightSchedule, step: int) -> int:
    """Points at or before ``step``: under "step" interpolation, the weights' window."""
    return bisect.bisect_right(schedule.steps, step)


def _allocate(credits: list[int], units: Sequence[int], g: int, resolution: int) -> list[int]:
    """One batch's ``g`` entries by credit; ``credits`` is carried (updated in place)."""
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


def scheduled_order(
    sizes: Sequence[int],
    schedule: WeightSchedule,
    rows: RowsOf,
    *,
    length: int,
    options: SamplerOptions,
    epoch: int,
    order_world_size: int | None,
    resolution: int,
) -> Int64Array:
    """One epoch of a scheduled mix of ``length`` entries (the base weights' length) as
    global positions (source s's row r is position ``sum(sizes[:s]) + r``), before dealing
    to ranks, built for ``order_world_size`` ranks (default ``options.world_size``); see
    NOTE [ Scheduled mix ]."""
    world = order_world_size or options.world_size
    global_batch = options.batch_size * world
    if not 1 <= world <= _MAX_WORLD_SIZE or global_batch >= _MAX_GLOBAL_BATCH:
        raise InvalidArgument(
            f"order_world_size={world} must be from 1 to {_MAX_WORLD_SIZE}, and a scheduled "
            f"mix's global batch (batch_size * world_size = {global_batch}) below "
            f"{_MAX_GLOBAL_BATCH}"
        )
    per_epoch = rest_of_epoch(
        length, 0, batch_size=options.batch_size, world_size=world, drop_last=options.drop_last
    )[1]
    if -(-length // global_batch) > MAX_SCHEDULED_BATCHES:
        raise InvalidArgument(
            f"an epoch of this scheduled mix has {length} samples in global batches of "
            f"{global_batch}: more than {MAX_SCHEDULED_BATCHES} global batches, which the "
            "server plans one by one; use a larger batch_size or a smaller stop"
        )
    counts = batch_counts(
        schedule,
        length=length,
        global_batch=global_batch,
        first_step=epoch * per_epoch,
        resolution=resolution,
    )
    order = np.empty(length, np.int64)
    batches = counts.shape[0]
    start = 0
    for s, n in enumerate(sizes):
        per_batch = counts[:, s]
        total = int(per_batch.sum())
        batch = np.repeat(np.arange(batches, dtype=np.int64), per_batch)
        # Each item's index j within its batch's items of this source, and its rank in the
        # batch: the items of every other source due before it, as ``mixing._due_before``
        # counts them with this batch's counts as the units (ties to the lower source).
        first_item = np.cumsum(per_batch) - per_batch
        local = np.arange(total, dtype=np.int64) - np.repeat(first_item, per_batch)
        w = per_batch[batch]
        odd = 2 * local + 1
        rank = local.copy()
        for other in range(len(sizes)):
            if other != s:
                rank += (odd * counts[batch, other] + (w if other < s else w - 1)) // (2 * w)
        order[batch * global_batch + rank] = start + rows(s, total)
        start += n
    return order
