"""The batch path end to end: a real server (gRPC on a unix socket, worker processes, shared
memory) and the real ``batchd.Loader``, on catalogs in Postgres and in SQLite."""

from __future__ import annotations

import itertools
import stat
import time
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import sqlalchemy as sa
import torch
from sqlalchemy.engine import Engine

import batchd
from batchd import errors
from batchd._transport.doorbell import ClientDoorbell, DoorbellRefused
from batchd_server import metrics
from batchd_server.api import RunningServer
from batchd_server.catalog.schema import sample_errors

from pipeline_reference import reference_centre
from resume import sample_ids
from serving import RECORD_FLOATS, install_decoders, record_dataset, records_loader, serve


def _catalog_ids(engine: Engine, dataset: str) -> list[int]:
    with engine.connect() as conn:
        return list(
            conn.scalars(
                sa.text(
                    "SELECT s.id FROM samples s JOIN datasets d ON d.id = s.dataset_id "
                    "WHERE d.name = :n AND s.split = 'train' ORDER BY s.id"
                ),
                {"n": dataset},
            )
        )


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_ranks_are_disjoint_cover_the_split_and_get_equal_batches(
    server: RunningServer, catalog: dict[str, Any], world_size: int
) -> None:
    """Every rank gets the same number of batches; together they serve the split once (plus
    the documented wrap-around padding, or less the documented drop)."""
    all_ids = _catalog_ids(catalog["engine"], "records")
    for drop_last, shuffle in itertools.product([False, True], [False, True]):
        per_rank = []
        for rank in range(world_size):
            with records_loader(
                server, rank=rank, world_size=world_size, drop_last=drop_last, shuffle=shuffle
            ) as loader:
                batches = sample_ids(loader)
                assert len(batches) == len(loader)
                per_rank.append(batches)
        counts = {len(b) for b in per_rank}
        assert len(counts) == 1, f"unequal batch counts {counts}"
        sizes = {tuple(len(x) for x in b) for b in per_rank}
        assert len(sizes) == 1, "batch k has the same size on every rank"
        served = [i for batches in per_rank for b in batches for i in b]
        seen = Counter(served)
        if drop_last:
            assert max(seen.values()) == 1, "ranks overlap"
            dropped = len(all_ids) - len(served)
            assert 0 <= dropped < 16 * world_size
            assert set(served) <= set(all_ids)
        else:
            assert set(served) == set(all_ids), "some samples were never served"
            padding = -len(all_ids) % world_size
            assert len(served) == len(all_ids) + padding
            assert sum(c - 1 for c in seen.values()) == padding


def test_new_epoch_new_order_and_same_order_after_a_server_restart(
    catalog: dict[str, Any], tmp_path: Path
) -> None:
    """Epochs differ; the same seed and epoch give the same order from a new server."""
    with serve(catalog["url"], tmp_path) as srv, records_loader(srv, seed=7) as loader:
        loader.set_epoch(3)
        epoch3 = sample_ids(loader)
        loader.set_epoch(4)
        epoch4 = sample_ids(loader)
    assert epoch3 != epoch4
    assert sorted(itertools.chain(*epoch3)) == sorted(itertools.chain(*epoch4))
    with serve(catalog["url"], tmp_path) as srv, records_loader(srv, seed=7) as loader:
        loader.set_epoch(3)
        assert sample_ids(loader) == epoch3


def test_next_iteration_moves_to_the_next_epoch_without_set_epoch(server: RunningServer) -> None:
    """Forgetting set_epoch cannot repeat an epoch's order."""
    with records_loader(server, seed=1) as loader:
        first, second = sample_ids(loader), sample_ids(loader)
        state = loader.state_dict()
        assert (state["epoch"], state["next_batch"]) == (2, 0), "resume starts epoch 2"
    with records_loader(server, seed=1) as loader:
        loader.set_epoch(1)
        assert sample_ids(loader) == second != first


