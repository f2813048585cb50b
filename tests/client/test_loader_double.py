"""The real Loader over real gRPC (a unix socket) against ``WireDouble``
(``tests/wire_double.py``): epochs, acknowledgements, cancelling, resume, errors, and
DataLoader integration, from the client's side of the wire."""

from __future__ import annotations

import pickle
import subprocess
import sys
from typing import Any

import grpc
import pytest
import torch

import batchd
from batchd.errors import (
    DataLoss,
    FailedPrecondition,
    InvalidArgument,
    NotFound,
    SnapshotMismatch,
    Unavailable,
)

from resume import assert_resume_yields_the_rest, sample_ids
from wire_double import WireDouble, serve_double


def _loader(address: str, **options: Any) -> batchd.Loader:
    defaults: dict[str, Any] = {"dataset": "synthetic", "batch_size": 3, "device": "cpu"}
    return batchd.Loader(address, **{**defaults, **options})


@pytest.mark.parametrize("transport", ["auto", "inline"])
def test_an_epoch_yields_every_batch_with_exactly_its_fields(double: Any, transport: str) -> None:
    """Every batch in order, each field shaped per its FieldView, all acked, stream closed."""
    server, address = double
    with _loader(address, transport=transport, shuffle=False) as loader:
        assert (len(loader), loader.transport, loader.snapshot) == (4, "inline", "snap-1")
        batches = list(loader)
        assert server.stream_ends.get(timeout=30) == "complete"
        assert sorted(server.acks) == [0, 1, 2, 3]
        assert [sorted(b) for b in batches] == [["array", "label", "sample_id"]] * 4
        assert all(isinstance(t, torch.Tensor) for b in batches for t in b.values())
        assert sample_ids(batches) == [[0, 1, 2], [3, 4, 5], [6, 7, 8], [9]]
        for b in batches:
            assert torch.equal(b["label"], b["sample_id"] % 3)
            assert b["array"].tolist() == [[i, -i] for i in b["sample_id"].tolist()]
        assert loader.batches_served == 4 and loader.last_failed_sample_ids == ()
        assert 0 <= server.acked_wait_s <= loader.wait_s and loader.wait_s > 0
        session_id = loader._replicas.primary.session.reply.session_id
    assert server.closed == [session_id]


def test_without_set_epoch_each_new_iteration_serves_the_next_epoch(double: Any) -> None:
    """A finished iteration moves to the next epoch; set_epoch goes back to a given one."""
    server, address = double
    with _loader(address) as loader:
        first, second = sample_ids(loader), sample_ids(loader)
        assert [s.epoch for s in server.starts] == [0, 1] and first != second
        loader.set_epoch(0)
        assert sample_ids(loader) == first and loader.epoch == 1


@pytest.mark.parametrize("stop_after", [0, 2, 4, 6])  # 4 batches an epoch
def test_resuming_from_state_dict_yields_exactly_the_rest_of_the_run(
    double: Any, stop_after: int
) -> None:
    """state_dict after k batches; a fresh Loader with it yields the uninterrupted rest, its
    first stream starting at the saved epoch and batch."""
    server, address = double
    state = assert_resume_yields_the_rest(
        lambda: _loader(address, seed=7), epochs=2, stop_after=stop_after
    )
    assert (state["epoch"], state["next_batch"], state["snapshot"]) == (
        *divmod(stop_after, 4),
        "snap-1",
    )
    first_resumed = server.starts[state["epoch"] - 2]  # the resumed run's streams come last
    assert (first_resumed.epoch, first_resumed.start_batch) == (
        state["epoch"],
        state["next_batch"],
    )


def test_breaking_out_cancels_the_stream_and_iterating_again_continues(double: Any) -> None:
    """break ends the call at once; the next iteration picks up at the next batch."""
    server, address = double
    with _loader(address, shuffle=False) as loader:
        for batch in loader:
            seen = batch["sample_id"].tolist()
            break
        assert server.stream_ends.get(timeout=30) == "early"
        assert seen == [0, 1, 2]
        assert sample_ids(loader) == [[3, 4, 5], [6, 7, 8], [9]]


