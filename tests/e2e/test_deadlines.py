"""Every wait has a deadline: a decode that hangs is killed and retried and then reported
naming its sample; a server that goes silent (SIGSTOP) is noticed through the doorbell's
heartbeat; a stream that is never accepted fails after ``timeout_s``. Real servers, real
worker processes, real signals."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
from collections.abc import Iterator
from concurrent import futures
from pathlib import Path
from typing import Any

import grpc
import pytest
import sqlalchemy as sa
from sqlalchemy.engine import Engine

import batchd
from batchd import errors
from batchd._proto.batchd.v1 import loader_pb2, loader_pb2_grpc
from batchd._transport.inline import InlineStream
from batchd_server import metrics

from chaos_harness import wait_until
from serving import RECORD_FLOATS, batchd_segments, install_decoders, record_dataset, serve

# The embedded catalog only: nothing here depends on the catalog's backend, and each test takes a
# while.
pytestmark = pytest.mark.backend("sqlite")

HANG_DECODER = """
import threading

import numpy as np

from batchd_server.pipelines.base import FieldSpec, Pipeline


class Hang(Pipeline):
    '''Raw float32 records, like Array((32,), raw=True); one whose first value is `stuck_at`,
    or whose sample id is `stuck_id`, blocks its worker for good, as a read from a stalled
    mount would.'''

    def __init__(self, stuck_at=None, stuck_id=None):
        self.stuck_at = stuck_at
        self.stuck_id = stuck_id

    def fields(self):
        return [FieldSpec("array", np.dtype("<f4"), (32,))]

    def decode_into(self, data, sample, row):
        values = np.frombuffer(data, "<f4")
        if values[0] == self.stuck_at or sample.sample_id == self.stuck_id:
            threading.Event().wait()
        row["array"][...] = values
"""
STUCK = 17
"""The record whose decode hangs (its first value is 17 * 1000)."""


def _task_timeouts() -> float:
    return metrics.REGISTRY.get_sample_value("batchd_worker_task_timeouts_total") or 0.0


def _sample_ids(engine: Engine) -> list[int]:
    with engine.connect() as conn:
        return list(conn.execute(sa.text("SELECT id FROM samples ORDER BY id")).scalars())


def test_a_hanging_decode_is_killed_retried_and_reported_naming_its_sample(
    engine: Engine, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A decode that never returns: its worker is killed at the task deadline and the batch
    redone; hanging again, the sample is a bad sample of kind timeout. on_error='raise' gets
    DataLoss naming it; on_error='skip' gets every other sample once; the pool is whole
    afterwards and serves a clean epoch. Heartbeats flow meanwhile, and are not news of a
    batch."""
    install_decoders(tmp_path / "site", HANG_DECODER, {"hang": "Hang"})
    monkeypatch.syspath_prepend(str(tmp_path / "site"))  # before the workers are spawned
    record_dataset(engine, tmp_path / "r", n=40)
    ids = _sample_ids(engine)
    url = engine.url.render_as_string(hide_password=False)
    timeouts_before = _task_timeouts()
    pipeline = batchd.Custom("hang", stuck_at=STUCK * 1000.0)
    # Heartbeats every 0.5 s: the client, waiting seconds for the stuck batch, reads them and
    # does not mistake a slow batch for a silent server.
    with serve(url, tmp_path, workers=2, task_timeout_s=3.0, heartbeat_interval_s=0.5) as srv:
        options: dict[str, Any] = {"dataset": "records", "batch_size": 8, "shuffle": False}
        with (
            batchd.Loader(srv.address, pipeline=pipeline, on_error="raise", **options) as loader,
            pytest.raises(errors.DataLoss) as raised,
        ):
            for _ in loader:
                pass
        message = str(raised.value)
        assert f"sample {ids[STUCK]} (shard-000.bin) failed: timeout" in message, message
        assert "hung past the server's task deadline" in message, message
        assert _task_timeouts() - timeouts_before == 2
        wait_until(lambda: srv.pool.alive == 2, "both workers to be alive again", 30)

        skip = {"on_error": "skip", "max_error_fraction": 0.1}
        with batchd.Loader(srv.address, pipeline=pipeline, **skip, **options) as loader:
            served, failed = [], []
            for batch in loader:
                served += batch["sample_id"].tolist()
                failed += loader.last_failed_sample_ids
        assert failed == [ids[STUCK]]
        assert sorted(served) == [i for i in ids if i != ids[STUCK]]

        spec = batchd.Array((RECORD_FLOATS,), "float32", raw=True)
        with batchd.Loader(srv.address, pipeline=spec, **options) as loader:
            assert sorted(i for b in loader for i in b["sample_id"].tolist()) == ids
        assert srv.pool.alive == 2 and srv.pool.crash_loop is None
    # serve() has checked that no worker process and no segment outlived the server.


