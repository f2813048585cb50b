"""Fuzzing a live server: random and mutated OpenSession requests, StreamBatches calls and
doorbell frames (over 10,000 in all). Each call ends with a status other than UNKNOWN, the
server stays up, and no session, thread or file descriptor is left behind."""

from __future__ import annotations

import os
import socket
import struct
import threading
import time
from collections import Counter
from collections.abc import Iterator

import grpc
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from sqlalchemy.engine import Engine

from batchd._proto.batchd.v1 import loader_pb2 as pb
from batchd._proto.batchd.v1 import loader_pb2_grpc
from batchd_server.api import RunningServer

from serving import record_dataset, serve

pytestmark = pytest.mark.slow(seconds=30)

_FUZZ = settings(
    deadline=None,
    database=None,
    suppress_health_check=list(HealthCheck),
    derandomize=True,
)
_NAMES = st.one_of(
    st.sampled_from(["records", "", "nope", "records\x00", "x" * 300]), st.text(max_size=40)
)
_INT32 = st.integers(-(1 << 31), (1 << 31) - 1)


@st.composite
def pipelines(draw: st.DrawFn) -> pb.Pipeline:
    kind = draw(st.sampled_from(["image", "array", "tokens", "custom", "none"]))
    if kind == "image":
        return pb.Pipeline(image=pb.ImagePipeline(size=draw(_INT32), resize=draw(_INT32)))
    if kind == "array":
        shape = draw(st.lists(st.integers(-(1 << 63), (1 << 63) - 1), max_size=40))
        dtype = draw(st.sampled_from(["float32", "<f4", ">i8", "object", "", "U10", "V3"]))
        return pb.Pipeline(
            array=pb.ArrayPipeline(shape=shape, dtype=dtype, raw=draw(st.booleans()))
        )
    if kind == "tokens":
        return pb.Pipeline(tokens=pb.TokensPipeline(max_len=draw(_INT32), dtype=draw(_NAMES)))
    if kind == "custom":
        return pb.Pipeline(
            custom=pb.CustomPipeline(name=draw(_NAMES), options_json=draw(st.text(max_size=30)))
        )
    return pb.Pipeline()


_VALID = pb.Pipeline(array=pb.ArrayPipeline(shape=[32], dtype="float32", raw=True))


@st.composite
def open_requests(draw: st.DrawFn) -> bytes:
    """Serialized OpenSession requests: a third near-valid (one that the server accepts,
    with fields nudged), the rest random; some with bytes flipped."""
    if draw(st.integers(0, 2)) == 0:
        request = pb.OpenSessionRequest(
            dataset="records",
            batch_size=draw(st.integers(-1, 40)),
            rank=draw(st.integers(-1, 2)),
            world_size=draw(st.integers(0, 2)),
            pipeline=_VALID,
            prefetch=draw(st.integers(-1, 70)),
            sampling=draw(st.integers(0, 5)),
            on_error=draw(st.integers(0, 4)),
        )
        return request.SerializeToString()
    request = pb.OpenSessionRequest(
        dataset=draw(_NAMES),
        version=draw(_NAMES),
        split=draw(st.sampled_from(["train", "", "val\x00"])),
        batch_size=draw(_INT32),
        seed=draw(st.integers(0, (1 << 64) - 1)),
        rank=draw(_INT32),
        world_size=draw(_INT32),
        sampling=draw(st.integers(0, 7)),
        pipeline=draw(pipelines()),
        prefetch=draw(_INT32),
        snapshot=draw(st.text(max_size=60)),
        on_error=draw(st.integers(0, 7)),
        max_error_fraction=draw(st.floats(allow_nan=True, allow_infinity=True)),
    )
    data = bytearray(request.SerializeToString())
    for _ in range(draw(st.integers(0, 3))):  # mutate: flip bytes of a valid message
        if data:
            i = draw(st.integers(0, len(data) - 1))
            data[i] = draw(st.integers(0, 255))
    return bytes(data)


@pytest.fixture(scope="module")
def fuzzed_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningServer]:
    from batchd_server.catalog import migrate
    from batchd_server.catalog.db import make_engine

    tmp = tmp_path_factory.mktemp("fuzz")
    url = f"sqlite:///{tmp / 'catalog.db'}"
    engine: Engine = make_engine(url)
    migrate.upgrade(engine)
    record_dataset(engine, tmp / "r", n=30)
    engine.dispose()
    with serve(url, tmp, workers=1, max_sessions=8) as server:
        yield server


def _raw(channel: grpc.Channel, method: str) -> grpc.UnaryUnaryMultiCallable:
    return channel.unary_unary(f"/batchd.v1.Loader/{method}")


def _baseline() -> tuple[int, int]:
    return threading.active_count(), len(os.listdir("/proc/self/fd"))


def _settles(server: RunningServer, threads: int, fds: int) -> None:
    """Sessions, threads and fds come back to where they were (allowing a little slack for
    gRPC's own pollers)."""
    deadline = time.monotonic() + 60
    while True:
        now_threads, now_fds = _baseline()
        if len(server.sessions) == 0 and now_threads <= threads + 4 and now_fds <= fds + 8:
            return
        if time.monotonic() > deadline:
            pytest.fail(
                f"left behind: {len(server.sessions)} sessions, threads {threads}->{now_threads}, "
                f"fds {fds}->{now_fds}"
            )
        time.sleep(0.1)