def test_record_batches_hold_the_exact_bytes_labels_and_ids(
    server: RunningServer, catalog: dict[str, Any]
) -> None:
    """Each row is the record its sample_id names, with its catalog label."""
    ids = _catalog_ids(catalog["engine"], "records")
    index_of = {sample_id: i for i, sample_id in enumerate(ids)}
    records = catalog["records"]
    with records_loader(server, shuffle=True) as loader:
        for batch in loader:
            assert batch["array"].dtype == torch.float32
            assert batch["array"].shape[1:] == (RECORD_FLOATS,)
            rows = [index_of[i] for i in batch["sample_id"].tolist()]
            np.testing.assert_array_equal(batch["array"].numpy(), records[rows])
            assert batch["label"].tolist() == [r % 10 for r in rows]


def test_batches_the_loop_keeps_are_never_overwritten(
    server: RunningServer, catalog: dict[str, Any]
) -> None:
    """Batches own their memory: keeping a whole epoch (lent slots stay the loop's across the
    next epoch's stream; the batches past ``max_lent`` are copies, recycled only once
    dropped) leaves every one intact while another epoch is served."""
    ids = _catalog_ids(catalog["engine"], "records")
    index_of = {sample_id: i for i, sample_id in enumerate(ids)}
    with records_loader(server, prefetch=2) as loader:
        kept = list(loader)
        dropped = [b["array"].clone() for b in loader]  # recycled memory, checked by value
    for batch in kept:
        rows = [index_of[i] for i in batch["sample_id"].tolist()]
        np.testing.assert_array_equal(batch["array"].numpy(), catalog["records"][rows])
    assert sum(len(b) for b in dropped) == len(catalog["records"])


def _until(condition: Any, what: str, timeout_s: float = 30.0) -> None:
    """Poll ``condition`` (a state another process or thread changes) until it holds."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            pytest.fail(f"timed out after {timeout_s:g} s waiting for {what}")
        time.sleep(0.01)


def test_default_batches_lend_their_slot_until_the_loop_drops_them(
    server: RunningServer, catalog: dict[str, Any]
) -> None:
    """The default CPU path copies nothing while the loop holds few batches: each batch's
    tensors are its slot, given back to the server when the last of them dies; past
    max_lent held batches, further ones are copies, so the stream never runs dry."""
    ids = _catalog_ids(catalog["engine"], "records")
    index_of = {sample_id: i for i, sample_id in enumerate(ids)}
    with records_loader(server, prefetch=2, batch_size=8) as loader:
        session = loader._replicas.primary.session
        assert session is not None and loader.transport == "shm"
        delivery = session.delivery
        on_server = server.sessions.get(session.reply.session_id)
        slots = session.reply.ring.slots
        assert delivery.max_lent == slots - 1  # prefetch 2: one slot always stays the server's
        it = iter(loader)
        kept = [next(it) for _ in range(delivery.max_lent + 3)]
        lent = delivery.lent()
        assert len(lent) == delivery.max_lent and delivery.copies == 3
        assert set(lent) <= set(on_server._leases)  # the server keeps them out of the ring
        for batch in kept:
            rows = [index_of[i] for i in batch["sample_id"].tolist()]
            np.testing.assert_array_equal(batch["array"].numpy(), catalog["records"][rows])
        view = kept[0]["array"][1:]  # a view keeps its batch's slot
        del kept, batch
        assert delivery.lent() == lent[:1]
        _until(lambda: not set(lent[1:]) & set(on_server._leases), "the dropped batches' acks")
        assert lent[0] in on_server._leases
        del view
        _until(lambda: lent[0] not in on_server._leases, "the last view's ack")
        rest = list(it)
        assert len(rest) == len(loader) - delivery.max_lent - 3
        assert delivery.copies == 3  # one batch held at a time: lent, never copied


@pytest.mark.parametrize(
    ("transport", "zero_copy"), [("shm", False), ("shm", True), ("inline", False)]
)
def test_every_batchs_wait_and_step_reach_the_servers_histograms(
    server: RunningServer, transport: str, zero_copy: bool
) -> None:
    """One epoch: the server's wait and step histograms get one observation per batch, their
    sums are the loop's own totals, and loader.stats() agrees with what it handed out."""

    def observed(name: str, suffix: str) -> float:
        value = metrics.REGISTRY.get_sample_value(f"{name}_{suffix}", {"dataset": "records"})
        return value or 0.0

    names = ("batchd_client_wait_seconds", "batchd_client_step_seconds")
    before = {(n, x): observed(n, x) for n in names for x in ("count", "sum")}
    with records_loader(
        server, prefetch=2, batch_size=4, transport=transport, zero_copy=zero_copy
    ) as loader:
        seen = 0
        for batch in loader:
            seen += len(batch["sample_id"])
            time.sleep(0.002)  # a training step to measure, not synchronisation
        n, num_samples = len(loader), loader.num_samples

        def arrived() -> bool:
            return all(observed(name, "count") - before[name, "count"] >= n for name in names)

        _until(arrived, f"{n} batches' timings")
        stats = loader.stats()
    for name in names:
        assert observed(name, "count") - before[name, "count"] == n
    assert stats.batches == n and stats.samples == seen == num_samples
    # float32 on the wire: the sums agree to well under a millisecond per batch.
    waited = observed(names[0], "sum") - before[names[0], "sum"]
    stepped = observed(names[1], "sum") - before[names[1], "sum"]
    assert waited == pytest.approx(stats.wait_s, abs=1e-4 * n)
    assert stepped == pytest.approx(stats.step_s, abs=1e-4 * n)
    assert stats.step_s >= 0.002 * (n - 1)
    assert stats.stall_ratio is not None and 0.0 <= stats.stall_ratio <= 1.0
    assert stats.time_to_first_batch_s is not None and stats.time_to_first_batch_s > 0
    assert stats.wait_p50_s is not None and stats.wait_p50_s <= stats.wait_p99_s  # type: ignore[operator]
    assert loader.wait_s == stats.wait_s and loader.batches_served == n  # not closed by close()


