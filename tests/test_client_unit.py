"""The client on its own: specs, choices, rank resolution, transports, and the stream protocol.

The Loader tests run the real client over real gRPC (a unix socket) against ``WireDouble``:
a stand-in for batchd-server that speaks loader.proto's inline transport with synthetic,
deterministic batches and records what the client sent (acks, half-closes, early ends). It
checks the client's side of the contract (credits, acknowledgement timing, inline
chunking, resume) in ways the real server cannot show. The double names no doorbell, so
``transport="auto"`` falls back to inline here; the shm path (ring, doorbell, leases, lent
slots) is tested against the real server in ``test_loader.py``.
"""

from __future__ import annotations

import math
import os
import pickle
import queue
import secrets
import shutil
import subprocess
import sys
import tempfile
import threading
from collections.abc import Iterator
from concurrent import futures
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest
import torch

import batchd
from batchd._inline import InlineAssembler
from batchd._proto.batchd.v1 import loader_pb2, loader_pb2_grpc
from batchd._shm import SHM_DIR, ShmRing
from batchd._specs import resolve_rank
from batchd._transport import select_transport
from batchd.errors import (
    DataLoss,
    FailedPrecondition,
    InvalidArgument,
    NotFound,
    SnapshotMismatch,
)

# Not "batchd-": other suites running beside this one check that no batchd entry is left in
# /dev/shm, and the pid keeps two runs of this file apart.
TAG = f"bdclient-test-{os.getpid()}-"
ROWS = 10
FIELDS = (("sample_id", "<i8", ()), ("label", "<i8", ()), ("array", "<f4", (2,)))


@pytest.fixture(autouse=True)
def no_segment_left() -> Iterator[None]:
    """Every test leaves no segment of its own in /dev/shm (the client never creates any)."""
    yield
    assert sorted(p.name for p in SHM_DIR.iterdir() if p.name.startswith(TAG)) == []


# -- specs and choices --------------------------------------------------------------------


def test_image_spec_defaults_to_224_and_travels_whole() -> None:
    """Image() is 224 px; every option reaches the wire's ImagePipeline."""
    assert batchd.Image().size == 224
    spec = batchd.Image(size=160, resize=176, random_crop=True, flip=True, scale=[0.2, 0.9])
    msg = spec._to_proto().image
    assert (msg.size, msg.resize, msg.random_crop, msg.flip, msg.decoder) == (
        160,
        176,
        True,
        True,
        "auto",
    )
    assert msg.scale_min == pytest.approx(0.2) and msg.ratio_max == pytest.approx(4 / 3)
    assert spec.scale == (0.2, 0.9)
    assert batchd.Image()._to_proto().image.resize == 0


@pytest.mark.parametrize(
    ("kwargs", "words"),
    [
        ({"size": 0}, "size=0"),
        ({"size": True}, "size=True"),
        ({"size": 224, "resize": 200}, "resize=200"),
        ({"decoder": "cv2"}, "'pillow'"),
        ({"scale": (0.0, 1.0)}, "scale"),
        ({"scale": (0.5, 0.2)}, "scale"),
        ({"ratio": (1.0,)}, "ratio"),
    ],
)
def test_image_spec_rejects_bad_values_naming_them(kwargs: dict[str, Any], words: str) -> None:
    """A bad Image option is an InvalidArgument that names the option and the value."""
    with pytest.raises(InvalidArgument, match=words):
        batchd.Image(**kwargs)


def test_array_spec_normalises_shape_and_dtype() -> None:
    """Array accepts an int shape and NumPy dtypes, stores a tuple and the dtype's name."""
    spec = batchd.Array(32, np.float32, raw=True)
    assert (spec.shape, spec.dtype, spec.raw) == ((32,), "float32", True)
    msg = spec._to_proto().array
    assert (list(msg.shape), msg.dtype, msg.raw) == ([32], "float32", True)
    assert batchd.Array((), "int64").shape == ()


