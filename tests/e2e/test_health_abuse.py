"""The calls that need no token cannot be turned against the server: Health ``Watch``
streams take no place a trainer needs, are capped per peer address and only watch the names
the server knows (1,000 of 64 KiB leave its memory flat), reflection is off unless the
operator turns it on, and a health reason tells nobody where the catalog lives. Real
servers, real gRPC calls, a real ``batchd-server serve`` process for the memory."""

from __future__ import annotations

import contextlib
import logging
import os
import subprocess
import sys
from collections.abc import Iterator
from concurrent import futures
from pathlib import Path
from typing import Any

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import (
    ProtoReflectionDescriptorDatabase,
)
from sqlalchemy.engine import Engine

import batchd
from batchd_server.api import RunningServer, security
from batchd_server.api.admission import OPEN_CALLS_PER_PEER
from batchd_server.api.health import REASON_KEY, HealthService
from batchd_server.errors import Unavailable
from batchd_server.health import HealthMonitor
from batchd_server.shm.space import ShmSpace

from chaos_harness import wait_until
from serving import RECORD_FLOATS, record_dataset, serve, tcp_server

# The embedded catalog: what is under test does not depend on the backend.
pytestmark = pytest.mark.backend("sqlite")

TOKEN = "health-abuse-token-0123456789"
_N = 64
_SERVE = [sys.executable, "-m", "batchd_server.cli", "serve"]


@contextlib.contextmanager
def watches(address: str, count: int, service: str = "") -> Iterator[list[grpc.StatusCode | None]]:
    """``count`` Health Watch streams without a token, held open for the block. Yields, per
    stream, None when the server answered it (and it stays open), else the code it ended
    with; each stream's first answer is in before the block starts."""
    with grpc.insecure_channel(address) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        calls = [stub.Watch(health_pb2.HealthCheckRequest(service=service)) for _ in range(count)]
        outcomes: list[grpc.StatusCode | None] = []
        try:
            for call in calls:
                try:
                    next(call)
                    outcomes.append(None)
                except grpc.RpcError as e:
                    outcomes.append(e.code())  # type: ignore[attr-defined]
            yield outcomes
        finally:
            for call in calls:
                call.cancel()


def _epoch(server: RunningServer, transport: str, **options: Any) -> list[int]:
    pipeline = batchd.Array((RECORD_FLOATS,), "float32", raw=True)
    with batchd.Loader(
        server.address,
        dataset="records",
        batch_size=8,
        pipeline=pipeline,
        transport=transport,
        **options,
    ) as loader:
        return [i for batch in loader for i in batch["sample_id"].tolist()]


