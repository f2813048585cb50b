"""A session's stream (one StreamBatches call), and which plan it serves: the epoch's own,
the rest of it (an elastic resume), or a rotation of it (NOTE [ Share groups ]); the plans
a session made of its epochs.

A stream counts its batches from the epoch's first (``Stream.start``, ``next_submit``);
:meth:`Stream.index` maps that count to the plan's batch index, which is what a task decodes
and what the client is told. Without a rotation the two are the same number.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Final, NamedTuple

from batchd_server.errors import InvalidArgument
from batchd_server.metrics.planning import PLAN_SECONDS
from batchd_server.planning.pacing import collector_paused
from batchd_server.planning.sampling import EpochPlan, EpochStart, SamplerOptions
from batchd_server.workers.task import BatchResult

__all__ = ["EpochPlans", "Stream", "StreamAt", "may_join", "stream_plan"]

_MAX_PLANS: Final = 2
"""Plans a session keeps: the epoch it streams, and the next (or a resume's)."""


class EpochPlans:
    """A session's plans of its epochs, made on demand by ``make``; the last few are kept
    (a plan is a pure function of where it starts). Thread-safe."""

    def __init__(self, make: Callable[[EpochStart], EpochPlan], world_size: int) -> None:
        """``world_size``: the session's, what an order built for 0 ranks means."""
        self._make = make
        self._world_size = world_size
        self._lock = threading.Lock()
        self._plans: dict[EpochStart, EpochPlan] = {}

    def __call__(
        self, epoch: int, start: int = 0, order_world_size: int = 0, rotation: int = 0
    ) -> EpochPlan:
        key = EpochStart(epoch, start, order_world_size or self._world_size, rotation)
        with self._lock:
            plan = self._plans.get(key)
        if plan is None:
            with PLAN_SECONDS.time(), collector_paused():
                plan = self._make(key)
            with self._lock:
                while len(self._plans) >= _MAX_PLANS:
                    self._plans.pop(next(iter(self._plans)))
                self._plans[key] = plan
        return plan


@dataclass(eq=False)
class Stream:
    """One StreamBatches call: an epoch from ``start`` to the session's last batch."""

    epoch: int
    start: int
    plan: EpochPlan
    next_submit: int
    """The next batch to hand to a worker once a slot is free."""
    leased: bool = False
    """An shm stream: its slots go out under session leases, not per batch index."""
    read_shared: bool = False
    """An shm stream whose client reads other sessions' rings: a share group may lend it
    another member's slot (NOTE [ Share groups ])."""
    working: dict[int, tuple[int, Future[BatchResult]]] = field(default_factory=dict)
    """Batch index -> (WORKING slot, its task), until the batch goes out."""
    delivered: dict[int, int] = field(default_factory=dict)
    """Inline streams: batch index -> DELIVERED slot, until acked."""
    closed: bool = False
    stride: int = 1
    """Every ``stride``-th batch from ``start``: a client striping over replicas."""
    start_sample: int = 0
    order_world_size: int = 0
    """The plan is the rest of the epoch's order (built for this world size, 0: the
    session's) from this entry on: an elastic resume."""
    rotation: int = 0
    """A rotated epoch (NOTE [ Share groups ]): the stream's batch ``i`` (counted from the
    epoch's first, as ``start`` and ``next_submit`` are) is the plan's batch
    ``(rotation + i) % num_batches``; 0 is the plan's own order."""

    def index(self, i: int) -> int:
        """The plan's index of the stream's ``i``-th batch of the epoch."""
        if self.rotation == 0:
            return i
        return (self.rotation + i) % self.plan.num_batches

    def first_due(self) -> int:
        """The stream's count (as ``next_submit``) of its first batch not yet sent."""
        if self.rotation == 0:
            return min(self.working, default=self.next_submit)
        n = self.plan.num_batches
        return min(((k - self.rotation) % n for k in self.working), default=self.next_submit)


class StreamAt(NamedTuple):
    """Where a StreamStart asks an epoch to begin (``StreamStart`` names the fields)."""

    epoch: int
    start_sample: int
    order_world_size: int
    rotation: int


def may_join(at: StreamAt, sampler: SamplerOptions, *, start_batch: int, stride: int) -> bool:
    """Whether a stream that asks to start at its share group's position
    (``StreamStart.join_share``) may: the server's one decision, which a client never makes
    (it asks at every epoch of a ``share=`` Loader). Only a fresh epoch of the session's own
    order may (its first batch: not a resume, not a rotation of its own), served whole by
    this stream (not striped over replicas: their groups are each at their own position),
    for a job of one rank (the ranks of a larger job are each in their own group, at its own
    position, and must serve one order); see NOTE [ Share groups ]."""
    return (
        at.rotation == 0
        and at.start_sample == 0
        and at.order_world_size in (0, sampler.world_size)
        and start_batch == 0
        and stride <= 1
        and sampler.world_size == 1
    )


def stream_plan(
    plan: Callable[[int, int, int, int], EpochPlan],
    sampler: SamplerOptions,
    at: StreamAt,
    *,
    join: Callable[[int, EpochPlan], int] | None,
    slots: int,
) -> tuple[EpochPlan, int]:
    """The plan a stream serves, and its rotation in whole batches (``Stream.rotation``);
    see ``StreamStart.rotation`` and ``join_share``.

    Args:
        plan: The session's ``Session.plan`` (epoch, start, order world size, rotation).
        sampler: The session's sampling.
        at: Where the stream begins.
        join: Where the session's group is in an epoch's plan (``Dispatch.position``), when
            the stream asked to join it and :func:`may_join`.
        slots: The session's ring slots: a group within that many batches of the epoch's
            start is still in reach of its prefetch, so it starts at the first batch, as a
            lone Loader does, and is not rotated.

    Raises:
        InvalidArgument: a bad rotation (or as ``Session.plan``).
    """
    epoch, start, order_world_size, rotation = at
    own_order = order_world_size in (0, sampler.world_size)
    if rotation < 0:
        raise InvalidArgument(f"rotation={rotation} must be >= 0")
    if rotation == 0 or start != 0 or not own_order:
        whole = plan(epoch, start, order_world_size, rotation)  # checks them
        if join is None:
            return whole, 0
        k = join(epoch, whole)
        return whole, k if slots <= k < whole.num_batches else 0
    # A rotation by whole global batches of the session's own order: the plan's own batches,
    # served from batch rotation / G on (so the group's batches are the same tasks).
    whole = plan(epoch, 0, order_world_size, 0)
    batches, rest = divmod(rotation, sampler.batch_size * sampler.world_size)
    if rest == 0 and batches < whole.num_batches:
        return whole, batches
    return plan(epoch, 0, order_world_size, rotation), 0