@pytest.mark.parametrize(
    ("shape", "dtype", "words"),
    [
        ((0, 3), "float32", "dimension=0"),
        ("abc", "float32", "shape"),
        ((3,), "object", "numeric"),
        ((3,), "U10", "numeric"),
        ((3,), ">f4", "big-endian"),
        ((3,), "notadtype", "not a NumPy dtype"),
    ],
)
def test_array_spec_rejects_bad_shapes_and_dtypes(shape: Any, dtype: str, words: str) -> None:
    """Zero dimensions, non-numeric and big-endian dtypes are refused with the reason."""
    with pytest.raises(InvalidArgument, match=words):
        batchd.Array(shape, dtype)


def test_tokens_spec_checks_pad_id_against_its_dtype() -> None:
    """pad_id must fit the token dtype; only int32 and uint16 token files exist."""
    assert batchd.Tokens(128, "uint16", pad_id=65535)._to_proto().tokens.pad_id == 65535
    with pytest.raises(InvalidArgument, match="pad_id"):
        batchd.Tokens(128, "uint16", pad_id=-1)
    with pytest.raises(InvalidArgument, match="'int32', 'uint16'"):
        batchd.Tokens(128, "int64")
    with pytest.raises(InvalidArgument, match="max_len=0"):
        batchd.Tokens(0)


def test_custom_spec_options_travel_as_json() -> None:
    """Custom's keyword options become the message's JSON; non-JSON values are refused."""
    spec = batchd.Custom("audio", rate=16000, channels=[0, 1])
    msg = spec._to_proto().custom
    assert msg.name == "audio" and msg.options_json == '{"channels": [0, 1], "rate": 16000}'
    assert spec == batchd.Custom("audio", channels=[0, 1], rate=16000)
    with pytest.raises(InvalidArgument, match="JSON"):
        batchd.Custom("audio", fn=print)
    with pytest.raises(InvalidArgument, match="JSON"):
        batchd.Custom("audio", gain=float("nan"))
    with pytest.raises(InvalidArgument, match="name"):
        batchd.Custom("")


@pytest.mark.parametrize(
    ("kwargs", "words"),
    [
        ({"batch_size": 0}, "batch_size=0"),
        ({"batch_size": 65537}, "65536"),
        ({"sampling": "random"}, "'class_balanced'"),
        ({"on_error": "ignore"}, "'replace'"),
        ({"transport": "tcp"}, "'inline'"),
        ({"pipeline": "image"}, "batchd.Image"),
        ({"max_error_fraction": 0.0}, "on_error='raise'"),
        ({"seed": -1}, "seed=-1"),
        ({"prefetch": 0}, "prefetch=0"),
        ({"dataset": ""}, "dataset"),
        ({"device": "tpu"}, "tpu"),
        ({"rank": 4, "world_size": 4}, "rank=4"),
    ],
)
def test_loader_arguments_are_checked_before_connecting(kwargs: dict[str, Any], words: str) -> None:
    """Bad Loader arguments fail with InvalidArgument before any server is contacted."""
    options: dict[str, Any] = {"dataset": "d", "batch_size": 4, **kwargs}
    with pytest.raises(InvalidArgument, match=words):
        batchd.Loader("unix:///nonexistent/batchd.sock", **options)


def test_cuda_device_without_cuda_is_a_clear_error() -> None:
    """Asking for a CUDA device that is not there says so and suggests device='cpu'."""
    with pytest.raises(InvalidArgument, match="cuda:99") as caught:
        batchd.Loader(
            "unix:///nonexistent/batchd.sock", dataset="d", batch_size=4, device="cuda:99"
        )
    if torch.cuda.is_available():
        assert "CUDA devices 0.." in str(caught.value)
    else:
        assert "CUDA is not available" in str(caught.value) and "device='cpu'" in str(caught.value)


# -- rank and world size ------------------------------------------------------------------


def test_rank_defaults_to_a_single_process() -> None:
    """Without arguments, torch.distributed or environment, rank 0 of 1."""
    assert resolve_rank(None, None, environ={}) == (0, 1)


