"""Sharing one server: the session limits hold under concurrent opens, one client cannot take
every session or the whole shm budget, and two sessions share the worker pool evenly.
Real server, real gRPC calls, real worker processes and shared memory."""

from __future__ import annotations

import logging
import threading
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import grpc
import pytest
from sqlalchemy.engine import Engine

import batchd
from batchd._proto.batchd.v1 import loader_pb2 as pb
from batchd._proto.batchd.v1 import loader_pb2_grpc
from batchd._wire.metadata import CLIENT_ID_KEY
from batchd_server.api import RunningServer
from batchd_server.metrics.admission import REFUSED

from serving import RECORD_FLOATS, image_dataset, record_dataset, serve

# A migrated Postgres catalog (once: the limits under test do not depend on it).
pytestmark = pytest.mark.backend("postgres")

_RECORDS = pb.Pipeline(array=pb.ArrayPipeline(shape=[RECORD_FLOATS], dtype="float32", raw=True))


@pytest.fixture
def url(engine: Engine, tmp_path: Path) -> str:
    record_dataset(engine, tmp_path / "r", n=203)
    return engine.url.render_as_string(hide_password=False)


def _stub(server: RunningServer) -> tuple[grpc.Channel, loader_pb2_grpc.LoaderStub]:
    channel = grpc.insecure_channel(server.address)
    return channel, loader_pb2_grpc.LoaderStub(channel)


def _open(
    stub: loader_pb2_grpc.LoaderStub, client: str, *, batch_size: int = 16, prefetch: int = 4
) -> pb.OpenSessionResponse:
    request = pb.OpenSessionRequest(
        dataset="records", batch_size=batch_size, prefetch=prefetch, pipeline=_RECORDS
    )
    reply: pb.OpenSessionResponse = stub.OpenSession(
        request, timeout=60, metadata=[(CLIENT_ID_KEY, client)]
    )
    return reply


def _close(stub: loader_pb2_grpc.LoaderStub, session_id: str, client: str) -> None:
    """CloseSession as ``client``, which opened the session (no one else may close it)."""
    stub.CloseSession(
        pb.CloseSessionRequest(session_id=session_id),
        timeout=60,
        metadata=[(CLIENT_ID_KEY, client)],
    )


def _open_together(
    stub: loader_pb2_grpc.LoaderStub, clients: list[str]
) -> tuple[list[tuple[str, str]], list[grpc.RpcError]]:
    """OpenSession for every client at once (released by one barrier): (session id, client)
    of those that opened, and the errors of those that did not."""
    barrier = threading.Barrier(len(clients))

    def one(client: str) -> tuple[str, str] | grpc.RpcError:
        barrier.wait(60)
        try:
            return _open(stub, client).session_id, client
        except grpc.RpcError as e:
            return e

    with ThreadPoolExecutor(len(clients)) as pool:
        results = list(pool.map(one, clients))
    opened = [r for r in results if isinstance(r, tuple)]
    return opened, [r for r in results if not isinstance(r, tuple)]


def test_concurrent_opens_at_the_limit_never_pass_it(url: str, tmp_path: Path) -> None:
    """32 OpenSession calls at once against max_sessions=4 open exactly 4, and 24 calls of
    one client against client_max_sessions=3 open exactly 3; the rest are RESOURCE_EXHAUSTED
    naming the limit."""
    before = _refused()
    with serve(url, tmp_path, max_sessions=4, client_max_sessions=3) as srv:
        channel, stub = _stub(srv)
        with channel:
            _close(stub, _open(stub, "warm-up").session_id, "warm-up")  # the split loads once
            opened, refused = _open_together(stub, [f"client-{i}" for i in range(32)])
            assert len(opened) == 4 and len(srv.sessions) == 4
            assert _refused("max_sessions", before) == 28
            assert {e.code() for e in refused} == {grpc.StatusCode.RESOURCE_EXHAUSTED}
            assert all("--max-sessions" in (e.details() or "") for e in refused)
            for session_id, client in opened:
                _close(stub, session_id, client)

            opened, refused = _open_together(stub, ["one-client"] * 24)
            assert len(opened) == 3 and len(srv.sessions) == 3
            assert srv.sessions.usage("unix one-client")[0] == 3
            assert {e.code() for e in refused} == {grpc.StatusCode.RESOURCE_EXHAUSTED}
            message = refused[0].details() or ""
            assert "'unix one-client' holds 3 sessions" in message
            assert "--client-max-sessions" in message and "BATCHD_CLIENT_MAX_SESSIONS" in message
            assert _refused("client_max_sessions", before) == 21
            for session_id, client in opened:
                _close(stub, session_id, client)
            assert srv.sessions.usage("unix one-client") == (0, 0)


class _OpenWhileOpening(logging.Handler):
    """When the first session says it opened (it is in the server's table, its OpenSession
    not yet answered), opens another, as a second client."""

    def __init__(self, stub: loader_pb2_grpc.LoaderStub) -> None:
        super().__init__(logging.INFO)
        self.stub = stub
        self.second: list[pb.OpenSessionResponse | grpc.RpcError] = []

    def handle(self, record: logging.LogRecord) -> bool:
        # Not under the handler's lock, as logging.Handler.handle would: the second open's
        # own line, logged on another thread, must not wait for the first's.
        self.emit(record)
        return True

    def emit(self, record: logging.LogRecord) -> None:
        if self.second or "opened for" not in record.getMessage():
            return
        self.second.append(grpc.RpcError())  # the second's own line must not open a third
        try:
            self.second[0] = _open(self.stub, "second")
        except grpc.RpcError as e:
            self.second[0] = e