def test_zero_copy_batches_are_acked_when_the_next_one_is_asked_for(
    server: RunningServer,
) -> None:
    """zero_copy=True: a batch is the loop's only until it asks for the next one."""
    with records_loader(server, prefetch=2, zero_copy=True) as loader:
        session = loader._replicas.primary.session
        assert session is not None
        it = iter(loader)
        next(it)
        assert session.delivery.held_count() == 1 and session.delivery.lent() == []
        next(it)
        assert session.delivery.held_count() == 1  # the first went back with this request
        assert len(list(it)) == len(loader) - 2


def test_the_doorbell_answers_only_the_sessions_own_client(server: RunningServer) -> None:
    """A hello needs the session's id and its ring's token; anything else is hung up on."""
    with records_loader(server) as loader:
        session = loader._replicas.primary.session
        assert session is not None
        ring = session.reply.ring
        path = server.registry.shm_dir / ring.doorbell
        assert stat.S_IMODE(path.stat().st_mode) == 0o600
        for session_id, token in (
            (session.reply.session_id, b"x" * len(ring.token)),
            ("no-such-session", ring.token),
        ):
            with pytest.raises(DoorbellRefused, match="refused the hello"):
                ClientDoorbell.connect(path, session_id, token)
        assert len(sample_ids(loader)) == len(loader)  # the real client is unaffected


def test_a_session_the_server_closes_mid_epoch_is_reopened_and_the_epoch_goes_on(
    server: RunningServer,
) -> None:
    """The server closing the session hangs up its doorbell: the loop never hangs; the
    Loader reopens the session and the epoch serves each sample once, in order."""
    with records_loader(server, batch_size=1, shuffle=False) as fresh:
        want = [i for batch in sample_ids(fresh) for i in batch]
    with records_loader(server, prefetch=1, batch_size=1, shuffle=False) as loader:  # > slots
        session = loader._replicas.primary.session
        assert session is not None
        it = iter(loader)
        got = next(it)["sample_id"].tolist()
        server.sessions.close(session.reply.session_id, reason="closed by the test")
        got += [i for batch in it for i in batch["sample_id"].tolist()]
        assert loader._replicas.primary.session is not None
        assert loader._replicas.primary.session.reply.session_id != session.reply.session_id
    assert got == want


