"""Mixture schedules and per-source accounting end to end: a Loader over a two-source mix
whose weights change twice, on a real server and a real Postgres catalog. The acceptance:
every window's shares within 3% of the weights in force; a resume before, at or after a
change (mid-epoch, and at another world size) replays the same batches; each source's
samples once within each of its passes; ``loader.stats()`` and the server's
``batchd_mix_*_total`` counters count what each source served against what it expected."""

from __future__ import annotations

import json
import uuid
from collections import Counter
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
import sqlalchemy as sa
from sqlalchemy.engine import Engine, make_url

import batchd
from batchd import errors
from batchd_server import metrics
from batchd_server.api import RunningServer
from batchd_server.catalog import migrate
from batchd_server.catalog.db import make_engine

from serving import RECORD_FLOATS, record_dataset, serve, token_dataset

pytestmark = pytest.mark.slow(seconds=30)

BIG, SMALL = 3000, 1000
BATCH = 50
BASE = {"big": 0.75, "small": 0.25}
# 80 batches per epoch at one rank: 10 at the base, 20 at 1:1, the rest at 1:3.
SCHEDULE = [(10, {"big": 0.5, "small": 0.5}), (30, {"big": 0.25, "small": 0.75})]
WINDOWS = [(0, 10, 0.75), (10, 30, 0.5), (30, 80, 0.25)]
"""(first batch, end, big's share) of epoch 0 at one rank."""