def test_a_new_iterator_supersedes_the_old_one(double: Any) -> None:
    """Only one stream per Loader: the older iterator is cancelled and then refuses to go on."""
    server, address = double
    with _loader(address, shuffle=False) as loader:
        old = iter(loader)
        next(old)
        new = iter(loader)
        assert next(new)["sample_id"].tolist() == [3, 4, 5]
        assert server.stream_ends.get(timeout=30) == "early"
        with pytest.raises(FailedPrecondition, match="abandoned"):
            next(old)


@pytest.mark.parametrize(
    ("change", "words"),
    [
        ({"batch_size": 4}, "batch_size=4"),
        ({"seed": 1}, "seed=1"),
        ({"shuffle": False}, "shuffle=False"),
        ({"format": 4, "batchd_version": "9.0"}, "format=4 \\(written by batchd 9.0\\)"),
        ({"consumed": 297}, "consumed=297"),
        ({"epoch": -1}, "epoch=-1"),
    ],
)
def test_load_state_dict_refuses_a_state_it_cannot_resume(
    double: Any, change: dict[str, Any], words: str
) -> None:
    """A state of other options, format or position is an InvalidArgument naming the key."""
    server, address = double
    with _loader(address) as loader:
        state = loader.state_dict()
        with pytest.raises(InvalidArgument, match=words):
            loader.load_state_dict({**state, **change})
        with pytest.raises(InvalidArgument, match="missing consumed"):
            loader.load_state_dict({k: v for k, v in state.items() if k != "consumed"})
        assert len(server.opened) == 1


def test_load_state_dict_reopens_the_session_on_the_saved_snapshot(double: Any) -> None:
    """Another snapshot reopens the session pinned to it; a vanished one leaves it as it was."""
    server, address = double
    with _loader(address) as loader:
        first = loader._replicas.primary.session.reply.session_id
        loader.load_state_dict({**loader.state_dict(), "snapshot": "snap-0", "consumed": 3})
        assert server.opened[-1].snapshot == "snap-0" and loader.snapshot == "snap-0"
        assert server.closed == [first]
        with pytest.raises(SnapshotMismatch, match="gone"):
            loader.load_state_dict({**loader.state_dict(), "snapshot": "gone"})
        assert loader.snapshot == "snap-0" and len(sample_ids(loader)) == 3


def test_server_errors_arrive_as_batchd_errors(double: Any) -> None:
    """NotFound at open, DataLoss mid-stream; a missing server is Unavailable."""
    server, address = double
    with pytest.raises(NotFound, match="nope"):
        _loader(address, dataset="nope")
    with pytest.raises(batchd.errors.Unavailable, match="cannot reach"):
        _loader("unix:///nonexistent-batchd-dir/grpc.sock")
    server.fail_at_batch = 2
    with _loader(address) as loader, pytest.raises(DataLoss, match="batch 2"):
        sample_ids(loader)
    assert loader.batches_served == 2


def _forget_every_stream(self: WireDouble, request_iterator: Any, context: Any) -> Any:
    """A StreamBatches that finds the session gone, whatever the session."""
    self.starts.append(next(request_iterator).start)
    context.abort(grpc.StatusCode.NOT_FOUND, "session expired")
    yield  # a generator, as the real method


@pytest.mark.parametrize("reconnect_timeout_s", [0.0, 1.0])
@pytest.mark.timeout(60)
def test_a_server_that_forgets_every_new_session_fails_the_loop_once_time_is_up(
    monkeypatch: pytest.MonkeyPatch, reconnect_timeout_s: float
) -> None:
    """Every reopen succeeds and every stream finds its session gone: the Loader keeps
    reopening until reconnect_timeout_s (with 0: once), then raises Unavailable; it never
    loops on."""
    monkeypatch.setattr(WireDouble, "StreamBatches", _forget_every_stream)
    with serve_double() as (server, address):
        with (
            _loader(address, reconnect_timeout_s=reconnect_timeout_s) as loader,
            pytest.raises(Unavailable, match="lost each before a batch came"),
        ):
            next(iter(loader))
        assert len(server.opened) == len(server.starts) >= 2
        if reconnect_timeout_s == 0:
            assert len(server.opened) == 2


def test_failed_sample_ids_of_the_latest_batch_are_exposed(double: Any) -> None:
    """last_failed_sample_ids follows the batch just handed out."""
    server, address = double
    server.failed_ids = {1: [4, 11]}
    with _loader(address) as loader:
        seen = [loader.last_failed_sample_ids for _ in loader]
    assert seen == [(), (4, 11), (), ()]