def test_inline_transport_serves_what_shm_serves(server: RunningServer) -> None:
    """Bytes inside the stream (remote pools) and bytes in shared memory agree."""
    with (
        records_loader(server, seed=5, transport="shm") as shm,
        records_loader(server, seed=5, transport="inline") as inline,
    ):
        for a, b in zip(shm, inline, strict=True):
            assert a.keys() == b.keys()
            for name in a:
                assert torch.equal(a[name], b[name]), name


def test_zero_copy_batches_match_copied_ones(server: RunningServer) -> None:
    """zero_copy=True views hold the same values as owned tensors while they are valid."""
    with (
        records_loader(server, seed=9) as copied,
        records_loader(server, seed=9, zero_copy=True) as views,
    ):
        for a, b in zip(copied, views, strict=True):
            assert torch.equal(a["array"], b["array"])


def test_token_batches_pad_to_the_longest_with_masks_and_lengths(
    server: RunningServer, catalog: dict[str, Any]
) -> None:
    """input_ids padded with pad_id to the batch's longest; the mask marks the real tokens."""
    seqs = catalog["tokens"]
    with batchd.Loader(
        server.address,
        dataset="tokens",
        batch_size=8,
        pipeline=batchd.Tokens(max_len=10, pad_id=-1),
        shuffle=True,
    ) as loader:
        seen = 0
        for batch in loader:
            ids, mask, length = batch["input_ids"], batch["attention_mask"], batch["length"]
            longest = int(length.max())
            assert ids.shape == mask.shape == (len(length), longest)
            for row, label in enumerate(batch["label"].tolist()):
                want = seqs[label][:10]
                assert int(length[row]) == len(want)
                assert ids[row, : len(want)].tolist() == want.tolist()
                assert (ids[row, len(want) :] == -1).all()
                assert mask[row].tolist() == [1] * len(want) + [0] * (longest - len(want))
                seen += 1
        assert seen == len(seqs)


def test_image_batches_are_uint8_chw_with_catalog_labels(
    server: RunningServer, catalog: dict[str, Any]
) -> None:
    """Images come out as uint8 [B, 3, size, size]; labels are the class directories'."""
    classes = catalog["images"]["classes"]
    with catalog["engine"].connect() as conn:
        paths = dict(conn.execute(sa.text("SELECT id, path FROM samples")).all())
    with batchd.Loader(
        server.address, dataset="images", batch_size=5, pipeline=batchd.Image(size=48)
    ) as loader:
        for batch in loader:
            assert batch["image"].dtype == torch.uint8
            assert batch["image"].shape[1:] == (3, 48, 48)
            for sample_id, label in zip(
                batch["sample_id"].tolist(), batch["label"].tolist(), strict=True
            ):
                assert paths[sample_id].split("/")[-2] == classes[label]


def test_served_images_equal_an_independent_decode_of_their_files(
    server: RunningServer, catalog: dict[str, Any]
) -> None:
    """Through the server, the deterministic pipeline gives exactly the documented recipe
    (decode, shorter side to ``resize``, centre crop) applied to each sample's file."""
    root = Path(catalog["images"]["root"])
    with catalog["engine"].connect() as conn:
        paths = dict(conn.execute(sa.text("SELECT id, path FROM samples")).all())
    seen = 0
    with batchd.Loader(
        server.address, dataset="images", batch_size=5, pipeline=batchd.Image(size=40, resize=56)
    ) as loader:
        for batch in loader:
            for sample_id, image in zip(batch["sample_id"].tolist(), batch["image"], strict=True):
                want = reference_centre((root / paths[sample_id]).read_bytes(), 40, 56)
                np.testing.assert_array_equal(image.numpy(), want)
                seen += 1
    assert seen == catalog["images"]["splits"]["train"]


