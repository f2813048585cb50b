"""Rotated epochs (a share= Loader that joined its group part way through an epoch): the
client's saved state and the server's plan for it agree, at the same and at another world
size, with and without drop_last. Each case runs the real client arithmetic
(``batchd._state.Position``) against the real server choice of plan
(``sessions.streams.stream_plan``) over ``plan_epoch``."""

from __future__ import annotations

import dataclasses
from collections import Counter
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from batchd._options import LoaderOptions
from batchd._proto.batchd.v1 import loader_pb2
from batchd._state import Cursor, Position
from batchd_server.planning.sampling import (
    EpochPlan,
    EpochStart,
    SamplerOptions,
    num_batches,
    plan_epoch,
)
from batchd_server.sessions.streams import StreamAt, stream_plan

PROPERTY = settings(max_examples=150, deadline=None)


def _sampler(options: SamplerOptions, world_size: int, rank: int) -> SamplerOptions:
    return dataclasses.replace(options, world_size=world_size, rank=rank)


def _reply(n: int, options: SamplerOptions) -> loader_pb2.OpenSessionResponse:
    return loader_pb2.OpenSessionResponse(
        num_batches=num_batches(n, options), num_rows=n, snapshot="s", rotations=True
    )


def _position(options: SamplerOptions) -> Position:
    return Position(
        LoaderOptions(
            dataset="d",
            batch_size=options.batch_size,
            shuffle=options.shuffle,
            seed=options.seed,
            rank=0,
            world_size=options.world_size,
            drop_last=options.drop_last,
        )
    )


def _serve(n: int, options: SamplerOptions, epoch: int, position: Position) -> list[int]:
    """What every rank of ``options.world_size`` serves from ``position`` to the epoch's end,
    as the server plans a stream started at its cursor."""
    cursor = position.cursor(_reply(n, options))
    if cursor.epoch != epoch:
        return []
    out: list[int] = []
    for rank in range(options.world_size):
        sampler = _sampler(options, options.world_size, rank)

        def plan(
            e: int, start: int, ows: int, rotation: int, s: SamplerOptions = sampler
        ) -> EpochPlan:
            return plan_epoch(n, s, EpochStart(e, start, ows or None, rotation))

        at = StreamAt(epoch, cursor.start, cursor.order_world_size, cursor.rotation)
        whole, r = stream_plan(plan, sampler, at, join=None, slots=0)
        assert r == position.rotated_batches(_reply(n, options)), "client and server disagree"
        for i in range(cursor.next_batch, whole.num_batches):
            k = (r + i) % whole.num_batches if r else i
            if rank == 0:
                assert k == position.plan_index(i, _reply(n, options))
            out.extend(int(p) for p in whole.batch(k))
    return out


@st.composite
def rotated(draw: st.DrawFn) -> dict[str, Any]:
    options = SamplerOptions(
        batch_size=draw(st.integers(1, 6)),
        shuffle=True,
        seed=draw(st.integers(0, 1 << 32)),
        world_size=draw(st.integers(1, 3)),
        drop_last=draw(st.booleans()),
    )
    n = draw(st.integers(2 * options.batch_size * options.world_size, 120))
    batches = num_batches(n, options)
    return {
        "n": n,
        "options": options,
        "r": draw(st.integers(1, batches - 1)),
        "i": draw(st.integers(1, batches - 1)),
        "m": draw(st.integers(1, 3)),
    }


@PROPERTY
@given(rotated())
def test_a_rotated_epoch_resumed_at_any_world_size_serves_the_rest_once(
    case: dict[str, Any],
) -> None:
    """W ranks join at batch r and serve i batches of the rotated epoch; a state from that
    resumes on M ranks. Same world size: exactly the lone epoch's batches, each once. Another:
    each sample once, the padding (or drop_last's tail) of one global batch of M aside."""
    n, options, r, i, m = case["n"], case["options"], case["r"], case["i"], case["m"]
    epoch, w, batch = 3, options.world_size, options.batch_size
    lone = _position(options)
    lone.move_to(Cursor(epoch))
    whole_epoch = Counter(_serve(n, options, epoch, lone))

    position = _position(options)
    position.move_to(Cursor(epoch))
    position.joined(r)
    everything = _serve(n, options, epoch, position)
    assert Counter(everything) == whole_epoch, "a rotated epoch is the lone epoch's batches"
    position.next_batch = i
    state = position.get_state(_reply(n, options))
    assert state["format"] == 3 and state["rotation"] == r * batch * w
    served = []  # what i batches of each rank served
    for rank in range(w):
        plan = plan_epoch(n, _sampler(options, w, rank), EpochStart(epoch))
        served += [int(p) for j in range(i) for p in plan.batch((r + j) % plan.num_batches)]
    on_m = dataclasses.replace(options, world_size=m)
    resumed = _position(on_m)
    reply_m = _reply(n, on_m)
    resumed.reset(resumed.read_state(state, reply_m), reply_m, target="t")
    rest = _serve(n, on_m, epoch, resumed)
    counts = Counter(served + rest)
    if m == w:
        assert resumed.cursor(reply_m).start == 0, "the same rotated batches, not a replan"
        assert counts == whole_epoch
        return
    real = set(range(n))
    assert set(counts) <= real
    if options.drop_last:
        assert max(counts.values()) == 1, "a sample served twice"
        assert n - len(counts) < (n - num_batches(n, options) * batch * w) + batch * m
    else:
        assert set(counts) == real, "a sample never served"
        padding_w = -n % w  # the epoch's padding at W, then fewer than M more
        assert sum(counts.values()) - n < padding_w + m
