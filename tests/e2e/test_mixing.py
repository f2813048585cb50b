"""Weighted mixing end to end: one Loader over two splits on a real server and a real
Postgres catalog. The issue's acceptance: two sources at 0.75/0.25 over 4,000 samples keep
their shares, serve no sample twice within its source's epoch, repeat the order for the same
seed and epoch, resume exactly from a mid-epoch state and deal each source once across
ranks; ``stop=N``; and the errors of a bad mix."""

from __future__ import annotations

import json
import uuid
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest
import sqlalchemy as sa
from sqlalchemy.engine import Engine, make_url

import batchd
from batchd import errors
from batchd._proto.batchd.v1 import loader_pb2, loader_pb2_grpc
from batchd_server.api import RunningServer
from batchd_server.catalog import migrate
from batchd_server.catalog.db import make_engine
from batchd_server.catalog.ingest import ingest_manifest

from serving import RECORD_FLOATS, record_dataset, serve

BIG, SMALL = 3000, 1000
BATCH = 50
MIX = {"big": 0.75, "small": 0.25}


@pytest.fixture(scope="module")
def catalog(pg_admin_url: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Engine]:
    """A Postgres catalog with "big" (3,000 records), "small" (1,000), "tiny" (20, the one
    at index 3 missing its file), "npys" (30 .npy files of the records' shape) and
    "unverified" (4 records, none verified), for the whole module."""
    name = f"batchd_mix_{uuid.uuid4().hex[:12]}"
    admin = sa.create_engine(pg_admin_url, isolation_level="AUTOCOMMIT")
    with admin.connect() as conn:
        conn.execute(sa.text(f'CREATE DATABASE "{name}"'))
    engine = make_engine(make_url(pg_admin_url).set(database=name))
    try:
        migrate.upgrade(engine)
        root = tmp_path_factory.mktemp("mix")
        record_dataset(engine, root / "big", n=BIG, name="big")
        record_dataset(engine, root / "small", n=SMALL, name="small")
        record_dataset(engine, root / "tiny", n=20, name="tiny", bad={3: "missing"})
        _npy_dataset(engine, root / "npys", n=30)
        record_dataset(engine, root / "unverified", n=4, name="unverified")
        with engine.begin() as conn:
            conn.execute(
                sa.text(
                    "UPDATE samples SET is_verified = false WHERE dataset_id = "
                    "(SELECT id FROM datasets WHERE name = 'unverified')"
                )
            )
        yield engine
    finally:
        engine.dispose()
        with admin.connect() as conn:
            conn.execute(sa.text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
        admin.dispose()


def _npy_value(j: int) -> np.ndarray:
    return (500_000 + j * 100 + np.arange(RECORD_FLOATS)).astype(np.float32)


def _npy_dataset(engine: Engine, root: Path, *, n: int) -> None:
    """``n`` .npy files ``n0000.npy``, ... holding ``_npy_value(j)``: the records' fields,
    stored otherwise."""
    root.mkdir(parents=True)
    for j in range(n):
        np.save(root / f"n{j:04d}.npy", _npy_value(j))
    manifest = root.parent / "npys.jsonl"
    lines = [json.dumps({"path": f"n{j:04d}.npy", "split": "train"}) for j in range(n)]
    manifest.write_text("\n".join(lines) + "\n")
    ingest_manifest(engine, dataset="npys", root=root, manifest=manifest)


@pytest.fixture(scope="module")
def server(catalog: Engine, tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningServer]:
    url = catalog.url.render_as_string(hide_password=False)
    with serve(url, tmp_path_factory.mktemp("mix-server")) as srv:
        yield srv


@pytest.fixture(scope="module")
def dataset_of(catalog: Engine) -> dict[int, str]:
    """Sample id -> the name of its dataset."""
    query = "SELECT s.id, d.name FROM samples s JOIN datasets d ON d.id = s.dataset_id"
    with catalog.connect() as conn:
        return {int(i): str(n) for i, n in conn.execute(sa.text(query))}


def _mix_loader(server: RunningServer, mix: batchd.Mix | None = None, **kw: Any) -> batchd.Loader:
    kw.setdefault("batch_size", BATCH)
    kw.setdefault("seed", 7)
    return batchd.Loader(
        server.address,
        sources=mix or batchd.Mix(MIX),
        pipeline=batchd.Array((RECORD_FLOATS,), "float32", raw=True),
        device="cpu",
        **kw,
    )


def _batches(loader: batchd.Loader) -> list[tuple[list[int], list[int]]]:
    """The rest of the epoch: each batch's (sample ids, sources)."""
    return [(b["sample_id"].tolist(), b["source"].tolist()) for b in loader]


def _ids(batches: list[tuple[list[int], list[int]]]) -> list[int]:
    return [i for ids, _ in batches for i in ids]


def test_a_075_025_mix_of_4000_samples_keeps_shares_and_serves_each_sample_once(
    server: RunningServer, dataset_of: dict[int, str]
) -> None:
    """Every batch is 3:1 big:small (within a sample), each sample is served once, and each
    row's ``source`` names its sample's dataset."""
    with _mix_loader(server) as loader:
        assert loader.sources == ("big", "small")
        assert [s["epoch_samples"] for s in loader.mix_sources] == [BIG, SMALL]
        assert [s["rows"] for s in loader.mix_sources] == [BIG, SMALL]
        assert len(loader) == (BIG + SMALL) // BATCH
        batches = _batches(loader)
    assert len(batches) == (BIG + SMALL) // BATCH
    for ids, sources in batches:
        assert [dataset_of[i] for i in ids] == [loader.sources[s] for s in sources]
        assert abs(sources.count(0) - 0.75 * BATCH) <= 1, sources
        assert sources == sorted(sources), "a batch's rows are grouped by source"
    served = _ids(batches)
    counts = Counter(dataset_of[i] for i in served)
    assert abs(counts["big"] / len(served) - 0.75) <= 0.03
    assert abs(counts["small"] / len(served) - 0.25) <= 0.03
    assert len(set(served)) == len(served) == BIG + SMALL, "a sample came twice"


def test_the_same_seed_and_epoch_repeat_the_order_and_another_epoch_changes_it(
    server: RunningServer,
) -> None:
    """Two Loaders with the same seed serve the same epochs; epoch 1 is another order."""
    with _mix_loader(server) as a, _mix_loader(server) as b:
        first = _batches(a)
        assert _batches(b) == first
        a.set_epoch(1)
        second = _batches(a)
    assert second != first
    assert sorted(_ids(second)) == sorted(_ids(first)), "each epoch serves every sample once"
    with _mix_loader(server, seed=8) as other:
        assert _batches(other) != first


def test_a_mid_epoch_state_dict_resumes_the_mix_exactly(server: RunningServer) -> None:
    """A state saved after 13 batches (through JSON) resumes at batch 13 of the same order;
    a Loader on another mix refuses it, naming the mix."""
    with _mix_loader(server) as loader:
        whole = _batches(loader)
    with _mix_loader(server) as loader:
        it = iter(loader)
        for _ in range(13):
            next(it)
        state = json.loads(json.dumps(loader.state_dict()))
        assert loader.snapshot.startswith("m1.")
    with _mix_loader(server) as loader:
        loader.load_state_dict(state)
        assert _batches(loader) == whole[13:]
    other = batchd.Mix({"big": 0.5, "small": 0.5})
    with (
        _mix_loader(server, other) as loader,
        pytest.raises(errors.InvalidArgument, match=r"state mix=.* does not match"),
    ):
        loader.load_state_dict(state)


def test_two_ranks_serve_each_sample_of_each_source_exactly_once(
    server: RunningServer, dataset_of: dict[int, str]
) -> None:
    """Ranks 0 and 1 of a 2-rank job: disjoint, and together every sample of the epoch; on
    each, every batch is 3:1 (within 2 samples)."""
    per_rank = []
    for rank in (0, 1):
        with _mix_loader(server, rank=rank, world_size=2) as loader:
            batches = _batches(loader)
        assert all(abs(sources.count(0) - 0.75 * BATCH) < 2 for _, sources in batches)
        per_rank.append(_ids(batches))
    assert not set(per_rank[0]) & set(per_rank[1])
    served = per_rank[0] + per_rank[1]
    assert len(served) == len(set(served)) == BIG + SMALL
    assert Counter(dataset_of[i] for i in served) == {"big": BIG, "small": SMALL}


@pytest.mark.parametrize("resume_on", [2, 3])
def test_a_mix_state_saved_at_4_ranks_resumes_at_fewer_ranks_each_sample_once(
    server: RunningServer, resume_on: int
) -> None:
    """Elastic resume of a mix: 4 ranks stop after 5 batches; 2 or 3 finish the epoch."""
    before: list[int] = []
    state: dict[str, Any] = {}
    for rank in range(4):
        with _mix_loader(server, rank=rank, world_size=4) as loader:
            it = iter(loader)
            for _ in range(5):
                before += next(it)["sample_id"].tolist()
            if rank == 0:
                state = loader.state_dict()
    assert state["consumed"] == 5 * BATCH * 4
    after: list[int] = []
    for rank in range(resume_on):
        with _mix_loader(server, rank=rank, world_size=resume_on) as loader:
            loader.load_state_dict(state)
            after += _ids(_batches(loader))
    counts = Counter(before + after)
    assert set(counts) == set(_all_mixed_ids(server))
    assert len(before) + len(after) - (BIG + SMALL) < resume_on, "padding past world_size - 1"


def _all_mixed_ids(server: RunningServer) -> list[int]:
    with _mix_loader(server) as loader:
        return _ids(_batches(loader))


def test_stop_n_serves_n_samples_and_a_source_that_runs_out_starts_a_new_pass(
    server: RunningServer, dataset_of: dict[int, str]
) -> None:
    """stop=2,500 at 0.5/0.5: 1,250 of "big" (distinct) and 1,250 of "small", whose 1,000
    samples all come once before any comes again."""
    mix = batchd.Mix({"big": 1, "small": 1}, stop=2500)
    with _mix_loader(server, mix) as loader:
        assert [s["epoch_samples"] for s in loader.mix_sources] == [1250, 1250]
        served = _ids(_batches(loader))
    assert len(served) == 2500
    small = [i for i in served if dataset_of[i] == "small"]
    big = [i for i in served if dataset_of[i] == "big"]
    assert len(big) == len(set(big)) == 1250
    assert len(small) == 1250
    assert len(set(small[:SMALL])) == SMALL, "the first pass over small repeats nothing"
    assert len(set(small[SMALL:])) == 250 and set(small[SMALL:]) <= set(small[:SMALL])


@pytest.mark.parametrize("transport", ["shm", "inline"])
def test_a_bad_sample_of_one_source_is_skipped_and_the_rest_keep_their_source(
    server: RunningServer, dataset_of: dict[int, str], transport: str
) -> None:
    """ "tiny" (split "train", sample 3 missing) mixed with "small:train": the bad sample is
    left out and reported; every other row's ``source`` still names its dataset."""
    mix = batchd.Mix([(batchd.Source("tiny"), 1.0), ("small:train", 1.0)])
    with _mix_loader(
        server, mix, batch_size=8, transport=transport, max_error_fraction=0.1
    ) as loader:
        assert loader.transport == transport
        assert loader.sources == ("tiny", "small:train")
        failed: list[int] = []
        served: list[tuple[int, str]] = []
        for batch in loader:
            failed += loader.last_failed_sample_ids
            served += [
                (i, loader.sources[s])
                for i, s in zip(batch["sample_id"].tolist(), batch["source"].tolist(), strict=True)
            ]
            assert batch["array"].shape[0] == len(batch["source"])
    assert len(failed) == 1 and dataset_of[failed[0]] == "tiny"
    assert all(name.split(":")[0] == dataset_of[i] for i, name in served)
    assert Counter(name for _, name in served) == {"tiny": 19, "small:train": 20}


def test_a_mix_with_an_unknown_or_empty_source_is_refused_naming_it(
    server: RunningServer,
) -> None:
    with pytest.raises(errors.NotFound, match="nosuch"):
        _mix_loader(server, batchd.Mix({"big": 1, "nosuch": 1}))
    with pytest.raises(errors.NotFound, match="val"):
        _mix_loader(server, batchd.Mix({"big": 1, "small:val": 1}))
    with pytest.raises(
        errors.FailedPrecondition, match="mix source 'unverified:train' has no verified samples"
    ):
        _mix_loader(server, batchd.Mix({"big": 1, "unverified": 1}))


@pytest.mark.parametrize(
    ("weights", "stop", "message"),
    [
        ({}, "first", "at least one source"),
        ({"big": 0}, "first", "must be a finite number > 0"),
        ({"big": -1.0}, "first", "must be a finite number > 0"),
        ({"big": float("nan")}, "first", "must be a finite number > 0"),
        ({"big": float("inf")}, "first", "must be a finite number > 0"),
        ({"big": True}, "first", "must be a finite number > 0"),
        ({"big": 1}, "last", "stop='last' must be 'first'"),
        ({"big": 1}, 0, "stop=0 must be 'first'"),
        ({"big": 1, "big:train": 2}, "first", "lists 'big' twice"),
        ({"big:": 1}, "first", "is not 'name' or 'name:split'"),
    ],
)
def test_a_bad_mix_is_refused_before_any_request(
    weights: dict[str, Any], stop: Any, message: str
) -> None:
    with pytest.raises(errors.InvalidArgument, match=message):
        batchd.Mix(weights, stop=stop)


def test_a_mix_takes_no_dataset_split_version_or_weighted_sampling(server: RunningServer) -> None:
    for clash in ({"dataset": "big"}, {"split": "val"}, {"version": "v1"}):
        with pytest.raises(errors.InvalidArgument, match="a Loader over a mix takes no"):
            _mix_loader(server, **clash)
    with pytest.raises(errors.InvalidArgument, match="cannot be used with a mix"):
        _mix_loader(server, sampling="weighted")
    with pytest.raises(errors.InvalidArgument, match="is not a pipeline spec"):
        batchd.Source("big", pipeline="raw")  # type: ignore[arg-type]
    with pytest.raises(errors.InvalidArgument, match=r"must be a batchd\.Mix"):
        batchd.Loader(server.address, sources={"big": 1}, batch_size=4)  # type: ignore[arg-type]


def _open_raw(server: RunningServer, request: loader_pb2.OpenSessionRequest) -> grpc.RpcError:
    """The server's refusal of ``request`` (no client-side checks in the way)."""
    with grpc.insecure_channel(server.address) as channel:
        stub = loader_pb2_grpc.LoaderStub(channel)
        with pytest.raises(grpc.RpcError) as refused:
            stub.OpenSession(request, timeout=30)
    return refused.value


@pytest.mark.parametrize(
    ("mix", "extra", "message"),
    [
        (loader_pb2.Mix(), {}, "the mix has no source"),
        (
            loader_pb2.Mix(sources=[loader_pb2.MixSource(dataset="big", weight=0.0)]),
            {},
            "weights must be finite numbers > 0",
        ),
        (
            loader_pb2.Mix(sources=[loader_pb2.MixSource(dataset="big", weight=float("nan"))]),
            {},
            "weights must be finite numbers > 0",
        ),
        (
            loader_pb2.Mix(
                sources=[loader_pb2.MixSource(dataset="big", weight=1.0)], stop_samples=-3
            ),
            {},
            "stop_samples=-3 must be 0",
        ),
        (
            loader_pb2.Mix(sources=[loader_pb2.MixSource(dataset="big", weight=1.0)] * 2),
            {},
            "lists 'big:train' twice",
        ),
        (
            loader_pb2.Mix(sources=[loader_pb2.MixSource(dataset="big", weight=1.0)]),
            {"dataset": "big"},
            "names its splits in the mix's sources only",
        ),
        (
            loader_pb2.Mix(sources=[loader_pb2.MixSource(dataset="big", weight=1.0)]),
            {"sampling": loader_pb2.SAMPLING_CLASS_BALANCED},
            "cannot be used with a mix",
        ),
        (
            loader_pb2.Mix(sources=[loader_pb2.MixSource(dataset="big", weight=1.0)]),
            {"snapshot": "s1.5.5"},
            "is not the snapshot of a mix",
        ),
    ],
)
def test_the_server_refuses_a_bad_mix_with_a_message(
    server: RunningServer, mix: loader_pb2.Mix, extra: dict[str, Any], message: str
) -> None:
    request = loader_pb2.OpenSessionRequest(
        batch_size=4,
        pipeline=batchd.Array((RECORD_FLOATS,), "float32", raw=True)._to_proto(),
        **extra,
    )
    request.mix.CopyFrom(mix)
    refused = _open_raw(server, request)
    assert refused.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert message in (refused.details() or "")


def test_a_mix_snapshot_pins_every_source_for_another_loader(server: RunningServer) -> None:
    """``snapshot=`` of a mixed Loader opens another on the same rows: the same batches."""
    with _mix_loader(server) as a:
        whole = _batches(a)
        snapshot = a.snapshot
    with _mix_loader(server, snapshot=snapshot) as b:
        assert b.snapshot == snapshot
        assert _batches(b) == whole


def test_a_source_with_its_own_pipeline_decodes_with_it_into_the_same_fields(
    server: RunningServer, catalog: Engine
) -> None:
    """Raw records mixed with the same arrays stored as .npy files (a source's own
    ``Array(raw=False)``): every row holds its own sample's values."""
    mix = batchd.Mix(
        [
            ("big", 1.0),
            (batchd.Source("npys", pipeline=batchd.Array((RECORD_FLOATS,), "float32")), 1.0),
        ]
    )
    with catalog.connect() as conn:
        rows = conn.execute(
            sa.text(
                "SELECT s.id, d.name, s.path FROM samples s JOIN datasets d "
                "ON d.id = s.dataset_id WHERE d.name IN ('big', 'npys') ORDER BY s.id"
            )
        ).all()
    big_ids = [int(i) for i, name, _ in rows if name == "big"]
    expected = {i: big_ids.index(i) * 1000 + np.arange(RECORD_FLOATS) for i in big_ids}
    expected |= {int(i): _npy_value(int(p[1:5])) for i, name, p in rows if name == "npys"}
    with _mix_loader(server, mix, batch_size=8) as loader:
        batches = list(loader)
    sources = Counter(int(s) for b in batches for s in b["source"])
    assert sources == {0: 31, 1: 30}, "npys runs out first; big's item due with it comes first"
    for batch in batches:
        for sample_id, array in zip(batch["sample_id"].tolist(), batch["array"], strict=True):
            assert np.array_equal(array.numpy(), expected[sample_id]), sample_id


def test_a_source_pipeline_with_other_fields_or_other_padding_is_refused(
    server: RunningServer,
) -> None:
    """A source's own pipeline must give the session's fields, and a whole-batch pipeline
    (tokens) must be the session's own."""
    narrow = batchd.Source("npys", pipeline=batchd.Array((16,), "float32"))
    with pytest.raises(
        errors.InvalidArgument,
        match=r"mix source 'npys:train' decodes to array float32 \[16\], the session's "
        r"pipeline to array float32 \[32\]",
    ):
        _mix_loader(server, batchd.Mix([("big", 1.0), (narrow, 1.0)]))
    padded = batchd.Source("npys", pipeline=batchd.Tokens(max_len=8, pad_id=1))
    with pytest.raises(errors.InvalidArgument, match="finishes the whole batch"):
        batchd.Loader(
            server.address,
            sources=batchd.Mix([("big", 1.0), (padded, 1.0)]),
            batch_size=4,
            pipeline=batchd.Tokens(max_len=8),
            device="cpu",
        )