def test_rank_comes_from_the_environment_unless_given() -> None:
    """RANK / WORLD_SIZE fill what the caller did not pass."""
    env = {"RANK": "2", "WORLD_SIZE": "4"}
    assert resolve_rank(None, None, environ=env) == (2, 4)
    assert resolve_rank(1, None, environ=env) == (1, 4)
    assert resolve_rank(0, 2, environ=env) == (0, 2)


@pytest.mark.parametrize(
    ("env", "words"),
    [
        ({"RANK": "x", "WORLD_SIZE": "2"}, "RANK='x'"),
        ({"RANK": "3", "WORLD_SIZE": "2"}, "environment"),
        ({"WORLD_SIZE": "0"}, "world_size=0"),
    ],
)
def test_bad_rank_environment_is_named(env: dict[str, str], words: str) -> None:
    """A malformed or inconsistent RANK / WORLD_SIZE is an InvalidArgument naming it."""
    with pytest.raises(InvalidArgument, match=words):
        resolve_rank(None, None, environ=env)


def test_initialised_torch_distributed_wins_over_the_environment(tmp_path: Path) -> None:
    """With a process group up, its rank and world size are used, not RANK / WORLD_SIZE."""
    import torch.distributed as dist

    dist.init_process_group(
        "gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1
    )
    try:
        assert resolve_rank(None, None, environ={"RANK": "3", "WORLD_SIZE": "8"}) == (0, 1)
    finally:
        dist.destroy_process_group()


# -- transports ---------------------------------------------------------------------------


@pytest.fixture
def segment() -> Iterator[tuple[loader_pb2.RingLayout, np.ndarray]]:
    """A real segment in /dev/shm laid out as a 2-slot ring, and its layout; removed after."""
    name = f"{TAG}{secrets.token_hex(8)}"
    layout = loader_pb2.RingLayout(
        shm_name=name,
        segment_bytes=64 + 2 * 256,
        header_bytes=64,
        slot_bytes=256,
        slots=2,
        token=secrets.token_bytes(16),
    )
    path = SHM_DIR / name
    with open(path, "wb") as f:
        f.write(layout.token.ljust(layout.segment_bytes, b"\0"))
    try:
        yield layout, np.memmap(path, dtype=np.uint8, mode="r+")
    finally:
        path.unlink(missing_ok=True)


def _response(index: int, slot: int, fields: list[tuple[str, str, list[int], int]]) -> Any:
    views = []
    for name, dtype, shape, offset in fields:
        nbytes = int(np.prod(shape)) * np.dtype(dtype).itemsize
        views.append(
            loader_pb2.FieldView(name=name, dtype=dtype, shape=shape, offset=offset, nbytes=nbytes)
        )
    return loader_pb2.StreamBatchesResponse(
        batch_index=index, slot=slot, rows=shape[0] if fields else 0, fields=views
    )


def _opened(layout: loader_pb2.RingLayout) -> loader_pb2.OpenSessionResponse:
    return loader_pb2.OpenSessionResponse(session_id="s" * 32, ring=layout)


def test_a_ring_with_the_right_token_maps_and_reads_its_slots_in_place(segment: Any) -> None:
    """The server's segment maps, and a batch's fields are views of its slot."""
    layout, memory = segment
    ring = ShmRing.open(layout)
    assert ring.writable
    try:
        slot1 = 64 + 256
        memory[slot1 : slot1 + 24].view("<i8")[:] = [7, 8, 9]
        memory[slot1 + 64 : slot1 + 88].view("<f4")[:] = np.arange(6)
        batch = ring.batch(
            _response(5, 1, [("sample_id", "<i8", [3], 0), ("array", "<f4", [3, 2], 64)])
        )
        assert batch.index == 5 and not batch.inline and batch.extent_bytes == 88
        assert batch.arrays["array"].base is batch.memory  # what the lend path watches
        assert batch.arrays["sample_id"].tolist() == [7, 8, 9]
        assert batch.arrays["array"].tolist() == [[0, 1], [2, 3], [4, 5]]
        with pytest.raises(DataLoss, match="does not fit"):
            ring.batch(_response(5, 1, [("array", "<f4", [40, 2], 64)]))
        with pytest.raises(DataLoss, match="slot 2"):
            ring.batch(_response(5, 2, [("sample_id", "<i8", [3], 0)]))
        del batch
    finally:
        ring.close()