def test_twenty_tokenless_watch_streams_leave_an_authenticated_epoch_its_places(
    engine: Engine, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A token server of 16 calls (14 places): 20 Watch streams without the token are
    refused and hold nothing, and a client with the token opens its session and reads every
    batch, inline and over shm, while they are held."""
    record_dataset(engine, tmp_path / "r", n=_N)
    token_file = tmp_path / "token"
    token_file.write_text(TOKEN)
    token_file.chmod(0o600)
    monkeypatch.delenv("BATCHD_AUTH_TOKEN", raising=False)
    with (
        tcp_server(engine, auth_token_file=token_file, max_concurrent_rpcs=16) as server,
        watches(server.address, 20) as outcomes,
    ):
        # Every stream is refused and none is answered. Most are UNAUTHENTICATED; on a loaded
        # machine gRPC itself may refuse a few with RESOURCE_EXHAUSTED while more than 16
        # refusals are in flight at once (its maximum_concurrent_rpcs), which holds nothing
        # either.
        refused = {grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.RESOURCE_EXHAUSTED}
        assert len(outcomes) == 20 and set(outcomes) <= refused, outcomes
        assert grpc.StatusCode.UNAUTHENTICATED in outcomes
        assert server.admission.calls == 0
        for transport in ("inline", "shm"):
            ids = _epoch(server, transport, auth_token=TOKEN)
            assert sorted(ids) == list(range(1, _N + 1)), transport


def test_watch_streams_of_one_peer_stop_at_its_cap_and_take_no_place(
    engine: Engine, tmp_path: Path
) -> None:
    """No token (a unix socket): of 20 Watch streams from one peer, OPEN_CALLS_PER_PEER are
    answered and stay open, the rest are RESOURCE_EXHAUSTED; none takes one of the 14
    places, and a Loader reads its epoch beside them. A name the server does not serve is
    NOT_FOUND, not watched."""
    record_dataset(engine, tmp_path / "r", n=_N)
    url = engine.url.render_as_string(hide_password=False)
    with serve(url, tmp_path, workers=1, max_concurrent_rpcs=16) as server:
        with watches(server.address, 1, "no.such.Service") as unknown:
            assert unknown == [grpc.StatusCode.NOT_FOUND]
        with watches(server.address, 20) as outcomes:
            assert outcomes.count(None) == OPEN_CALLS_PER_PEER, outcomes
            refused = [o for o in outcomes if o is not None]
            assert set(refused) == {grpc.StatusCode.RESOURCE_EXHAUSTED}
            assert server.admission.calls == 0
            ids = _epoch(server, "inline")
            assert sorted(ids) == list(range(1, _N + 1))
        # The streams' places come back when they end: a new one is answered.
        wait_until(lambda: _watch_answered(server.address), "a Watch place to come back", 30)


def _watch_answered(address: str) -> bool:
    with watches(address, 1) as outcomes:
        return outcomes == [None]


def _rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError(f"no VmRSS in /proc/{pid}/status")


def _watch_once(stub: health_pb2_grpc.HealthStub, service: str) -> None:
    call = stub.Watch(health_pb2.HealthCheckRequest(service=service), timeout=30)
    try:
        next(call)
    except grpc.RpcError as e:
        assert e.code() == grpc.StatusCode.NOT_FOUND, e  # type: ignore[attr-defined]
    finally:
        call.cancel()


def test_a_thousand_watch_calls_with_64_kib_names_leave_the_servers_memory_flat(
    sqlite_engine: Engine, tmp_path: Path
) -> None:
    """``batchd-server serve``: after a warm-up, 1,000 Watch calls, each for a different
    64 KiB service name, grow the server's resident memory by less than 16 MiB (a server
    that remembers every name grows by 64 MiB)."""
    sock = tmp_path / "grpc.sock"
    env = {
        **os.environ,
        "BATCHD_DATABASE_URL": sqlite_engine.url.render_as_string(hide_password=False),
        "BATCHD_LISTEN": f"unix://{sock}",
        "BATCHD_WORKERS": "1",
    }
    proc = subprocess.Popen(_SERVE, env=env, stderr=subprocess.PIPE, text=True)
    try:
        assert proc.stderr is not None
        for line in proc.stderr:
            if "ready: serving on" in line:
                break
        else:
            pytest.fail(f"serve exited {proc.wait()} without a ready line")
        with grpc.insecure_channel(f"unix://{sock}") as channel:
            stub = health_pb2_grpc.HealthStub(channel)
            for i in range(100):  # gRPC's own buffers and arenas reach their size
                _watch_once(stub, f"warm-{i:05d}".ljust(64 << 10, "x"))
            before = _rss_bytes(proc.pid)
            for i in range(1000):
                _watch_once(stub, f"name-{i:05d}".ljust(64 << 10, "x"))
            grown = _rss_bytes(proc.pid) - before
        assert grown < 16 << 20, f"the server grew by {grown / (1 << 20):.1f} MiB"
    finally:
        proc.terminate()
        proc.wait(60)
        if proc.stderr is not None:
            proc.stderr.close()


def _reflected(address: str, **metadata: str) -> set[str] | grpc.StatusCode:
    """The services reflection lists at ``address`` (calls carry ``metadata``), or the code
    it is refused with."""
    with grpc.insecure_channel(address) as plain:
        channel = grpc.intercept_channel(plain, _Metadata(tuple(metadata.items())))
        try:
            return set(ProtoReflectionDescriptorDatabase(channel).get_services())
        except grpc.RpcError as e:
            return e.code()  # type: ignore[attr-defined,no-any-return]


class _Metadata(grpc.UnaryUnaryClientInterceptor, grpc.StreamStreamClientInterceptor):
    """Adds fixed metadata to every call of a channel."""

    def __init__(self, metadata: tuple[tuple[str, str], ...]) -> None:
        self._metadata = metadata

    def _details(self, details: Any) -> Any:
        return details._replace(metadata=(*(details.metadata or ()), *self._metadata))

    def intercept_unary_unary(self, continuation: Any, details: Any, request: Any) -> Any:
        return continuation(self._details(details), request)

    def intercept_stream_stream(self, continuation: Any, details: Any, requests: Any) -> Any:
        return continuation(self._details(details), requests)


def test_reflection_is_off_unless_the_operator_turns_it_on_and_then_needs_the_token(
    engine: Engine, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """By default reflection is UNIMPLEMENTED; turned on, a token server refuses it without
    the token and lists its services with it."""
    token_file = tmp_path / "token"
    token_file.write_text(TOKEN)
    token_file.chmod(0o600)
    with tcp_server(engine) as server:
        assert _reflected(server.address) == grpc.StatusCode.UNIMPLEMENTED
    monkeypatch.setattr(security, "SERVE_REFLECTION", True)
    with tcp_server(engine, auth_token_file=token_file) as server:
        assert _reflected(server.address) == grpc.StatusCode.UNAUTHENTICATED
        services = _reflected(server.address, authorization=f"Bearer {TOKEN}")
        assert isinstance(services, set)
        assert {"batchd.v1.Loader", "grpc.health.v1.Health"} <= services


def test_the_health_reason_tells_a_caller_without_a_token_nothing_of_the_catalogs_whereabouts(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A catalog probe failing with its URL's user and host: NOT_SERVING over gRPC with a
    reason that names the catalog but neither the user nor the host; the server's log has
    both."""
    leaky = (
        "the catalog at postgresql://batchd_owner@db-7.internal.example:5432/catalog failed "
        'a trivial query: FATAL: password authentication failed for user "batchd_owner"'
    )

    def probe() -> None:
        raise Unavailable(leaky)

    caplog.set_level(logging.INFO)
    service = HealthService()
    monitor = HealthMonitor(
        space=lambda: ShmSpace(path=tmp_path, size_bytes=1 << 40, free_bytes=1 << 40),
        min_free_shm_bytes=0,
        catalog_probe=probe,
        catalog_timeout_s=5.0,
        workers_wanted=lambda: 0,
        workers_alive=lambda: 0,
        dispatcher_alive=lambda: True,
        interval_s=60.0,
        on_change=service.publish,
    )
    service.attach(monitor)
    monitor.start()
    with futures.ThreadPoolExecutor(2) as pool:
        server = grpc.server(pool)
        health_pb2_grpc.add_HealthServicer_to_server(service, server)
        port = server.add_insecure_port("127.0.0.1:0")
        server.start()
        try:
            with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
                stub = health_pb2_grpc.HealthStub(channel)
                response, call = stub.Check.with_call(health_pb2.HealthCheckRequest(), timeout=10)
        finally:
            server.stop(None)
            monitor.stop()
    assert response.status == health_pb2.HealthCheckResponse.NOT_SERVING
    reason = dict(call.trailing_metadata() or ())[REASON_KEY].decode()
    assert "catalog" in reason
    for secret in ("batchd_owner", "db-7.internal.example", "5432"):
        assert secret not in reason, reason
    logged = "\n".join(r.getMessage() for r in caplog.records)
    assert "batchd_owner" in logged and "db-7.internal.example" in logged
