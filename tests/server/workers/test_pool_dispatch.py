"""The worker pool's dispatcher under faults of one worker, with real worker processes, real
pipes and real shared memory: a worker that stopped reading while tasks of the largest batch
(65,536 positions, 512 KiB each, more than a socket buffer holds) wait for it; a dispatcher
that stops turning; replacements that cannot be spawned; a shutdown bounded by its grace."""

from __future__ import annotations

import errno
import logging
import multiprocessing as mp
import os
import signal
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from batchd_server.pipelines import build_pipeline
from batchd_server.sessions.options import slot_layout
from batchd_server.shm import ShmRegistry
from batchd_server.shm.arrays import pack_arrays
from batchd_server.workers import pool as pool_module
from batchd_server.workers.pool import WorkerPool
from batchd_server.workers.task import BatchResult, BatchTask, SessionSpec, SourceSpec

from chaos_harness import wait_until
from serving import child_pids, install_decoders

BATCH = 1 << 16
"""The largest batch a session may ask for: its task carries 512 KiB of positions."""
RECORDS = 4096
ARRAY = ("array", {"shape": [1], "dtype": "float32", "raw": True})

STUBBORN_DECODER = """
import pathlib
import signal
import threading

import numpy as np

from batchd_server.pipelines.base import FieldSpec, Pipeline


class Stubborn(Pipeline):
    '''Ignores SIGTERM and never finishes a sample, as a worker stuck in a decoder would;
    touches `marker` once it is stuck.'''

    def __init__(self, marker):
        self.marker = marker

    def fields(self):
        return [FieldSpec("array", np.dtype("<f4"), (1,))]

    def decode_into(self, data, sample, row):
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        pathlib.Path(self.marker).touch()
        threading.Event().wait()
"""


@pytest.fixture
def registry() -> Iterator[ShmRegistry]:
    with ShmRegistry(budget_bytes=256 << 20) as registry:
        yield registry


