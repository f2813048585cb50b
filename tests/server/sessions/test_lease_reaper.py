"""The lease reaper closes what expired, and only that: a session whose client starts a stream
after the reaper looked at it stays open, and a session closing slowly holds up no other.
A real session manager, catalog (SQLite) and shared memory; the worker pool is the test's,
so that a task runs exactly as long as the test says."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from pathlib import Path
from types import TracebackType

import pytest
from sqlalchemy.engine import Engine

from batchd_server.catalog_cache import CatalogCache
from batchd_server.planning.sampling import SamplerOptions
from batchd_server.service_settings import SessionSettings
from batchd_server.sessions import Session, SessionManager, SessionOptions
from batchd_server.shm import ShmRegistry
from batchd_server.workers.task import BatchResult, BatchTask

from chaos_harness import wait_until
from serving import RECORD_FLOATS, record_dataset

# The embedded catalog: what is under test does not depend on the backend.
pytestmark = pytest.mark.backend("sqlite")

LEASE_S = 0.5


class HeldPool:
    """Takes tasks and never finishes one by itself: the test says when."""

    def __init__(self) -> None:
        self.futures: list[Future[BatchResult]] = []

    def submit(self, task: BatchTask) -> Future[BatchResult]:
        future: Future[BatchResult] = Future()
        self.futures.append(future)
        return future

    def forget_session(self, session_id: str) -> None:
        pass

    def finish_all(self) -> None:
        for future in self.futures:
            if not future.done():
                future.set_exception(RuntimeError("the test is over"))


class LookThenClose:
    """The manager's lock, which runs ``between`` when the reaper thread takes it again right
    after a look that could see ``session`` expired: the moment between the reaper's look at
    the sessions and its closing of one, when a reconnecting client can start a stream."""

    def __init__(self, session: Session, between: Callable[[], None]) -> None:
        self._lock = threading.Lock()
        self._session = session
        self._between = between
        self._looked = False
        self.fired = False

    def _reaper_holds(self) -> bool:
        return threading.current_thread().name == "batchd-lease" and not self.fired

    def __enter__(self) -> None:
        if self._reaper_holds() and self._looked:
            self.fired = True
            self._between()
        self._lock.acquire()

    def __exit__(
        self,
        kind: type[BaseException] | None,
        value: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        if self._reaper_holds():
            self._looked = time.monotonic() - self._session.last_used > 60
        self._lock.release()


def test_a_stream_started_after_the_reapers_look_keeps_its_session_and_blocks_no_other(
    engine: Engine, tmp_path: Path
) -> None:
    """Sessions a and b are both long idle. Right after the reaper looked, a's client starts
    a stream whose tasks the workers are running: a stays open with its stream live, and b
    is closed at once (not after a wait on a's workers)."""
    record_dataset(engine, tmp_path / "r", n=40)
    pool = HeldPool()
    options = SessionOptions(
        dataset="records",
        version=None,
        split="train",
        sampler=SamplerOptions(batch_size=4, shuffle=False),
        pipeline_kind="array",
        pipeline_options={"shape": (RECORD_FLOATS,), "dtype": "float32", "raw": True},
    )
    with ShmRegistry(budget_bytes=64 << 20) as registry:
        catalog = CatalogCache(engine, registry)
        manager = SessionManager(
            catalog=catalog,
            pool=pool,  # type: ignore[arg-type]
            registry=registry,
            limits=SessionSettings(lease_timeout_s=LEASE_S, max_sessions=8),
            record_errors=lambda rows: None,
        )
        try:
            a, b = manager.open(options, "client"), manager.open(options, "client")

            def reconnecting_client() -> None:
                """a's client comes back: a stream whose first tasks workers have taken."""
                stream = a.start_stream(0, 0)
                a.ack(stream, [])
                for future in pool.futures:
                    assert future.set_running_or_notify_cancel()

            hook = LookThenClose(a, reconnecting_client)
            manager._lock = hook  # type: ignore[assignment]
            b.last_used = a.last_used = time.monotonic() - 3600
            wait_until(lambda: b.closed, "the reaper to close b", 20)
            assert hook.fired, "the client came back between the look and the close"
            assert pool.futures, "a's client started its stream"
            assert not a.closed and a.streaming, "a's new stream was cut by the reaper"
            assert manager.get(a.id, "client") is a and len(manager) == 1
        finally:
            pool.finish_all()
            manager.close_all(timeout_s=5)
            catalog.close()