def test_token_mismatch_falls_back_to_inline_or_fails_when_shm_is_forced(segment: Any) -> None:
    """A same-named segment with other bytes is not the server's: auto goes inline, shm fails."""
    layout, _ = segment
    other = loader_pb2.RingLayout()
    other.CopyFrom(layout)
    other.token = secrets.token_bytes(16)
    transport, ring, reason = select_transport("auto", _opened(other))
    assert (transport, ring) == (loader_pb2.TRANSPORT_INLINE, None) and "token" in reason
    with pytest.raises(FailedPrecondition, match=r"token.*emptyDir"):
        select_transport("shm", _opened(other))


def test_a_segment_without_a_reachable_doorbell_is_not_used(segment: Any) -> None:
    """The ring maps, but nobody answers on its doorbell: auto goes inline, shm says why."""
    layout, _ = segment
    for doorbell in ("", f"{TAG}{secrets.token_hex(8)}-bell"):
        layout.doorbell = doorbell
        transport, ring, reason = select_transport("auto", _opened(layout))
        assert (transport, ring) == (loader_pb2.TRANSPORT_INLINE, None) and "doorbell" in reason
        with pytest.raises(FailedPrecondition, match="doorbell"):
            select_transport("shm", _opened(layout))


def test_missing_segment_falls_back_to_inline_or_fails_when_shm_is_forced() -> None:
    """No such segment here: auto goes inline; shm says why and what to change."""
    layout = loader_pb2.RingLayout(
        shm_name=f"{TAG}{secrets.token_hex(8)}", segment_bytes=128, slot_bytes=64, slots=1
    )
    layout.token = b"t" * 16
    transport, ring, reason = select_transport("auto", _opened(layout))
    assert (transport, ring) == (loader_pb2.TRANSPORT_INLINE, None) and "cannot open" in reason
    with pytest.raises(FailedPrecondition, match="transport='auto' or 'inline'"):
        select_transport("shm", _opened(layout))
    traversal = loader_pb2.RingLayout(shm_name="../etc/passwd", segment_bytes=1, token=b"t")
    assert select_transport("auto", _opened(traversal))[1] is None


def test_inline_transport_never_opens_the_segment(segment: Any) -> None:
    """transport='inline' is honoured even where shm would work."""
    layout, _ = segment
    assert select_transport("inline", _opened(layout))[:2] == (loader_pb2.TRANSPORT_INLINE, None)


def _chunks(head: Any, data: bytes, size: int) -> list[Any]:
    pieces = [data[i : i + size] for i in range(0, len(data), size)] or [b""]
    messages = []
    for i, piece in enumerate(pieces):
        msg = loader_pb2.StreamBatchesResponse() if i else head
        msg.data, msg.more = piece, i < len(pieces) - 1
        messages.append(msg)
    head.inline_bytes = len(data)
    return messages


def test_inline_chunks_are_joined_into_one_owned_buffer() -> None:
    """Chunks cut across field boundaries come back as the right arrays, owned by the batch."""
    ids, values = np.array([3, 1, 2], "<i8"), np.arange(6, dtype="<f4").reshape(3, 2)
    data = ids.tobytes().ljust(64, b"\0") + values.tobytes()
    head = _response(4, -1, [("sample_id", "<i8", [3], 0), ("array", "<f4", [3, 2], 64)])
    head.failed_sample_ids[:] = [9]
    assembler = InlineAssembler()
    results = [assembler.feed(m) for m in _chunks(head, data, 7)]
    assert results[:-1] == [None] * (len(results) - 1) and len(results) == math.ceil(88 / 7)
    batch = results[-1]
    assert batch is not None and batch.inline and batch.slot == -1
    assert batch.index == 4 and batch.failed_sample_ids == (9,)
    assert batch.arrays["sample_id"].tolist() == [3, 1, 2]
    assert np.array_equal(batch.arrays["array"], values)
    empty = _response(5, -1, [("sample_id", "<i8", [0], 0)])
    assert InlineAssembler().feed(_chunks(empty, b"", 7)[0]).arrays["sample_id"].shape == (0,)


