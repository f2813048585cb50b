"""Streams that never read: they cannot take every call the server serves. A new client's
epoch runs beside 64 of them, CloseSession and health checks always get through (even when
the silent streams hold every place they may), and one client's silent streams stop at its
own limit. Real server, real gRPC streams left unread, real Loaders."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from sqlalchemy.engine import Engine

import batchd
from batchd import errors
from batchd._proto.batchd.v1 import loader_pb2 as pb
from batchd._proto.batchd.v1 import loader_pb2_grpc
from batchd._wire.metadata import CLIENT_ID_KEY
from batchd_server.api import RunningServer

from chaos_harness import wait_until
from serving import RECORD_FLOATS, record_dataset, records_loader, serve

# A migrated Postgres catalog (once: the limits under test do not depend on it).
pytestmark = pytest.mark.backend("postgres")

_RECORDS = pb.Pipeline(array=pb.ArrayPipeline(shape=[RECORD_FLOATS], dtype="float32", raw=True))
_N = 203


@pytest.fixture
def url(engine: Engine, tmp_path: Path) -> str:
    record_dataset(engine, tmp_path / "r", n=_N)
    return engine.url.render_as_string(hide_password=False)


def _open(stub: loader_pb2_grpc.LoaderStub, client: str) -> str:
    request = pb.OpenSessionRequest(dataset="records", batch_size=16, pipeline=_RECORDS)
    reply = stub.OpenSession(request, timeout=60, metadata=[(CLIENT_ID_KEY, client)])
    return str(reply.session_id)


def _close(stub: loader_pb2_grpc.LoaderStub, session_id: str, client: str) -> None:
    """CloseSession as ``client``, which opened the session (no one else may close it)."""
    request = pb.CloseSessionRequest(session_id=session_id)
    stub.CloseSession(request, timeout=10, metadata=[(CLIENT_ID_KEY, client)])


@contextmanager
def silent_streams(
    server: RunningServer, clients: list[str], sessions: list[str] | None = None
) -> Iterator[list[grpc.Future]]:
    """One StreamBatches call per client that never reads a batch and never acks: it sends
    the StreamStart of its session (or, without ``sessions``, nothing at all) and then holds
    the call open until the block ends; then every call is cancelled."""
    stop = threading.Event()
    channel = grpc.insecure_channel(server.address)
    stub = loader_pb2_grpc.LoaderStub(channel)

    def requests(session_id: str | None) -> Iterator[pb.StreamBatchesRequest]:
        if session_id is not None:
            start = pb.StreamStart(session_id=session_id, transport=pb.TRANSPORT_INLINE)
            yield pb.StreamBatchesRequest(start=start)
        stop.wait()

    calls = [
        stub.StreamBatches(
            requests(None if sessions is None else sessions[i]),
            metadata=[(CLIENT_ID_KEY, client)],
        )
        for i, client in enumerate(clients)
    ]
    try:
        yield calls
    finally:
        stop.set()
        for call in calls:
            call.cancel()
        channel.close()
        wait_until(lambda: server.admission.calls == 0, "the silent streams to end", 60)


def _refusal(call: grpc.Future) -> str | None:
    """The details of a call the server refused with RESOURCE_EXHAUSTED, else None."""
    if call.running() or call.code() != grpc.StatusCode.RESOURCE_EXHAUSTED:
        return None
    return str(call.details())


def _health(server: RunningServer) -> int:
    with grpc.insecure_channel(server.address) as channel:
        reply = health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest(service=""), timeout=10
        )
    return int(reply.status)


def test_64_silent_streams_stop_neither_a_new_clients_epoch_nor_close_session(
    url: str, tmp_path: Path
) -> None:
    """64 clients each open a session and a stream that never reads: all 64 hold a call.
    A new client's epoch still runs (inline and shm), each sample once, and CloseSession of
    a silent client's session goes through."""
    with serve(url, tmp_path) as srv, grpc.insecure_channel(srv.address) as channel:
        stub = loader_pb2_grpc.LoaderStub(channel)
        clients = [f"silent-{i}" for i in range(64)]
        sessions = [_open(stub, c) for c in clients]
        with silent_streams(srv, clients, sessions):
            wait_until(lambda: srv.admission.calls == 64, "64 silent streams to be served", 60)
            for transport in ("inline", "shm"):
                with records_loader(srv, transport=transport) as loader:
                    ids = [i for batch in loader for i in batch["sample_id"].tolist()]
                assert sorted(ids) == sorted(set(ids)) and len(ids) == _N, transport
            _close(stub, sessions[0], clients[0])
            assert len(srv.sessions) == 63
            assert srv.admission.calls == 64, "the silent streams still hold their calls"
        for session_id, client in zip(sessions[1:], clients[1:], strict=True):
            _close(stub, session_id, client)


