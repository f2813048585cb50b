"""``batchd.Mix(schedule=...)`` on the client: what it accepts and refuses, what it sends and
saves, and the per-source accounting ``Loader.stats()`` reports from the batches."""

from __future__ import annotations

import numpy as np
import pytest

import batchd
from batchd._accounting import SourceAccount
from batchd._connection import check_schedule_applied
from batchd._proto.batchd.v1 import loader_pb2
from batchd._wire.schedule import global_step
from batchd.errors import FailedPrecondition, InvalidArgument

BASE = {"web": 0.7, "code": 0.3}
SCHEDULE = [(10_000, {"web": 0.5, "code": 0.5}), (20_000, {"web": 0.3, "code": 0.7})]


def test_the_issues_example_builds_sends_and_saves_its_schedule() -> None:
    """Points in source order on the wire and in the state; "linear" travels too."""
    mix = batchd.Mix(BASE, schedule=SCHEDULE, interpolate="linear")
    assert mix.schedule is not None and mix.schedule.steps == (10_000, 20_000)
    message = mix._to_proto()
    assert [(p.step, list(p.weights)) for p in message.schedule] == [
        (10_000, [0.5, 0.5]),
        (20_000, [0.3, 0.7]),
    ]
    assert message.interpolate == "linear"
    state = mix._state()
    assert state["schedule"] == [[10_000, [0.5, 0.5]], [20_000, [0.3, 0.7]]]
    assert state["interpolate"] == "linear"
    assert "schedule" not in batchd.Mix(BASE)._state(), "a mix without one saves as before"


def test_points_may_name_sources_in_any_order_or_as_sources() -> None:
    """A point is a mapping (or pairs) keyed like the base; its weights follow the base's
    order; equal schedules make equal mixes."""
    a = batchd.Mix(BASE, schedule=[(5, {"code": 0.9, "web": 0.1})])
    b = batchd.Mix(BASE, schedule=[(5, [(batchd.Source("web"), 0.1), ("code", 0.9)])])
    assert a == b and hash(a) == hash(b)
    assert a.schedule is not None and a.schedule.points == ((5, (0.1, 0.9)),)
    assert a != batchd.Mix(BASE, schedule=[(6, {"code": 0.9, "web": 0.1})])
    assert "schedule=<1 points>" in repr(a)


@pytest.mark.parametrize(
    ("schedule", "interpolate", "message"),
    [
        ([(5, {"web": 1, "docs": 1})], "step", "names 'docs', which is not a source"),
        ([(5, {"web": 1})], "step", "leaves out code"),
        ([(5, {"web": 1, "code": -1})], "step", "weight -1; weights must be finite"),
        ([(5, {"web": 0, "code": 0})], "step", "weighs every source 0"),
        ([(9, {"web": 1, "code": 1}), (9, {"web": 1, "code": 2})], "step", "increase strictly"),
        ([(5, {"web": 1, "code": 1})], "cubic", "interpolate='cubic'"),
        ([5], "step", r"a Mix schedule point is \(step, \{source: weight\}\)"),
        ({"web": 1}, "step", "must be a list of"),
        ([(5, 0.5)], "step", "has weights 0.5; give"),
        ([("5", {"web": 1, "code": 1})], "step", "step '5' must be an integer"),
    ],
)
def test_a_bad_schedule_is_refused_when_the_mix_is_built(
    schedule: object, interpolate: str, message: str
) -> None:
    """Unknown or missing sources, negative weights, all zeros, steps out of order, a bad
    interpolation or shape: refused before any request, naming what is wrong."""
    with pytest.raises(InvalidArgument, match=message):
        batchd.Mix(BASE, schedule=schedule, interpolate=interpolate)  # type: ignore[arg-type]


def test_interpolate_without_a_schedule_is_refused() -> None:
    with pytest.raises(InvalidArgument, match="needs a schedule"):
        batchd.Mix(BASE, interpolate="linear")


def test_the_global_step_is_the_epochs_batches_before_plus_the_batch() -> None:
    """Epoch 2, batch 3 of an epoch of 10 batches per rank is step 23; after an elastic
    resume (order built for 4 ranks, 2 now) the step is the order's global batch."""
    common = {"rows": 1000, "batch_size": 25, "drop_last": False}
    assert global_step(2, 3, world_size=4, **common) == 23  # type: ignore[arg-type]
    # 4 ranks of 25 consumed 300 (3 global batches); on 2 ranks, batch 5 starts at entry
    # 300 + 5 * 50 = 550 of the 4-rank order: its global batch 5.
    assert global_step(0, 5, world_size=2, start=300, order_world_size=4, **common) == 5  # type: ignore[arg-type]


def test_the_account_counts_samples_tokens_and_expected_shares_per_source() -> None:
    """Samples and tokens per source from the batch's fields; expected samples from the
    shares in force at each batch's step; a corrupt source index is not counted."""
    account = SourceAccount(("a", "b"), lambda step: (0.5, 0.5) if step < 1 else (0.25, 0.75))
    account.record(
        {"source": np.array([0, 0, 1, 1]), "length": np.array([3, 4, 5, 6], np.int32)}, step=0
    )
    account.record({"source": np.array([1, 1, 1, 7]), "length": np.array([1, 1, 1, 1])}, step=1)
    a, b = account.stats()
    assert (a.samples, b.samples) == (2, 5)
    assert (a.tokens, b.tokens) == (7, 14)
    assert (a.expected_samples, b.expected_samples) == (2 + 1, 2 + 3)
    assert a.share == pytest.approx(2 / 7) and b.expected_share == pytest.approx(5 / 8)


def test_the_account_has_no_tokens_without_a_length_field() -> None:
    account = SourceAccount(("a",), lambda step: (1.0,))
    account.record({"source": np.zeros(3, np.int64)}, step=0)
    (only,) = account.stats()
    assert (only.samples, only.tokens, only.share) == (3, None, 1.0)


def test_a_session_from_a_server_that_ignores_the_schedule_is_refused() -> None:
    """A server from before schedules confirms no points: serving the base weights
    throughout would break the run's promise, so the client refuses, naming the remedy."""
    request = loader_pb2.OpenSessionRequest(mix=batchd.Mix(BASE, schedule=SCHEDULE)._to_proto())
    with pytest.raises(FailedPrecondition, match=r"does not apply mix schedules.*upgrade"):
        check_schedule_applied(request, loader_pb2.OpenSessionResponse(), "unix:///x")
    check_schedule_applied(request, loader_pb2.OpenSessionResponse(schedule_points=2), "t")
    plain = loader_pb2.OpenSessionRequest(mix=batchd.Mix(BASE)._to_proto())
    check_schedule_applied(plain, loader_pb2.OpenSessionResponse(), "t")