def test_close_is_idempotent_and_final(double: Any) -> None:
    """close() twice closes the session once; iterating afterwards is FailedPrecondition."""
    server, address = double
    loader = _loader(address)
    loader.close()
    loader.close()
    assert len(server.closed) == 1
    with pytest.raises(FailedPrecondition, match="closed"):
        iter(loader)


def test_iterable_dataset_serves_the_loader_through_a_dataloader(double: Any) -> None:
    """DataLoader(ds, batch_size=None) yields the Loader's batches; workers are refused."""
    _, address = double
    with _loader(address, shuffle=False) as loader:
        dataset = batchd.IterableDataset(loader)
        assert len(dataset) == 4
        loaded = torch.utils.data.DataLoader(dataset, batch_size=None)
        assert sample_ids(loaded) == [[0, 1, 2], [3, 4, 5], [6, 7, 8], [9]]
        with pytest.raises(InvalidArgument, match="num_workers=0"):
            pickle.dumps(dataset)
    # A process that forks after using gRPC may find its later calls hanging (gRPC skips its
    # fork handlers while its threads are busy), so the fork happens in a process of its own.
    result = subprocess.run(
        [sys.executable, "-c", FORKED_WORKER, address], capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0 and result.stdout.strip() == "refused", result.stderr


def test_batchd_dataloader_is_a_torch_dataloader_with_the_loaders_state(double: Any) -> None:
    """batchd.DataLoader(loader) yields the Loader's batches, and its state_dict, saved
    after 2 batches, makes another one yield exactly the rest."""
    _, address = double
    with _loader(address, shuffle=False) as loader:
        data = batchd.DataLoader(loader)
        assert isinstance(data, torch.utils.data.DataLoader) and data.batch_size is None
        assert len(data) == 4 and data.loader is loader
        whole = sample_ids(data)
        it = iter(data)
        next(it), next(it)
        state = data.state_dict()
    assert state["consumed"] == 6
    with _loader(address, shuffle=False) as loader:
        data = batchd.DataLoader(batchd.IterableDataset(loader))
        data.load_state_dict(state)
        assert sample_ids(data) == whole[2:]


FORKED_WORKER = """
import sys, torch, batchd
loader = batchd.Loader(sys.argv[1], dataset="synthetic", batch_size=3, device="cpu")
dataset = batchd.IterableDataset(loader)
loader.close()
forked = torch.utils.data.DataLoader(
    dataset, batch_size=None, num_workers=1, multiprocessing_context="fork"
)
try:
    for _ in forked:
        pass
except batchd.errors.InvalidArgument as e:
    assert "DataLoader worker" in str(e), e
    print("refused")
else:
    raise AssertionError("a DataLoader worker iterated the Loader")
"""


WITHOUT_TORCH = """
import sys
sys.modules["torch"] = None  # as if torch were not installed
import batchd, numpy
with batchd.Loader(sys.argv[1], dataset="synthetic", batch_size=3, shuffle=False) as loader:
    batches = list(loader)
assert all(type(a) is numpy.ndarray for b in batches for a in b.values()), batches
assert [b["sample_id"].tolist() for b in batches] == [[0, 1, 2], [3, 4, 5], [6, 7, 8], [9]]
for wrapper in (batchd.IterableDataset, batchd.DataLoader):
    try:
        wrapper(loader)
    except batchd.errors.FailedPrecondition as e:
        assert "needs torch" in str(e)
    else:
        raise AssertionError(f"{wrapper.__name__} without torch")
print("ok", loader.device)
"""


def test_without_torch_batches_are_numpy_arrays(double: Any) -> None:
    """A process without torch gets dicts of NumPy arrays on the CPU."""

    _, address = double
    result = subprocess.run(
        [sys.executable, "-c", WITHOUT_TORCH, address], capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["ok", "cpu"]


def test_a_loader_cannot_be_pickled(double: Any) -> None:
    """Sending a Loader to another process fails with what to do instead."""
    _, address = double
    with _loader(address) as loader, pytest.raises(InvalidArgument, match="IterableDataset"):
        pickle.dumps(loader)
