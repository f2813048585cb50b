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
import heapq
from collections.abc import Callable, Sequence
from typing import Final

import numpy as np

from batchd._wire.epoch import rest_of_epoch
from batchd._wire.schedule import WeightSchedule
from batchd_server.errors import InvalidArgument
from batchd_server.planning.pacing import Pace
from batchd_server.planning.sampling import Int64Array, SamplerOptions

__all__ = ["MAX_SCHEDULED_BATCHES", "MAX_SCHEDULED_WORK", "batch_counts", "scheduled_order"]

MAX_SCHEDULED_BATCHES: Final = 1 << 22
"""Global batches of one epoch of a scheduled mix at most."""
MAX_SCHEDULED_WORK: Final = 1 << 24
"""``global batches * (sources + 2)`` of one epoch of a scheduled mix at most: each global
batch's composition costs a few Python steps per source (about 1.5 µs each, so some 25 s
for this many on one core), and a session plans its epochs as it starts them."""

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
    # Under "step" interpolation the units change only where a point's window begins.
    constant = schedule.interpolate == "step"
    window = -1
    units: tuple[int, ...] = ()
    pace = Pace()
    for b in range(batches):
        pace()
        g = min(global_batch, length - b * global_batch)
        step = first_step + b
        at = bisect.bisect_right(schedule.steps, step)
        if not constant or at != window:
            window, units = at, schedule.units_at(step, resolution)
        counts[b] = _allocate(credits, units, g, resolution)
    return counts


def _allocate(credits: list[int], units: Sequence[int], g: int, resolution: int) -> list[int]:
    """One batch's ``g`` entries by credit; ``credits`` is carried (updated in place).

    Each source weighed > 0 takes the whole samples its credit holds; then, one sample at a
    time, the source with the largest credit left (ties to the lowest index) takes one more
    while the batch is short, and the one with the smallest (ties to the highest index) and
    a sample gives one back while it is over. A heap keyed as that choice is makes each step
    a pop and a push, where a scan of every source would be one each."""
    eligible = [s for s, u in enumerate(units) if u > 0]
    take = [0] * len(units)
    for s in eligible:
        credits[s] += g * units[s]
        take[s] = max(0, credits[s] // resolution)
    total = sum(take)
    if total < g:
        short = [(take[s] * resolution - credits[s], s) for s in eligible]
        heapq.heapify(short)
        for _ in range(g - total):
            key, s = heapq.heappop(short)
            take[s] += 1
            heapq.heappush(short, (key + resolution, s))
    elif total > g:
        over = [(credits[s] - take[s] * resolution, -s) for s in eligible if take[s] > 0]
        heapq.heapify(over)
        for _ in range(total - g):
            key, negative = heapq.heappop(over)
            take[-negative] -= 1
            if take[-negative] > 0:
                heapq.heappush(over, (key + resolution, negative))
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
    batches = -(-length // global_batch)
    work = batches * (len(sizes) + 2)
    if batches > MAX_SCHEDULED_BATCHES or work > MAX_SCHEDULED_WORK:
        most = min(MAX_SCHEDULED_BATCHES, MAX_SCHEDULED_WORK // (len(sizes) + 2))
        raise InvalidArgument(
            f"an epoch of this scheduled mix has {length} samples in global batches of "
            f"{global_batch}: {batches} global batches of {len(sizes)} sources, more than "
            f"the {most} the server plans one by one for so many sources; use a larger "
            f"batch_size, a smaller stop (at most {most * global_batch} samples), or fewer "
            "sources"
        )
    counts = batch_counts(
        schedule,
        length=length,
        global_batch=global_batch,
        first_step=epoch * per_epoch,
        resolution=resolution,
    )
    order = np.empty(length, np.int64)
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