def test_inline_chunks_that_disagree_with_the_announced_size_are_data_loss() -> None:
    """More or fewer bytes than inline_bytes is a broken stream, not a silent truncation."""
    head = _response(0, -1, [("sample_id", "<i8", [2], 0)])
    too_many = _chunks(head, bytes(16), 8)
    too_many[0].inline_bytes = 8
    assembler = InlineAssembler()
    assembler.feed(too_many[0])
    with pytest.raises(DataLoss, match="more than the announced"):
        assembler.feed(too_many[1])
    short = _response(0, -1, [("sample_id", "<i8", [2], 0)])
    message = _chunks(short, bytes(8), 8)[0]
    message.inline_bytes = 16
    with pytest.raises(DataLoss, match="8 of the announced 16"):
        InlineAssembler().feed(message)


# -- the Loader against a wire double -----------------------------------------------------


def _order(request: Any, epoch: int) -> np.ndarray:
    """The double's plan: id order or a per-(seed, epoch) permutation, padded by wrapping."""
    shuffle = np.random.default_rng([request.seed, epoch]).permutation(ROWS)
    order = shuffle if request.shuffle else np.arange(ROWS)
    world_size = request.world_size or 1
    order = np.resize(order, math.ceil(ROWS / world_size) * world_size)
    return order[request.rank :: world_size]