@contextmanager
def _session(
    registry: ShmRegistry, root: Path, slots: int, pipeline: tuple[str, dict[str, Any]] = ARRAY
) -> Iterator[SessionSpec]:
    """A session over ``RECORDS`` raw float32 records (record i holds i) in one shard, with
    ``slots`` slots of ``BATCH`` rows."""
    root.mkdir(parents=True, exist_ok=True)
    (root / "shard.bin").write_bytes(np.arange(RECORDS, dtype="<f4").tobytes())
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
    kind, options = pipeline
    decoder = build_pipeline(*ARRAY) if kind == "custom" else build_pipeline(kind, options)
    fields, slot_bytes = slot_layout(decoder.fields(), BATCH)
    catalog = pack_arrays(registry, arrays, purpose="dispatch test catalog")
    ring = registry.create("ring", 4096 + slots * slot_bytes, purpose="dispatch test ring")
    try:
        yield SessionSpec(
            session_id="s1",
            pipeline_kind=kind,
            pipeline_options=options,
            sources=(SourceSpec(catalog.name, str(root)),),
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


def _task(spec: SessionSpec, index: int) -> BatchTask:
    positions = np.random.default_rng(index).integers(0, RECORDS, BATCH, dtype=np.int64)
    return BatchTask(spec, 0, index, index, positions.tobytes())


def _within(seconds: float, what: str, call: Callable[[], Any]) -> Any:
    """``call()`` on a thread; its result, or a test failure if it takes over ``seconds``."""
    out: list[Any] = []
    thread = threading.Thread(target=lambda: out.append(call()), daemon=True)
    thread.start()
    thread.join(seconds)
    if thread.is_alive():
        pytest.fail(f"{what} blocked for more than {seconds:g} s")
    return out[0] if out else None


def _state(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return "gone"


def _stop(pid: int) -> None:
    os.kill(pid, signal.SIGSTOP)
    wait_until(lambda: _state(pid) == "T", f"worker {pid} to stop", 10)


def _resume(pid: int) -> None:
    if _state(pid) != "gone":
        os.kill(pid, signal.SIGCONT)


def _check(futures: list[Future[BatchResult]], timeout_s: float) -> None:
    for future in futures:
        result = future.result(timeout=timeout_s)
        assert result.rows == BATCH and not result.failures, result


@contextmanager
def _pool(*args: Any, **kwargs: Any) -> Iterator[WorkerPool]:
    before = child_pids()
    pool = WorkerPool(*args, **kwargs)
    pool.start()
    try:
        yield pool
    finally:
        for pid in pool.pids():
            _resume(pid)
        pool.stop(timeout_s=10)
    assert child_pids() <= before, "a worker outlived the pool"
    senders = [t.name for t in threading.enumerate() if t.name.startswith("batchd-send")]
    assert not senders, f"sender threads outlived the pool: {senders}"


def test_large_tasks_for_a_stopped_worker_hold_up_neither_the_other_worker_nor_submit(
    registry: ShmRegistry, tmp_path: Path
) -> None:
    """A worker stopped (SIGSTOP) with two 512 KiB tasks for it: the dispatcher keeps feeding
    the other worker, submit and outstanding() answer at once, the pool stays alive, and the
    stopped worker's tasks are done once it continues."""
    with (
        _pool(2, tasks_per_worker=2, task_timeout_s=600) as pool,
        _session(registry, tmp_path / "r", slots=12) as spec,
    ):
        stopped = pool.pids()[0]
        _stop(stopped)
        futures = _within(10, "submit", lambda: [pool.submit(_task(spec, k)) for k in range(12)])
        wait_until(lambda: sum(f.done() for f in futures) == 10, "the other worker's tasks", 120)
        assert _within(5, "outstanding()", pool.outstanding) == 2
        assert pool.dispatcher_alive and pool.alive == 2
        os.kill(stopped, signal.SIGCONT)
        _check(futures, 120)
        assert pool.restarts == 0


def test_the_deadline_of_a_task_on_a_stopped_worker_fires_and_it_is_redone_elsewhere(
    registry: ShmRegistry, tmp_path: Path
) -> None:
    """A stopped worker holding the largest tasks is killed at the task deadline, like a hung
    decode, and its tasks are done by the other worker and its replacement."""
    timeouts: list[float] = []
    with (
        _pool(2, task_timeout_s=2.0, on_timeout=lambda: timeouts.append(time.monotonic())) as pool,
        _session(registry, tmp_path / "r", slots=6) as spec,
    ):
        stopped = pool.pids()[0]
        _stop(stopped)
        futures = _within(10, "submit", lambda: [pool.submit(_task(spec, k)) for k in range(6)])
        _check(futures, 120)
        assert timeouts, "no deadline fired for the stopped worker"
        assert _state(stopped) == "gone" and stopped not in pool.pids()
        wait_until(lambda: pool.alive == 2, "the replacement", 60)


def test_a_dispatcher_that_stopped_turning_is_reported_not_alive_though_its_thread_runs(
    registry: ShmRegistry, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The dispatcher stuck in a call (here a result callback that waits) stops bumping its
    heartbeat: ``dispatcher_alive``, which health's liveness reads, turns False while the
    thread lives, and True again once it turns."""
    monkeypatch.setattr(pool_module, "DISPATCHER_STALL_S", 1.0)
    entered, release = threading.Event(), threading.Event()

    def on_result(*_: object) -> None:
        entered.set()
        release.wait(60)

    with _pool(1, on_result=on_result) as pool, _session(registry, tmp_path / "r", 1) as spec:
        assert pool.dispatcher_alive
        future = pool.submit(_task(spec, 0))
        assert entered.wait(60)
        wait_until(lambda: not pool.dispatcher_alive, "liveness to notice the stall", 30)
        release.set()
        _check([future], 60)
        wait_until(lambda: pool.dispatcher_alive, "liveness to recover", 30)


def test_replacements_that_cannot_be_spawned_are_retried_with_backoff_while_others_serve(
    registry: ShmRegistry,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """fork fails with EAGAIN for the first three replacements of a killed worker: the pool
    serves with the other worker meanwhile, retries with growing pauses (no hot loop in the
    log), and is whole again once a spawn works."""
    process_class = mp.get_context("spawn").Process
    real_start = process_class.start
    attempts: list[float] = []

    def start(process: Any) -> None:
        if process.name.startswith("batchd-worker"):
            attempts.append(time.monotonic())
            if len(attempts) <= 3:
                raise OSError(errno.EAGAIN, os.strerror(errno.EAGAIN))
        real_start(process)

    with _pool(2, task_timeout_s=60) as pool, _session(registry, tmp_path / "r", 8) as spec:
        monkeypatch.setattr(process_class, "start", start)
        caplog.set_level(logging.DEBUG, logger="batchd_server.workers")
        os.kill(pool.pids()[0], signal.SIGKILL)
        wait_until(lambda: len(attempts) >= 1, "the first replacement attempt", 30)
        _check([pool.submit(_task(spec, k)) for k in range(4)], 120)
        wait_until(lambda: pool.alive == 2, "a replacement that starts", 60)
        _check([pool.submit(_task(spec, k)) for k in range(4, 8)], 120)
        assert pool.dispatcher_alive and pool.crash_loop is None
    assert len(attempts) == 4
    gaps = np.diff(attempts)
    assert (np.diff(gaps) > 0).all(), f"the pauses between tries {gaps} do not grow"
    pool_records = [r for r in caplog.records if r.name.startswith("batchd_server.workers")]
    assert len(pool_records) < 20, [r.getMessage() for r in pool_records]
    assert any("EAGAIN" in r.getMessage() or "unavailable" in r.getMessage() for r in pool_records)


def test_stop_is_bounded_by_its_timeout_even_for_a_worker_that_ignores_sigterm(
    registry: ShmRegistry, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A worker stuck in a decoder that ignores SIGTERM: stop(timeout_s=2) asks, terminates
    and kills it within about those 2 s, not 2 s for each step, and leaves no process."""
    install_decoders(tmp_path / "site", STUBBORN_DECODER, {"stubborn": "Stubborn"})
    monkeypatch.syspath_prepend(str(tmp_path / "site"))  # before the workers are spawned
    before = child_pids()
    pool = WorkerPool(1, task_timeout_s=600)
    pool.start()
    marker = tmp_path / "stuck"
    stubborn = ("custom", {"name": "stubborn", "options": {"marker": str(marker)}})
    try:
        with _session(registry, tmp_path / "r", 1, stubborn) as spec:
            pool.submit(_task(spec, 0))
            wait_until(marker.exists, "the worker to be stuck in the decoder", 60)
            started = time.monotonic()
            pool.stop(timeout_s=2.0)
            took = time.monotonic() - started
    finally:
        pool.stop()
    assert took < 2.6, f"stop(timeout_s=2) took {took:.1f} s"
    assert child_pids() <= before, "a worker outlived the pool"


def test_the_pool_grows_and_shrinks_while_it_serves_and_loses_no_task(
    registry: ShmRegistry, tmp_path: Path
) -> None:
    """``resize`` (what ``--workers MIN..MAX`` drives): a new worker starts and takes tasks
    once ready; shrinking retires only a worker that holds no task, which exits and is
    reaped, while every submitted task completes once."""
    with (
        _pool(1, tasks_per_worker=1) as pool,
        _session(registry, tmp_path / "r", slots=16) as spec,
    ):
        first = pool.pids()
        pool.resize(2)
        wait_until(lambda: len(pool.pids()) == 2, "a second worker", 60)
        futures = [pool.submit(_task(spec, k)) for k in range(8)]
        _check(futures, 120)
        grown = pool.pids()
        assert set(first) < set(grown) and pool.size == 2
        pool.resize(1)
        futures = [pool.submit(_task(spec, k)) for k in range(8, 16)]
        wait_until(lambda: len(pool.pids()) == 1, "a worker to retire", 60)
        _check(futures, 120)
        (retired,) = set(grown) - set(pool.pids())
        wait_until(lambda: _state(retired) == "gone", f"retired worker {retired} reaped", 30)
        assert pool.alive == 1 and pool.restarts == 0
        with pytest.raises(ValueError, match="must be >= 1"):
            pool.resize(0)
