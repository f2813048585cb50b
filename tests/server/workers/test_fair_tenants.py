"""The worker pool serves clients in turn, then each client's sessions in turn
(``workers/fair_queue.py``): a tenant that opens 64 sessions gets no more of the workers than
another tenant's one session, while both have work waiting. With the real pool, real worker
processes and a real ring in shared memory; the order is the pool's own dispatch log."""

from __future__ import annotations

import dataclasses
import os
import signal
from collections import Counter
from collections.abc import Iterator
from concurrent.futures import Future
from pathlib import Path

import numpy as np
import pytest

from batchd_server.pipelines import build_pipeline
from batchd_server.sessions.options import slot_layout
from batchd_server.shm import ShmRegistry
from batchd_server.shm.arrays import pack_arrays
from batchd_server.workers.fair_queue import FairQueue
from batchd_server.workers.pool import WorkerPool
from batchd_server.workers.task import BatchResult, BatchTask, SessionSpec, SourceSpec

from chaos_harness import wait_until

RECORDS = 64
BATCH = 4
SLOTS = 4


def test_the_queue_serves_clients_in_turn_then_their_sessions_in_turn() -> None:
    """Client A's three sessions and client B's one: A and B alternate, and A's turns go to
    its sessions in turn; an item put back goes first, with its session and client."""
    queue: FairQueue[tuple[str, str, int]] = FairQueue(lambda i: i[1], tenant=lambda i: i[0])
    for i in range(2):
        for session in ("a1", "a2", "a3"):
            queue.append(("A", session, i))
    for i in range(6):
        queue.append(("B", "b1", i))
    got = [queue.popleft()[1] for _ in range(8)]
    assert got == ["a1", "b1", "a2", "b1", "a3", "b1", "a1", "b1"]
    queue.appendleft(("A", "a1", 1))  # redone after its worker died
    assert queue.popleft() == ("A", "a1", 1)
    assert [queue.popleft()[1] for _ in range(len(queue))] == ["b1", "a2", "b1", "a3"]


@pytest.fixture
def registry() -> Iterator[ShmRegistry]:
    with ShmRegistry(budget_bytes=64 << 20) as registry:
        yield registry


@pytest.fixture
def spec(registry: ShmRegistry, tmp_path: Path) -> Iterator[SessionSpec]:
    """A session over ``RECORDS`` raw float32 records, with a ring of ``SLOTS`` slots."""
    (tmp_path / "shard.bin").write_bytes(np.arange(RECORDS, dtype="<f4").tobytes())
    path = b"shard.bin"
    arrays: dict[str, np.ndarray] = {
        "ids": np.arange(RECORDS, dtype=np.int64),
        "labels": np.zeros(RECORDS, np.int64),
        "lengths": np.full(RECORDS, -1, np.int32),
        "byte_offsets": np.arange(RECORDS, dtype=np.int64) * 4,
        "byte_lengths": np.full(RECORDS, 4, np.int64),
        "path_bytes": np.frombuffer(path * RECORDS, np.uint8),
        "path_offsets": np.arange(RECORDS + 1, dtype=np.int64) * len(path),
    }
    kind, options = "array", {"shape": [1], "dtype": "float32", "raw": True}
    fields, slot_bytes = slot_layout(build_pipeline(kind, options).fields(), BATCH)
    catalog = pack_arrays(registry, arrays, purpose="fairness test catalog")
    ring = registry.create("ring", 4096 + SLOTS * slot_bytes, purpose="fairness test ring")
    try:
        yield SessionSpec(
            session_id="s",
            pipeline_kind=kind,
            pipeline_options=options,
            sources=(SourceSpec(catalog.name, str(tmp_path)),),
            ring_segment=ring.name,
            header_bytes=4096,
            slot_bytes=slot_bytes,
            fields=fields,
            batch_size=BATCH,
            seed=0,
            on_error="raise",
            shm_dir=str(registry.shm_dir),
        )
    finally:
        registry.release(ring)
        registry.release(catalog)


def _state(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return "gone"


def test_a_tenant_with_64_sessions_gets_the_same_share_as_one_with_one(
    spec: SessionSpec,
) -> None:
    """One worker, stopped while tenant A's 64 sessions queue 2 batches each and tenant B's
    one session queues 64: once it runs on, A and B get every other task (per session,
    B would get one task in 65)."""
    pool = WorkerPool(1, tasks_per_worker=1, task_timeout_s=600)
    pool.start()
    (pid,) = pool.pids()
    try:
        os.kill(pid, signal.SIGSTOP)
        wait_until(lambda: _state(pid) == "T", "the worker to stop", 10)
        futures: list[Future[BatchResult]] = []
        a = [dataclasses.replace(spec, session_id=f"a{i}", client="A") for i in range(64)]
        b = dataclasses.replace(spec, session_id="b", client="B")
        for k in range(2):
            futures += [pool.submit(_task(s, k)) for s in a]
        futures += [pool.submit(_task(b, k)) for k in range(64)]
        os.kill(pid, signal.SIGCONT)
        for future in futures:
            assert future.result(timeout=120).rows == BATCH
        order = ["B" if session == "b" else "A" for session, _ in pool.dispatched()]
    finally:
        if _state(pid) not in ("gone", ""):
            os.kill(pid, signal.SIGCONT)
        pool.stop(timeout_s=10)
    assert len(order) == 192
    # The first task went out before B's were queued; after it, both have work for 126 tasks.
    both = order[1:127]
    counts = Counter(both)
    assert counts["B"] == counts["A"] == 63, counts


def _task(spec: SessionSpec, index: int) -> BatchTask:
    positions = np.random.default_rng(index).integers(0, RECORDS, BATCH, dtype=np.int64)
    return BatchTask(spec, 0, index, index % SLOTS, positions.tobytes())