def test_random_and_mutated_open_session_requests_never_end_unknown(
    fuzzed_server: RunningServer,
) -> None:
    """5,000 OpenSession requests: each ends OK (then closed) or with a meaningful status."""
    threads, fds = _baseline()
    codes: Counter[str] = Counter()
    with grpc.insecure_channel(fuzzed_server.address) as channel:
        open_raw, stub = _raw(channel, "OpenSession"), loader_pb2_grpc.LoaderStub(channel)

        @given(open_requests())
        def run(data: bytes) -> None:
            try:
                reply = pb.OpenSessionResponse.FromString(open_raw(data, timeout=30))
                codes["OK"] += 1
                stub.CloseSession(pb.CloseSessionRequest(session_id=reply.session_id), timeout=30)
            except grpc.RpcError as e:
                codes[e.code().name] += 1
                assert e.code() != grpc.StatusCode.UNKNOWN, e.details()

        settings(_FUZZ, max_examples=5000)(run)()
        assert stub.ListDatasets(pb.ListDatasetsRequest(), timeout=30).datasets
    assert sum(codes.values()) >= 5000 and codes["OK"] > 0, codes
    _settles(fuzzed_server, threads, fds)


def test_random_stream_batches_calls_never_end_unknown(fuzzed_server: RunningServer) -> None:
    """2,500 StreamBatches calls with random first messages, some on a real session."""
    threads, fds = _baseline()
    codes: Counter[str] = Counter()
    with grpc.insecure_channel(fuzzed_server.address) as channel:
        stub = loader_pb2_grpc.LoaderStub(channel)
        opened = stub.OpenSession(
            pb.OpenSessionRequest(
                dataset="records",
                batch_size=4,
                pipeline=pb.Pipeline(array=pb.ArrayPipeline(shape=[32], dtype="float32", raw=True)),
            ),
            timeout=30,
        )
        starts = st.builds(
            pb.StreamStart,
            session_id=st.sampled_from([opened.session_id, "", "nope", "\x00"]),
            epoch=st.integers(-(1 << 63), (1 << 63) - 1),
            start_batch=st.integers(-(1 << 63), (1 << 63) - 1),
            transport=st.integers(0, 4),
            seq=st.integers(-(1 << 63), (1 << 63) - 1),
        )
        first = st.one_of(
            starts.map(lambda s: pb.StreamBatchesRequest(start=s)),
            st.builds(pb.Ack, batch_indices=st.lists(st.integers(-5, 50), max_size=5)).map(
                lambda a: pb.StreamBatchesRequest(ack=a)
            ),
            st.just(pb.StreamBatchesRequest()),
        )

        @given(st.lists(first, min_size=0, max_size=3))
        def run(requests: list[pb.StreamBatchesRequest]) -> None:
            call = stub.StreamBatches(iter(requests), timeout=30)
            try:
                for i, _ in enumerate(call):
                    if i >= 2:
                        call.cancel()
                codes["OK"] += 1
            except grpc.RpcError as e:
                codes[e.code().name] += 1
                assert e.code() != grpc.StatusCode.UNKNOWN, e.details()

        settings(_FUZZ, max_examples=2500)(run)()
        stub.CloseSession(pb.CloseSessionRequest(session_id=opened.session_id), timeout=30)
    assert sum(codes.values()) >= 2500, codes
    _settles(fuzzed_server, threads, fds)


def test_random_doorbell_frames_are_refused_without_harm(fuzzed_server: RunningServer) -> None:
    """2,500 connections to the doorbell sending random bytes or random frames: each is
    closed by the server, which still serves gRPC afterwards."""
    threads, fds = _baseline()
    path = fuzzed_server.registry.shm_dir / fuzzed_server.sessions.doorbell
    frames = st.one_of(
        st.binary(max_size=64),
        st.builds(
            lambda length, kind, payload: struct.pack("<IB", length, kind) + payload,
            st.integers(0, (1 << 32) - 1),
            st.integers(0, 255),
            st.binary(max_size=32),
        ),
        st.builds(
            lambda payload: struct.pack("<IB", len(payload), ord("H")) + payload,
            st.binary(max_size=48),
        ),
    )

    @given(frames)
    def run(data: bytes) -> None:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
            sock.settimeout(30)
            sock.connect(str(path))
            sock.sendall(data)
            sock.shutdown(socket.SHUT_WR)
            while sock.recv(4096):  # the server answers (at most a refusal) and hangs up
                pass

    settings(_FUZZ, max_examples=2500)(run)()
    with grpc.insecure_channel(fuzzed_server.address) as channel:
        stub = loader_pb2_grpc.LoaderStub(channel)
        assert stub.ListDatasets(pb.ListDatasetsRequest(), timeout=30).datasets
    _settles(fuzzed_server, threads, fds)