def test_an_open_session_is_not_also_counted_as_opening(url: str, tmp_path: Path) -> None:
    """With max_sessions=2, a second client's open that arrives just as the first session
    joins the table (before its OpenSession returns) is let in: one session open, not two."""
    manager_log = logging.getLogger("batchd_server.sessions.manager")
    with serve(url, tmp_path, max_sessions=2) as srv:
        channel, stub = _stub(srv)
        hook, level = _OpenWhileOpening(stub), manager_log.level
        manager_log.addHandler(hook)
        manager_log.setLevel(logging.INFO)
        try:
            with channel:
                first = _open(stub, "first")
                assert len(hook.second) == 1
                second = hook.second[0]
                assert isinstance(second, pb.OpenSessionResponse), second
                assert len(srv.sessions) == 2
                _close(stub, first.session_id, "first")
                _close(stub, second.session_id, "second")
        finally:
            manager_log.removeHandler(hook)
            manager_log.setLevel(level)


def test_one_client_cannot_take_the_whole_shm_budget(url: str, tmp_path: Path) -> None:
    """A client's rings stop at its quota (half the budget by default) with an error naming
    the quota and how to raise it; another client still opens, and a closed session frees
    its share."""
    budget = 64 << 20
    before = _refused()
    with serve(url, tmp_path, shm_budget_bytes=budget) as srv:
        channel, stub = _stub(srv)
        with channel:
            hog: list[str] = []
            with pytest.raises(grpc.RpcError) as refused:
                while len(hog) < 100:  # 8 slots of 64 KiB: about 0.5 MiB a ring
                    hog.append(_open(stub, "hog", batch_size=512, prefetch=6).session_id)
            assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert _refused("client_shm_quota", before) == 1
            message = refused.value.details() or ""
            assert "client 'unix hog' holds" in message and "quota of 32.0 MiB" in message
            assert "--client-shm-quota" in message and "BATCHD_CLIENT_SHM_QUOTA" in message
            sessions, ring_bytes = srv.sessions.usage("unix hog")
            assert sessions == len(hog) > 1
            assert budget // 2 - ring_bytes * 2 // sessions < ring_bytes <= budget // 2
            other = _open(stub, "other", batch_size=512, prefetch=6).session_id
            _close(stub, hog.pop(), "hog")
            hog.append(_open(stub, "hog", batch_size=512, prefetch=6).session_id)
            for session_id in hog:
                _close(stub, session_id, "hog")
            _close(stub, other, "other")
            assert srv.sessions.usage("unix hog") == (0, 0)


def _refused(limit: str = "", before: dict[str, float] | None = None) -> Any:
    """``batchd_refused_total`` by limit now, or the refusals of ``limit`` since ``before``."""
    now = {k: v for k, v in _refused_samples()}
    if before is None:
        return now
    return now.get(limit, 0.0) - before.get(limit, 0.0)


def _refused_samples() -> list[tuple[str, float]]:
    return [
        (sample.labels["limit"], sample.value)
        for family in REFUSED.collect()
        for sample in family.samples
        if sample.name.endswith("_total")
    ]


def _fair_windows(order: list[str], window: int = 50) -> float:
    """The smallest share either session gets over any ``window`` consecutive dispatches."""
    worst = 1.0
    for start in range(len(order) - window + 1):
        counts = Counter(order[start : start + window])
        worst = min(worst, *(counts[s] / window for s in set(order)))
    return worst


def test_two_sessions_with_equal_prefetch_share_the_workers_evenly(
    engine: Engine, tmp_path: Path
) -> None:
    """Two image sessions with equal prefetch on one worker, the second starting once the
    first has filled its ring: while both have batches to decode, each gets at least 40% of
    any 50 consecutive batches the pool hands out (read from the pool's dispatch log, not
    from timing)."""
    image_dataset(engine, tmp_path / "images", n=150)
    url = engine.url.render_as_string(hide_password=False)
    with serve(url, tmp_path, workers=1) as srv:
        first_batch = threading.Event()
        counts: dict[str, int] = {}

        def read(name: str) -> None:
            with batchd.Loader(
                srv.address,
                dataset="images",
                batch_size=1,
                prefetch=4,
                seed=7,
                pipeline=batchd.Image(size=96),
            ) as loader:
                n = 0
                for _ in loader:
                    n += 1
                    first_batch.set()
                counts[name] = n

        first = threading.Thread(target=read, args=("first",))
        first.start()
        assert first_batch.wait(120), "the first session served nothing"
        second = threading.Thread(target=read, args=("second",))
        second.start()
        first.join(300)
        second.join(300)
        dispatched = srv.pool.dispatched()
    assert counts["first"] == counts["second"] > 100
    order = [session for session, _ in dispatched]
    sessions = list(dict.fromkeys(order))
    assert len(sessions) == 2
    # While both have work: from the second's first batch to whichever finishes first.
    begin = order.index(sessions[1])
    end = min(len(order) - order[::-1].index(s) for s in sessions)
    both = order[begin:end]
    assert len(both) >= 100, f"the sessions overlapped for only {len(both)} batches"
    worst = _fair_windows(both)
    assert worst >= 0.4, f"a session got {worst:.0%} of some 50 consecutive batches"