def test_close_session_and_health_get_through_when_every_place_is_taken(
    url: str, tmp_path: Path
) -> None:
    """A server of 16 concurrent calls keeps 2 for CloseSession and health: 64 silent
    streams get 14, the other 50 are refused at once naming --max-concurrent-rpcs; a new
    session is refused the same way, but CloseSession and the health check answer. Once the
    streams go, a Loader runs its epoch."""
    with serve(url, tmp_path, max_concurrent_rpcs=16) as srv:
        with grpc.insecure_channel(srv.address) as channel:
            stub = loader_pb2_grpc.LoaderStub(channel)
            held = _open(stub, "early")
            with silent_streams(srv, [f"silent-{i}" for i in range(64)]) as calls:
                wait_until(
                    lambda: sum(_refusal(c) is not None for c in calls) == 50,
                    "50 of the 64 silent streams to be refused",
                    60,
                )
                assert srv.admission.calls == 14
                refusal = next(r for c in calls if (r := _refusal(c)) is not None)
                assert "serving 14 calls" in refusal and "--max-concurrent-rpcs" in refusal
                assert "BATCHD_MAX_CONCURRENT_RPCS" in refusal
                with pytest.raises(grpc.RpcError) as opening:
                    _open(stub, "newcomer")
                assert opening.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
                for _ in range(20):  # the reserve is not used up by calls that went through
                    assert _health(srv) == health_pb2.HealthCheckResponse.SERVING
                _close(stub, held, "early")
                assert len(srv.sessions) == 0
        with records_loader(srv, transport="inline") as loader:
            assert sum(len(b["sample_id"]) for b in loader) == _N


def test_one_clients_silent_streams_stop_at_its_own_limit(url: str, tmp_path: Path) -> None:
    """40 silent streams of one client: 32 are served (--client-max-calls), 8 are refused
    naming that limit; another client's Loader (this process) still opens, streams and
    closes while the 32 hold their calls."""
    with (
        serve(url, tmp_path, max_concurrent_rpcs=40) as srv,  # 35 places for everyone
        silent_streams(srv, ["greedy"] * 40) as calls,
    ):
        wait_until(
            lambda: sum(_refusal(c) is not None for c in calls) == 8,
            "8 of the greedy client's streams to be refused",
            60,
        )
        assert srv.admission.by_client() == {"unix greedy": 32}
        refusal = next(r for c in calls if (r := _refusal(c)) is not None)
        assert "client 'unix greedy' has 32 calls in progress" in refusal
        assert "--client-max-calls" in refusal and "BATCHD_CLIENT_MAX_CALLS" in refusal
        with records_loader(srv, transport="inline") as loader:
            assert sum(len(b["sample_id"]) for b in loader) == _N


def test_a_loader_refused_for_the_limit_gets_resource_exhausted(url: str, tmp_path: Path) -> None:
    """The Loader raises batchd.errors.ResourceExhausted with the server's message when its
    client is at its session limit."""
    with serve(url, tmp_path, client_max_sessions=1) as srv, records_loader(srv) as first:
        next(iter(first))
        with pytest.raises(errors.ResourceExhausted, match="--client-max-sessions"):
            batchd.Loader(
                srv.address,
                dataset="records",
                batch_size=4,
                pipeline=batchd.Array((RECORD_FLOATS,), "float32", raw=True),
            )