def test_a_hang_in_a_mixed_sessions_second_source_names_that_sources_sample(
    engine: Engine, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """In a mix, workers report positions over the sources concatenated: the sample given up
    after two deadlines is the second source's record 17, not the first source's record 17
    in the same batch (one batch holds the whole epoch), and DataLoss names it."""
    install_decoders(tmp_path / "site", HANG_DECODER, {"hang": "Hang"})
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    record_dataset(engine, tmp_path / "a", n=20, name="a")
    record_dataset(engine, tmp_path / "b", n=30, name="b")
    with engine.connect() as conn:
        b_ids = conn.execute(
            sa.text(
                "SELECT s.id FROM samples s JOIN datasets d ON d.id = s.dataset_id "
                "WHERE d.name = 'b' ORDER BY s.id"
            )
        ).scalars()
        stuck_id = list(b_ids)[STUCK]
    url = engine.url.render_as_string(hide_password=False)
    timeouts_before = _task_timeouts()
    with serve(url, tmp_path, workers=2, task_timeout_s=3.0) as srv:
        with (
            batchd.Loader(
                srv.address,
                sources=batchd.Mix({"a": 2.0, "b": 3.0}),
                batch_size=50,
                shuffle=False,
                on_error="raise",
                pipeline=batchd.Custom("hang", stuck_id=stuck_id),
            ) as loader,
            pytest.raises(errors.DataLoss) as raised,
        ):
            for _ in loader:
                pass
        assert f"sample {stuck_id} (shard-000.bin) failed: timeout" in str(raised.value)
        assert _task_timeouts() - timeouts_before == 2
        wait_until(lambda: srv.pool.alive == 2, "both workers to be alive again", 30)


# -- a silent server ---------------------------------------------------------------------


def _start_server(url: str, sock: Path, log: Path, *extra: str) -> subprocess.Popen[bytes]:
    env = {**os.environ, "BATCHD_DATABASE_URL": url, "BATCHD_WORKERS": "1"}
    command = [sys.executable, "-m", "batchd_server.cli", "serve", "--listen", f"unix://{sock}"]
    with log.open("wb") as out:
        return subprocess.Popen([*command, *extra], env=env, stdout=out, stderr=out)


def _wait_ready(proc: subprocess.Popen[bytes], log: Path) -> str:
    """The server's shm instance id, once its log says it is ready."""
    found: list[str] = []

    def ready() -> bool:
        text = log.read_text()
        if proc.poll() is not None:
            pytest.fail(f"the server exited {proc.returncode} before it was ready:\n{text}")
        if "ready: serving on" in text:
            found.append(text.split("segments batchd-", 1)[1].split("-*", 1)[0])
        return bool(found)

    wait_until(ready, "the server to be ready", 120)
    return found[0]


def _state(pid: int) -> str:
    """The process's state letter (T: stopped); "" once it is gone."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return ""


@pytest.fixture
def stopped_server(engine: Engine, tmp_path: Path) -> Iterator[tuple[str, subprocess.Popen[bytes]]]:
    """A server process with a 0.5 s heartbeat; always continued and stopped at the end."""
    record_dataset(engine, tmp_path / "r", n=203)
    url = engine.url.render_as_string(hide_password=False)
    sock, log = tmp_path / "b.sock", tmp_path / "server.log"
    proc = _start_server(url, sock, log, "--heartbeat-interval-s", "0.5")
    try:
        instance = _wait_ready(proc, log)
        yield f"unix://{sock}", proc
    finally:
        proc.send_signal(signal.SIGCONT)
        wait_until(lambda: _state(proc.pid) != "T", "the server to run again", 30)
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(60)
        finally:
            proc.kill()
    assert proc.returncode == 0, log.read_text()
    assert not batchd_segments(instance), "the server left shared memory behind"


def test_a_stopped_server_is_noticed_by_its_missing_heartbeats(
    stopped_server: tuple[str, subprocess.Popen[bytes]],
) -> None:
    """SIGSTOP the server (its sockets stay open, nothing answers) while the loop waits for a
    batch on the doorbell: the missing heartbeats end the wait, the Loader tries to
    reconnect, and after reconnect_timeout_s it raises Unavailable naming the server."""
    address, proc = stopped_server
    got_first = threading.Event()
    go_on = threading.Event()
    outcome: list[BaseException | str] = []

    def train() -> None:
        try:
            with batchd.Loader(
                address,
                dataset="records",
                batch_size=4,
                prefetch=2,
                transport="shm",
                timeout_s=2.0,
                reconnect_timeout_s=3.0,
                pipeline=batchd.Array((RECORD_FLOATS,), "float32", raw=True),
            ) as loader:
                it = iter(loader)
                next(it)
                got_first.set()
                go_on.wait(60)
                for _ in it:
                    pass
            outcome.append("the epoch ended although the server was stopped")
        except BaseException as e:
            outcome.append(e)
        finally:
            got_first.set()

    loop = threading.Thread(target=train, daemon=True)
    loop.start()
    assert got_first.wait(120), "no first batch"
    proc.send_signal(signal.SIGSTOP)
    go_on.set()
    loop.join(120)
    assert not loop.is_alive(), "the loop still blocks on a stopped server"
    (error,) = outcome
    assert isinstance(error, errors.Unavailable), repr(error)
    assert address in str(error) and "heartbeat" in str(error), str(error)


# -- a stream that is never accepted -----------------------------------------------------


class _Mute(loader_pb2_grpc.LoaderServicer):
    """A server that takes StreamBatches calls and never says a word on them."""

    def StreamBatches(self, request_iterator: Any, context: grpc.ServicerContext) -> Any:
        done = threading.Event()
        context.add_callback(done.set)
        done.wait(60)
        return iter(())


def test_a_stream_never_accepted_fails_after_timeout_s(tmp_path: Path) -> None:
    """The first message of a stream has a deadline: a call the server never answers is
    cancelled after timeout_s with Unavailable saying so, not awaited forever."""
    server = grpc.server(futures.ThreadPoolExecutor(4))
    loader_pb2_grpc.add_LoaderServicer_to_server(_Mute(), server)
    address = f"unix://{tmp_path}/mute.sock"
    server.add_insecure_port(address)
    server.start()
    try:
        with grpc.insecure_channel(address) as channel:
            stream = InlineStream(
                loader_pb2_grpc.LoaderStub(channel),
                loader_pb2.StreamStart(session_id="s"),
                target=address,
                timeout_s=0.5,
            )
            with pytest.raises(errors.Unavailable, match=r"not accepted within 0\.5 s"):
                stream.receive()
            stream.cancel()
    finally:
        server.stop(None)