def test_same_seed_and_epoch_give_identical_augmented_images_with_1_and_2_workers(
    catalog: dict[str, Any], tmp_path: Path
) -> None:
    """Augmentation randomness follows (seed, epoch, sample id), not the worker."""
    spec = batchd.Image(size=40, random_crop=True, flip=True)
    results = []
    for workers in (1, 2):
        with (
            serve(catalog["url"], tmp_path, workers=workers) as srv,
            batchd.Loader(
                srv.address, dataset="images", batch_size=4, pipeline=spec, seed=11
            ) as loader,
        ):
            loader.set_epoch(2)
            results.append([(b["sample_id"].clone(), b["image"].clone()) for b in loader])
    for (ids1, img1), (ids2, img2) in zip(*results, strict=True):
        assert torch.equal(ids1, ids2)
        assert torch.equal(img1, img2)


def test_bad_samples_are_skipped_listed_and_recorded(engine: Engine, tmp_path: Path) -> None:
    """on_error='skip': short batches, failed ids listed, errors in sample_errors."""
    record_dataset(engine, tmp_path / "r", n=100, bad={3: "range", 50: "missing"})
    url = engine.url.render_as_string(hide_password=False)
    with (
        serve(url, tmp_path) as srv,
        records_loader(srv, batch_size=10, shuffle=False, max_error_fraction=0.05) as loader,
    ):
        rows = 0
        failed: list[int] = []
        for batch in loader:
            rows += len(batch["sample_id"])
            failed += loader.last_failed_sample_ids
        assert rows == 98
    ids = _catalog_ids(engine, "records")
    assert sorted(failed) == [ids[3], ids[50]]
    with engine.connect() as conn:
        recorded = dict(
            conn.execute(sa.select(sample_errors.c.sample_id, sample_errors.c.kind)).all()
        )
    assert recorded == {ids[3]: "unreadable", ids[50]: "missing"}


def test_bad_sample_with_on_error_raise_fails_with_its_id(engine: Engine, tmp_path: Path) -> None:
    """on_error='raise' ends the epoch with DataLoss naming the sample."""
    record_dataset(engine, tmp_path / "r", n=40, bad={7: "missing"})
    url = engine.url.render_as_string(hide_password=False)
    with (
        serve(url, tmp_path) as srv,
        records_loader(srv, batch_size=10, shuffle=False, on_error="raise") as loader,
        pytest.raises(errors.DataLoss, match=r"missing\.bin"),
    ):
        for _ in loader:
            pass


def test_bad_sample_with_on_error_replace_keeps_batches_full(
    engine: Engine, tmp_path: Path
) -> None:
    """on_error='replace': a deterministic substitute takes the bad sample's row."""
    record_dataset(engine, tmp_path / "r", n=40, bad={7: "missing"})
    url = engine.url.render_as_string(hide_password=False)
    runs = []
    with serve(url, tmp_path) as srv:
        for _ in range(2):
            with records_loader(
                srv, batch_size=10, shuffle=False, on_error="replace", max_error_fraction=0.1
            ) as loader:
                runs.append(sample_ids(loader))
    assert [len(b) for b in runs[0]] == [10, 10, 10, 10]
    assert runs[0] == runs[1]


def test_too_many_bad_samples_fail_the_session_clearly(engine: Engine, tmp_path: Path) -> None:
    """Past max_error_fraction the stream fails with DataLoss saying what to do."""
    record_dataset(engine, tmp_path / "r", n=100, bad={i: "missing" for i in range(0, 100, 10)})
    url = engine.url.render_as_string(hide_password=False)
    with (
        serve(url, tmp_path) as srv,
        records_loader(srv, batch_size=10, shuffle=False) as loader,
        pytest.raises(errors.DataLoss, match="max_error_fraction"),
    ):
        for _ in loader:
            pass


THREADS_DECODER = """
import os

import numpy as np
import torch

from batchd_server.pipelines.base import FieldSpec, Pipeline


class Threads(Pipeline):
    def fields(self):
        return [FieldSpec("threads", np.dtype(np.int64), (2,))]

    def decode_into(self, data, sample, row):
        row["threads"][...] = (torch.get_num_threads(), int(os.environ.get("OMP_NUM_THREADS", 0)))
"""