@pytest.fixture(scope="module")
def catalog(pg_admin_url: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Engine]:
    """A Postgres catalog with "big" (3,000 records), "small" (1,000) and two token datasets
    "ta" (40 sequences) and "tb" (30)."""
    name = f"batchd_sched_{uuid.uuid4().hex[:12]}"
    admin = sa.create_engine(pg_admin_url, isolation_level="AUTOCOMMIT")
    with admin.connect() as conn:
        conn.execute(sa.text(f'CREATE DATABASE "{name}"'))
    engine = make_engine(make_url(pg_admin_url).set(database=name))
    try:
        migrate.upgrade(engine)
        root = tmp_path_factory.mktemp("sched")
        record_dataset(engine, root / "big", n=BIG, name="big")
        record_dataset(engine, root / "small", n=SMALL, name="small")
        token_dataset(engine, root / "ta", n=40, name="ta")
        token_dataset(engine, root / "tb", n=30, name="tb")
        yield engine
    finally:
        engine.dispose()
        with admin.connect() as conn:
            conn.execute(sa.text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
        admin.dispose()


@pytest.fixture(scope="module")
def server(catalog: Engine, tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningServer]:
    url = catalog.url.render_as_string(hide_password=False)
    with serve(url, tmp_path_factory.mktemp("sched-server")) as srv:
        yield srv


def _mix(interpolate: str = "step", schedule: Any = None) -> batchd.Mix:
    return batchd.Mix(BASE, schedule=schedule or SCHEDULE, interpolate=interpolate)


def _loader(server: RunningServer, mix: batchd.Mix | None = None, **kw: Any) -> batchd.Loader:
    kw.setdefault("batch_size", BATCH)
    kw.setdefault("seed", 11)
    return batchd.Loader(
        server.address,
        sources=mix or _mix(),
        pipeline=batchd.Array((RECORD_FLOATS,), "float32", raw=True),
        device="cpu",
        **kw,
    )


Batches = list[tuple[list[int], list[int]]]


def _batches(loader: batchd.Loader) -> Batches:
    """The rest of the epoch: each batch's (sample ids, sources)."""
    return [(b["sample_id"].tolist(), b["source"].tolist()) for b in loader]


def test_each_window_of_a_two_change_schedule_keeps_the_weights_in_force(
    server: RunningServer,
) -> None:
    """10 batches at 3:1, 20 at 1:1, 50 at 1:3: each window's share of "big" within 3% of
    its weight; "big" never repeats and "small" repeats nothing within a pass over it."""
    with _loader(server) as loader:
        assert len(loader) == (BIG + SMALL) // BATCH == 80
        batches = _batches(loader)
    for first, end, share in WINDOWS:
        sources = [s for _, ss in batches[first:end] for s in ss]
        assert abs(sources.count(0) / len(sources) - share) <= 0.03, (first, end)
        for _, ss in batches[first:end]:
            assert abs(ss.count(0) - share * BATCH) <= 1, "each batch keeps the weights"
    big = [i for ids, ss in batches for i, s in zip(ids, ss, strict=True) if s == 0]
    small = [i for ids, ss in batches for i, s in zip(ids, ss, strict=True) if s == 1]
    assert len(big) == len(set(big))
    assert len(small) > SMALL, "the schedule favours small past its 1,000 samples"
    for start in range(0, len(small), SMALL):
        one_pass = small[start : start + SMALL]
        assert len(one_pass) == len(set(one_pass)), "a pass over small repeats nothing"


@pytest.mark.parametrize("interpolate", ["step", "linear"])
@pytest.mark.parametrize("stop_after", [5, 10, 20, 30, 47])
def test_a_resume_before_at_or_after_a_change_replays_the_same_batches(
    server: RunningServer, interpolate: str, stop_after: int
) -> None:
    """A state saved after 5 (before the first change), 10 (at it), 20 (between), 30 (at
    the second) or 47 batches resumes at exactly the next batch of the same order."""
    with _loader(server, _mix(interpolate)) as loader:
        whole = _batches(loader)
    with _loader(server, _mix(interpolate)) as loader:
        it = iter(loader)
        for _ in range(stop_after):
            next(it)
        state = json.loads(json.dumps(loader.state_dict()))
    assert state["mix"]["schedule"] == [[10, [0.5, 0.5]], [30, [0.25, 0.75]]]
    with _loader(server, _mix(interpolate)) as loader:
        loader.load_state_dict(state)
        assert _batches(loader) == whole[stop_after:]


def test_the_next_epoch_goes_on_counting_steps_and_resumes_exactly_too(
    server: RunningServer,
) -> None:
    """Epoch 1 is steps 80 to 159: all of it at 1:3; a state saved 7 batches into it resumes
    exactly."""
    with _loader(server) as loader:
        loader.set_epoch(1)
        second = _batches(loader)
    sources = [s for _, ss in second for s in ss]
    assert abs(sources.count(0) / len(sources) - 0.25) <= 0.01
    with _loader(server) as loader:
        loader.set_epoch(1)
        it = iter(loader)
        for _ in range(7):
            next(it)
        state = loader.state_dict()
    assert state["epoch"] == 1
    with _loader(server) as loader:
        loader.load_state_dict(state)
        assert _batches(loader) == second[7:]


def test_a_state_saved_at_two_ranks_across_a_change_resumes_on_three_each_sample_once(
    server: RunningServer,
) -> None:
    """Elastic resume under a schedule: 2 ranks of 25 stop after 12 batches (past the change
    at step 10); 3 ranks finish the epoch, serving exactly the rest of the 2-rank order."""
    whole: list[int] = []
    before: list[int] = []
    state: dict[str, Any] = {}
    for rank in range(2):
        with _loader(server, batch_size=25, rank=rank, world_size=2) as loader:
            ids = [b["sample_id"].tolist() for b in loader]
            whole.append(ids)  # type: ignore[arg-type]
        with _loader(server, batch_size=25, rank=rank, world_size=2) as loader:
            it = iter(loader)
            for _ in range(12):
                before += next(it)["sample_id"].tolist()
            if rank == 0:
                state = loader.state_dict()
    rest_of_order = Counter(
        i for rank_batches in whole for batch in rank_batches[12:] for i in batch
    )
    after: list[int] = []
    for rank in range(3):
        with _loader(server, batch_size=25, rank=rank, world_size=3) as loader:
            loader.load_state_dict(state)
            after += [i for ids, _ in _batches(loader) for i in ids]
    served = Counter(after)
    assert rest_of_order <= served and sum((served - rest_of_order).values()) < 3, "padding"


def test_a_resume_with_another_schedule_is_refused_naming_the_mix(server: RunningServer) -> None:
    """The schedule is part of the state: another one would replay other batches."""
    with _loader(server) as loader:
        next(iter(loader))
        state = loader.state_dict()
    other = _mix(schedule=[(11, {"big": 0.5, "small": 0.5}), (30, {"big": 0.25, "small": 0.75})])
    with (
        _loader(server, other) as loader,
        pytest.raises(errors.InvalidArgument, match=r"state mix=.*schedule"),
    ):
        loader.load_state_dict(state)
    with (
        _loader(server, batchd.Mix(BASE)) as loader,
        pytest.raises(errors.InvalidArgument, match="does not match this Loader's mix"),
    ):
        loader.load_state_dict(state)


def _counter(name: str, source: str, dataset: str = "big+small") -> float:
    value = metrics.REGISTRY.get_sample_value(name, {"dataset": dataset, "source": source})
    return value or 0.0


def test_stats_and_metrics_count_each_source_against_its_scheduled_share(
    server: RunningServer,
) -> None:
    """After 40 batches: stats' samples per source are what the batches said, expected
    samples are 10 * 50 * 0.75 + 20 * 50 * 0.5 + 10 * 50 * 0.25 of big; the server's
    counters moved by the same amounts."""
    names = ("big:train", "small:train")
    served_before = [_counter("batchd_mix_samples_total", n) for n in names]
    expected_before = [_counter("batchd_mix_expected_samples_total", n) for n in names]
    with _loader(server) as loader:
        assert [(s.samples, s.share) for s in loader.stats().sources] == [(0, None)] * 2
        counted = Counter()
        for k, batch in enumerate(loader):
            counted.update(batch["source"].tolist())
            if k == 39:
                break
        stats = loader.stats().sources
    assert [s.name for s in stats] == ["big", "small"]
    assert [s.samples for s in stats] == [counted[0], counted[1]]
    big_expected = 10 * 50 * 0.75 + 20 * 50 * 0.5 + 10 * 50 * 0.25
    assert stats[0].expected_samples == pytest.approx(big_expected)
    assert stats[1].expected_samples == pytest.approx(40 * 50 - big_expected)
    assert abs(stats[0].samples - big_expected) <= 2
    assert stats[0].share == pytest.approx(counted[0] / 2000)
    assert stats[0].tokens is None, "records have no length field"
    # The server counted every batch it delivered: the 40 taken and the prefetched ones.
    served = [
        _counter("batchd_mix_samples_total", n) - b
        for n, b in zip(names, served_before, strict=True)
    ]
    expected = [
        _counter("batchd_mix_expected_samples_total", n) - b
        for n, b in zip(names, expected_before, strict=True)
    ]
    assert served[0] >= counted[0] and served[1] >= counted[1]
    assert sum(served) % BATCH == 0 and sum(expected) == pytest.approx(sum(served))
    assert abs(served[0] - expected[0]) <= 2


@pytest.mark.parametrize("transport", ["shm", "inline"])
def test_a_token_mix_counts_each_sources_tokens_in_stats_and_metrics(
    server: RunningServer, transport: str
) -> None:
    """Tokens per source are the unpadded lengths of its rows, in the stats and the
    ``batchd_mix_tokens_total`` counter alike."""
    mix = batchd.Mix({"ta": 0.5, "tb": 0.5}, schedule=[(2, {"ta": 0.2, "tb": 0.8})])
    before = [_counter("batchd_mix_tokens_total", n, "ta+tb") for n in ("ta:train", "tb:train")]
    tokens = [0, 0]
    with batchd.Loader(
        server.address,
        sources=mix,
        batch_size=8,
        pipeline=batchd.Tokens(max_len=16),
        device="cpu",
        seed=2,
        transport=transport,
    ) as loader:
        assert loader.transport == transport
        for batch in loader:
            lengths = np.asarray(batch["length"])
            for s in (0, 1):
                tokens[s] += int(lengths[np.asarray(batch["source"]) == s].sum())
        stats = loader.stats().sources
    assert [s.tokens for s in stats] == tokens and all(tokens)
    after = [_counter("batchd_mix_tokens_total", n, "ta+tb") for n in ("ta:train", "tb:train")]
    assert [a - b for a, b in zip(after, before, strict=True)] == tokens