class WireDouble(loader_pb2_grpc.LoaderServicer):
    """Serves ROWS synthetic samples (label = id % 3, array = [id, -id]) over loader.proto."""

    def __init__(self) -> None:
        self.sessions: dict[str, tuple[Any, Any, Path, list[int]]] = {}
        self.opened: list[Any] = []
        self.closed: list[str] = []
        self.starts: list[Any] = []
        self.acks: list[int] = []
        self.acked_wait_s = 0.0
        self.stream_ends: queue.Queue[str] = queue.Queue()
        self.fail_at_batch = -1
        self.failed_ids: dict[int, list[int]] = {}

    def OpenSession(self, request: Any, context: Any) -> Any:
        if request.dataset != "synthetic":
            context.abort(grpc.StatusCode.NOT_FOUND, f"no dataset {request.dataset!r}")
        if request.snapshot == "gone":
            context.set_trailing_metadata((("batchd-error-class", "SnapshotMismatch"),))
            context.abort(grpc.StatusCode.FAILED_PRECONDITION, "snapshot 'gone' has changed")
        rows, prefetch = request.batch_size, request.prefetch or 4
        offsets, slot_bytes = [], 0
        for _, dtype, shape in FIELDS:
            offsets.append(slot_bytes)
            slot_bytes += -(-rows * math.prod(shape) * np.dtype(dtype).itemsize // 64) * 64
        layout = loader_pb2.RingLayout(
            shm_name=f"{TAG}{secrets.token_hex(8)}",
            segment_bytes=64 + prefetch * slot_bytes,
            header_bytes=64,
            slot_bytes=slot_bytes,
            slots=prefetch,
            token=secrets.token_bytes(16),
        )
        path = SHM_DIR / layout.shm_name
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
        try:
            os.ftruncate(fd, layout.segment_bytes)
            os.pwrite(fd, layout.token, 0)
        finally:
            os.close(fd)
        per_rank = math.ceil(ROWS / (request.world_size or 1))
        reply = loader_pb2.OpenSessionResponse(
            session_id=secrets.token_hex(8),
            num_batches=math.ceil(per_rank / rows),
            num_samples=per_rank,
            fields=[loader_pb2.FieldSchema(name=n, dtype=d, shape=s) for n, d, s in FIELDS],
            snapshot=request.snapshot or "snap-1",
            ring=layout,
            lease_timeout_s=30.0,
            version=request.version or "v1",
            split=request.split,
            prefetch=prefetch,
        )
        self.sessions[reply.session_id] = (request, reply, path, offsets)
        self.opened.append(request)
        return reply

    def _take_ack(self, acks: queue.Queue[Any], free: list[int], slot_of: dict[int, int]) -> bool:
        ack = acks.get(timeout=30)
        if ack is None:
            return False
        for index in ack.batch_indices:
            free.append(slot_of.pop(index))  # an ack of a batch not held fails the stream
            self.acks.append(index)
        self.acked_wait_s += ack.wait_s
        return True

    def StreamBatches(self, request_iterator: Any, context: Any) -> Iterator[Any]:
        start = next(request_iterator).start
        self.starts.append(start)
        request, reply, _path, offsets = self.sessions[start.session_id]
        acks: queue.Queue[Any] = queue.Queue()

        def read() -> None:
            try:
                for message in request_iterator:
                    acks.put(message.ack)
            except grpc.RpcError:
                pass
            finally:
                acks.put(None)

        threading.Thread(target=read, daemon=True).start()
        free, slot_of = list(range(reply.prefetch)), {}
        order, size, slot_bytes = (
            _order(request, start.epoch),
            request.batch_size,
            reply.ring.slot_bytes,
        )
        ended = "early"
        try:
            for k in range(start.start_batch, reply.num_batches):
                while not free:
                    if not self._take_ack(acks, free, slot_of):
                        return
                if k == self.fail_at_batch:
                    context.abort(grpc.StatusCode.DATA_LOSS, f"batch {k}: sample is corrupt")
                ids = order[k * size : (k + 1) * size].astype("<i8")
                columns = [ids, ids % 3, np.stack([ids, -ids], 1).astype("<f4")]
                slot = free.pop(0)
                slot_of[k] = slot
                buffer = np.zeros(slot_bytes, dtype=np.uint8)
                msg = loader_pb2.StreamBatchesResponse(
                    batch_index=k, rows=len(ids), failed_sample_ids=self.failed_ids.get(k, [])
                )
                for (name, dtype, _), offset, column in zip(FIELDS, offsets, columns, strict=True):
                    buffer[offset : offset + column.nbytes] = column.view(np.uint8).ravel()
                    msg.fields.add(
                        name=name,
                        dtype=dtype,
                        shape=column.shape,
                        offset=offset,
                        nbytes=column.nbytes,
                    )
                assert start.transport == loader_pb2.TRANSPORT_INLINE, "the double has no doorbell"
                msg.slot = -1
                yield from _chunks(msg, buffer.tobytes(), 40)
            while self._take_ack(acks, free, slot_of):
                pass
            ended = "complete" if not slot_of else f"unacked {sorted(slot_of)}"
        finally:
            self.stream_ends.put(ended)

    def CloseSession(self, request: Any, context: Any) -> Any:
        _, _, path, _ = self.sessions.pop(request.session_id)
        path.unlink()
        self.closed.append(request.session_id)
        return loader_pb2.CloseSessionResponse()


@pytest.fixture
def double() -> Iterator[tuple[WireDouble, str]]:
    """A WireDouble on a unix socket; every session must be closed by the end of the test."""
    directory = tempfile.mkdtemp(prefix="batchd-client-", dir="/tmp")
    servicer = WireDouble()
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=8))
    loader_pb2_grpc.add_LoaderServicer_to_server(servicer, server)
    address = f"unix://{directory}/grpc.sock"
    assert server.add_insecure_port(address) != 0
    server.start()
    try:
        yield servicer, address
    finally:
        server.stop(None).wait()
        shutil.rmtree(directory)
        left = [path for _, _, path, _ in servicer.sessions.values()]
        for path in left:
            path.unlink(missing_ok=True)
        assert not left, "the client left sessions open"


def _loader(address: str, **options: Any) -> batchd.Loader:
    defaults: dict[str, Any] = {"dataset": "synthetic", "batch_size": 3, "device": "cpu"}
    return batchd.Loader(address, **{**defaults, **options})