def test_workers_run_torch_and_openmp_single_threaded(
    engine: Engine, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """One worker per core is the parallelism: inside a worker torch (which resizes images)
    and OpenMP get one thread, whatever the machine has."""
    install_decoders(tmp_path / "site", THREADS_DECODER, {"threads": "Threads"})
    monkeypatch.syspath_prepend(str(tmp_path / "site"))  # before the workers are spawned
    record_dataset(engine, tmp_path / "r", n=20)
    url = engine.url.render_as_string(hide_password=False)
    with (
        serve(url, tmp_path) as srv,
        batchd.Loader(
            srv.address, dataset="records", batch_size=5, pipeline=batchd.Custom("threads")
        ) as loader,
    ):
        seen = np.concatenate([batch["threads"].numpy() for batch in loader])
    assert seen.shape == (20, 2)
    assert (seen == 1).all(), f"(torch threads, OMP_NUM_THREADS) in workers: {seen.tolist()}"


def test_open_session_errors_say_what_is_wrong(server: RunningServer) -> None:
    """Unknown datasets, bad batch sizes and impossible drop_last are clear errors."""
    with pytest.raises(errors.NotFound, match="nope"):
        batchd.Loader(server.address, dataset="nope", batch_size=4)
    with pytest.raises(errors.InvalidArgument, match="batch_size"):
        records_loader(server, batch_size=0)
    with pytest.raises(errors.FailedPrecondition, match="drop_last"):
        records_loader(server, batch_size=500, drop_last=True)


def test_iterable_dataset_feeds_a_dataloader_every_sample_once(
    server: RunningServer, catalog: dict[str, Any]
) -> None:
    """DataLoader(batchd.IterableDataset(loader), batch_size=None) passes batches through."""
    with records_loader(server, batch_size=16) as loader:
        data = torch.utils.data.DataLoader(batchd.IterableDataset(loader), batch_size=None)
        ids = [i for batch in data for i in batch["sample_id"].tolist()]
    assert len(ids) == len(set(ids)) == len(catalog["records"])


# -- CUDA (run on a machine with a GPU; deselected loudly elsewhere) ----------------------


@pytest.mark.gpu
@pytest.mark.parametrize(
    ("transport", "h2d", "prefetch", "strategy"),
    [
        ("shm", "auto", 4, "registered"),
        ("shm", "auto", 1, "registered"),
        ("shm", "pinned", 2, "pinned"),
        ("inline", "auto", 2, "pinned"),
    ],
)
def test_cuda_batches_equal_the_cpu_ones(
    server: RunningServer,
    monkeypatch: pytest.MonkeyPatch,
    transport: str,
    h2d: str,
    prefetch: int,
    strategy: str,
) -> None:
    """Batches land on the GPU equal to the CPU run, readable on the consumer's stream."""
    with records_loader(server, shuffle=False, transport=transport, device="cpu") as loader:
        expected = [{name: t.clone() for name, t in batch.items()} for batch in loader]
    monkeypatch.setattr(batchd.Loader, "_h2d", h2d)
    options = {"shuffle": False, "transport": transport, "prefetch": prefetch}
    with records_loader(server, device="cuda", **options) as loader:
        session = loader._replicas.primary.session
        assert session is not None and loader.transport == transport
        assert session.delivery.strategy == strategy
        n = len(loader)
        got = []
        for batch in loader:
            assert {t.device.type for t in batch.values()} == {"cuda"}
            # Work queued on the consumer stream right away must see the finished copy.
            got.append({name: (t * 1).cpu() for name, t in batch.items()})
        assert len(sample_ids(loader)) == len(loader)  # a second epoch: the slots came back
    assert len(got) == len(expected) == n
    for mine, theirs in zip(got, expected, strict=True):
        assert sorted(mine) == sorted(theirs)
        assert all(torch.equal(mine[name], theirs[name]) for name in mine)
