"""Elastic resume end to end: a state saved by N ranks mid-epoch resumes on M ranks, and the
union of what every run delivered is the epoch, each sample once (real server, both
transports, Postgres and SQLite)."""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
from sqlalchemy.engine import Engine

import batchd
from batchd import errors
from batchd_server.api import RunningServer

from serving import RECORD_FLOATS, record_dataset, serve

N_RECORDS = 203  # prime: no world size or batch size divides it
BATCH = 8


@pytest.fixture
def catalog(engine: Engine, tmp_path: Path) -> Engine:
    record_dataset(engine, tmp_path / "records", n=N_RECORDS)
    return engine


@pytest.fixture
def server(catalog: Engine, tmp_path: Path) -> Iterator[RunningServer]:
    with serve(catalog.url.render_as_string(hide_password=False), tmp_path) as srv:
        yield srv


def _loader(server: RunningServer, rank: int, world_size: int, **kw: Any) -> batchd.Loader:
    return batchd.Loader(
        server.address,
        dataset="records",
        batch_size=BATCH,
        rank=rank,
        world_size=world_size,
        pipeline=batchd.Array((RECORD_FLOATS,), "float32", raw=True),
        device="cpu",
        seed=3,
        **kw,
    )


def _all_ids(engine: Engine) -> set[int]:
    with engine.connect() as conn:
        return set(conn.scalars(sa.text("SELECT id FROM samples")))


def _stop_after(server: RunningServer, world: int, k: int, **kw: Any) -> tuple[list[int], dict]:
    """Every rank of a ``world``-rank job serves ``k`` batches; rank 0's state after them."""
    served: list[int] = []
    state: dict[str, Any] = {}
    for rank in range(world):
        with _loader(server, rank, world, **kw) as loader:
            it = iter(loader)
            for _ in range(k):
                served += next(it)["sample_id"].tolist()
            if rank == 0:
                state = loader.state_dict()
    return served, state


def _resume(server: RunningServer, world: int, state: dict, **kw: Any) -> list[int]:
    """Every rank of a ``world``-rank job loads ``state`` and serves the rest of the epoch."""
    served: list[int] = []
    for rank in range(world):
        with _loader(server, rank, world, **kw) as loader:
            loader.load_state_dict(state)
            assert loader.epoch == state["epoch"]
            served += [i for b in loader for i in b["sample_id"].tolist()]
    return served


@pytest.mark.parametrize("drop_last", [False, True])
@pytest.mark.parametrize("resume_on", [2, 3])
def test_a_state_saved_at_4_ranks_resumes_at_fewer_ranks_each_sample_once(
    server: RunningServer, catalog: Engine, resume_on: int, drop_last: bool
) -> None:
    """4 ranks stop after 3 batches; 2 or 3 ranks finish the epoch: each sample once."""
    before, state = _stop_after(server, 4, 3, drop_last=drop_last)
    assert state["consumed"] == 3 * BATCH * 4
    after = _resume(server, resume_on, state, drop_last=drop_last)
    counts = Counter(before + after)
    everything = _all_ids(catalog)
    if drop_last:
        assert max(counts.values()) == 1
        assert len(everything - set(counts)) < BATCH * resume_on
    else:
        assert set(counts) == everything
        assert len(before) + len(after) - N_RECORDS < resume_on, "padding past world_size - 1"


@pytest.mark.parametrize("transport", ["shm", "inline"])
def test_a_state_saved_at_2_ranks_resumes_at_4_and_the_next_epoch_is_whole(
    server: RunningServer, catalog: Engine, transport: str
) -> None:
    """Growing 2 -> 4 mid-epoch finishes the epoch once; the next epoch is a full 4-rank one."""
    before, state = _stop_after(server, 2, 5, transport=transport)
    nxt: list[list[int]] = []
    after: list[int] = []
    for rank in range(4):
        with _loader(server, rank, 4, transport=transport) as loader:
            loader.load_state_dict(state)
            after += [i for b in loader for i in b["sample_id"].tolist()]
            assert loader.epoch == 1
            nxt.append([i for b in loader for i in b["sample_id"].tolist()])
            assert len(nxt[-1]) == loader.num_samples
    counts = Counter(before + after)
    assert set(counts) == _all_ids(catalog) and sum(counts.values()) - N_RECORDS < 4
    assert set().union(*map(set, nxt)) == _all_ids(catalog)


def test_a_format_1_state_from_an_older_batchd_still_resumes(server: RunningServer) -> None:
    """A state of format 1 (a per-rank next_batch) resumes exactly where it said."""
    with _loader(server, 1, 2) as loader:
        whole = [b["sample_id"].tolist() for b in loader]
    old = {
        "format": 1,
        "dataset": "records",
        "version": "",
        "split": "train",
        "batch_size": BATCH,
        "rank": 0,
        "world_size": 2,
        "seed": 3,
        "shuffle": True,
        "drop_last": False,
        "sampling": "uniform",
        "epoch": 0,
        "next_batch": 4,
        "num_batches": len(whole),
        "snapshot": "",
    }
    with _loader(server, 1, 2) as loader:
        old["snapshot"] = loader.snapshot
        old["version"] = loader.version
        loader.load_state_dict(old)
        assert [b["sample_id"].tolist() for b in loader] == whole[4:]


def test_a_state_of_an_unknown_format_is_refused_naming_its_version(
    server: RunningServer,
) -> None:
    """A state from a newer batchd says which format and version it is and what to do."""
    with _loader(server, 0, 1) as loader:
        state = {**loader.state_dict(), "format": 7, "batchd_version": "3.1.0"}
        with pytest.raises(errors.InvalidArgument, match=r"format=7 \(written by batchd 3.1.0\)"):
            loader.load_state_dict(state)