def _ids(batches: Any) -> list[list[int]]:
    return [batch["sample_id"].tolist() for batch in batches]


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
        assert _ids(batches) == [[0, 1, 2], [3, 4, 5], [6, 7, 8], [9]]
        for b in batches:
            assert torch.equal(b["label"], b["sample_id"] % 3)
            assert b["array"].tolist() == [[i, -i] for i in b["sample_id"].tolist()]
        assert loader.batches_served == 4 and loader.last_failed_sample_ids == ()
        assert 0 <= server.acked_wait_s <= loader.wait_s and loader.wait_s > 0
        session_id = loader._conn.session.reply.session_id
    assert server.closed == [session_id]


def test_without_set_epoch_each_new_iteration_serves_the_next_epoch(double: Any) -> None:
    """A finished iteration moves to the next epoch; set_epoch goes back to a given one."""
    server, address = double
    with _loader(address) as loader:
        first, second = _ids(loader), _ids(loader)
        assert [s.epoch for s in server.starts] == [0, 1] and first != second
        loader.set_epoch(0)
        assert _ids(loader) == first and loader.epoch == 1


def test_resuming_from_state_dict_yields_exactly_the_rest_of_the_run(double: Any) -> None:
    """state_dict after k batches; a fresh Loader with it yields the uninterrupted rest."""
    server, address = double
    with _loader(address, seed=7) as loader:
        uninterrupted = _ids(loader) + _ids(loader)
    with _loader(address, seed=7) as loader:
        for k, _ in enumerate(loader):
            if k == 1:
                break
        state = loader.state_dict()
    assert (state["epoch"], state["next_batch"], state["snapshot"]) == (0, 2, "snap-1")
    with _loader(address, seed=7) as resumed:
        resumed.load_state_dict(state)
        assert _ids(resumed) + _ids(resumed) == uninterrupted[2:]
    assert server.starts[-2].start_batch == 2


def test_breaking_out_cancels_the_stream_and_iterating_again_continues(double: Any) -> None:
    """break ends the call at once; the next iteration picks up at the next batch."""
    server, address = double
    with _loader(address, shuffle=False) as loader:
        for batch in loader:
            seen = batch["sample_id"].tolist()
            break
        assert server.stream_ends.get(timeout=30) == "early"
        assert seen == [0, 1, 2]
        assert _ids(loader) == [[3, 4, 5], [6, 7, 8], [9]]


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
        ({"format": 3, "batchd_version": "9.0"}, "format=3 \\(written by batchd 9.0\\)"),
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
        first = loader._conn.session.reply.session_id
        loader.load_state_dict({**loader.state_dict(), "snapshot": "snap-0", "consumed": 3})
        assert server.opened[-1].snapshot == "snap-0" and loader.snapshot == "snap-0"
        assert server.closed == [first]
        with pytest.raises(SnapshotMismatch, match="gone"):
            loader.load_state_dict({**loader.state_dict(), "snapshot": "gone"})
        assert loader.snapshot == "snap-0" and len(_ids(loader)) == 3


def test_server_errors_arrive_as_batchd_errors(double: Any) -> None:
    """NotFound at open, DataLoss mid-stream; a missing server is Unavailable."""
    server, address = double
    with pytest.raises(NotFound, match="nope"):
        _loader(address, dataset="nope")
    with pytest.raises(batchd.errors.Unavailable, match="cannot reach"):
        _loader("unix:///nonexistent-batchd-dir/grpc.sock")
    server.fail_at_batch = 2
    with _loader(address) as loader, pytest.raises(DataLoss, match="batch 2"):
        _ids(loader)
    assert loader.batches_served == 2


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
        assert _ids(loaded) == [[0, 1, 2], [3, 4, 5], [6, 7, 8], [9]]
        with pytest.raises(InvalidArgument, match="num_workers=0"):
            pickle.dumps(dataset)
    # A process that forks after using gRPC may find its later calls hanging (gRPC skips its
    # fork handlers while its threads are busy), so the fork happens in a process of its own.
    result = subprocess.run(
        [sys.executable, "-c", FORKED_WORKER, address], capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0 and result.stdout.strip() == "refused", result.stderr


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
try:
    batchd.IterableDataset(loader)
except batchd.errors.FailedPrecondition as e:
    assert "needs torch" in str(e)
else:
    raise AssertionError("IterableDataset without torch")
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
