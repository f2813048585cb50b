"""Striping one Loader over several replicas: batch k from replica k mod R, the
loop sees one server's epoch in order, and a replica killed mid-epoch loses and repeats no
batch. Real ``batchd-server serve`` processes, one decode worker each."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import textwrap
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import pytest
from prometheus_client.parser import text_string_to_metric_families

import batchd
from batchd._proto.batchd.v1 import loader_pb2, loader_pb2_grpc
from batchd_server.api import RunningServer
from batchd_server.catalog import migrate
from batchd_server.catalog.db import make_engine
from batchd_server.shm import ShmRegistry

import shmns
from serving import RECORD_FLOATS, record_dataset

SERVE = [sys.executable, "-m", "batchd_server.cli", "serve", "--workers", "1"]
BATCHES = 30  # 300 records, 10 a batch


@pytest.fixture
def records_url(pg_url: str, tmp_path: Path) -> str:
    """A Postgres catalog holding 300 records (``serving.record_dataset``)."""
    engine = make_engine(pg_url)
    try:
        migrate.upgrade(engine)
        record_dataset(engine, tmp_path / "r", n=300)
    finally:
        engine.dispose()
    return pg_url


@dataclass
class Replica:
    proc: subprocess.Popen[bytes]
    target: str
    metrics: str
    log: Path

    def batches_served(self) -> float:
        """``batchd_batches_total`` of the records dataset, from the replica's /metrics."""
        with urllib.request.urlopen(f"http://{self.metrics}/metrics", timeout=30) as response:
            text = response.read().decode()
        return sum(
            s.value
            for family in text_string_to_metric_families(text)
            for s in family.samples
            if s.name == "batchd_batches_total" and s.labels.get("dataset") == "records"
        )


def _free_port(*hosts: str) -> int:
    """A TCP port free on every one of ``hosts`` (loopback addresses)."""
    for _ in range(50):
        with socket.socket() as probe:
            probe.bind((hosts[0], 0))
            port = int(probe.getsockname()[1])
        try:
            with contextlib.ExitStack() as stack:
                for host in hosts[1:]:
                    s = stack.enter_context(socket.socket())
                    s.bind((host, port))
            return port
        except OSError:
            continue
    raise AssertionError(f"no port free on all of {hosts}")


@contextlib.contextmanager
def replicas(url: str, tmp_path: Path, listens: list[str]) -> Iterator[list[Replica]]:
    """One ``batchd-server serve`` process per address of ``listens``, ready; stopped (and
    checked to exit 0, unless killed) afterwards."""
    started: list[Replica] = []
    env = {**os.environ, "BATCHD_DATABASE_URL": url}
    try:
        for i, listen in enumerate(listens):
            metrics = f"127.0.0.1:{_free_port('127.0.0.1')}"
            log = tmp_path / f"replica{i}.log"
            with log.open("wb") as out:
                proc = subprocess.Popen(
                    [*SERVE, "--listen", listen, "--metrics-listen", metrics],
                    env=env,
                    stdout=out,
                    stderr=out,
                )
            started.append(Replica(proc, listen, metrics, log))
        deadline = time.monotonic() + 120
        for replica in started:
            while "ready: serving on" not in replica.log.read_text():
                if replica.proc.poll() is not None or time.monotonic() > deadline:
                    pytest.fail(f"{replica.target} did not start:\n{replica.log.read_text()}")
                time.sleep(0.05)
        yield started
    finally:
        for replica in started:
            if replica.proc.poll() is None:
                replica.proc.send_signal(signal.SIGTERM)
        for replica in started:
            try:
                code = replica.proc.wait(60)
            except subprocess.TimeoutExpired:
                replica.proc.kill()
                code = replica.proc.wait(30)
            assert code in (0, -signal.SIGKILL), replica.log.read_text()
        if any(r.proc.returncode == -signal.SIGKILL for r in started):
            # A killed server leaves its segments; a new registry sweeps them, as a
            # restarted server would.
            ShmRegistry(budget_bytes=0).close()


def _loader(target: str | list[str], transport: str = "auto", **kwargs: Any) -> batchd.Loader:
    return batchd.Loader(
        target,
        dataset="records",
        batch_size=10,
        seed=5,
        prefetch=3,
        transport=transport,
        device="cpu",
        pipeline=batchd.Array((RECORD_FLOATS,), "float32", raw=True),
        reconnect_timeout_s=20,
        **kwargs,
    )


def _epoch(loader: batchd.Loader) -> list[list[int]]:
    return [b["sample_id"].tolist() for b in loader]


@pytest.mark.parametrize("transport", ["shm", "inline"])
def test_a_replica_killed_mid_epoch_loses_and_repeats_no_batch(
    records_url: str, tmp_path: Path, transport: str
) -> None:
    """Three replicas; kill -9 one after 6 batches: the epoch is still exactly a single
    server's, in order; the state saved after 15 batches resumes exactly on a new striped
    Loader (whose dead replica is left out); the next epoch runs on the two left."""
    url = records_url
    socks = [f"unix://{tmp_path}/r{i}.sock" for i in range(3)]
    with replicas(url, tmp_path, socks) as servers:
        with _loader(socks[0], transport) as single:
            want = _epoch(single)
            want_next = _epoch(single)
        assert len(want) == BATCHES
        got: list[list[int]] = []
        with _loader(socks, transport) as loader:
            assert loader.transport == transport
            for i, batch in enumerate(loader):
                got.append(batch["sample_id"].tolist())
                if i == 5:
                    servers[1].proc.kill()
                    servers[1].proc.wait(30)
                if i == 14:
                    break
            state = loader.state_dict()
            got += _epoch(loader)
            assert got == want, "a batch was lost, repeated or out of order"
            assert loader._replicas.live_targets == [socks[0], socks[2]]
            assert _epoch(loader) == want_next
        assert state["next_batch"] == 15 and state["consumed"] == 150
        with _loader(socks, transport) as resumed:
            resumed.load_state_dict(state)
            assert _epoch(resumed) == want[15:]


def test_a_dns_name_of_three_addresses_stripes_every_third_batch_to_each(
    records_url: str, tmp_path: Path
) -> None:
    """``dns:///batchd-pool:PORT`` whose name has three A records (in /etc/hosts, in a
    private mount namespace) stripes over all three: each replica serves exactly a third of
    the epoch, and the loop gets the single server's epoch in order."""
    reason = shmns.unavailable_reason()
    if reason is not None:
        pytest.skip(f"cannot bind-mount a private /etc/hosts: {reason}")
    url = records_url
    hosts = ["127.0.0.1", "127.0.0.2", "127.0.0.3"]
    port = _free_port(*hosts)
    with replicas(url, tmp_path, [f"{h}:{port}" for h in hosts]) as servers:
        with _loader(f"127.0.0.1:{port}") as single:
            want = _epoch(single)
        before = [s.batches_served() for s in servers]
        hosts_file = tmp_path / "hosts"
        hosts_file.write_text("".join(f"{h} batchd-pool\n" for h in ["127.0.0.1", *hosts]))
        script = textwrap.dedent(f"""
            import json, sys
            sys.path[:0] = {sys.path!r}
            from test_striping import _epoch, _loader
            with _loader("dns:///batchd-pool:{port}") as loader:
                print(json.dumps([loader._replicas.live_targets, _epoch(loader)]))
        """)
        wrapper = 'mount --bind "$1" /etc/hosts || exit 97; shift; exec "$@"'
        unshare = ["unshare", "--mount", "--propagation", "private", "sh", "-c", wrapper, "sh"]
        child = subprocess.run(
            [*unshare, str(hosts_file), sys.executable, "-c", script],
            capture_output=True,
            text=True,
            timeout=120,
            cwd=Path(__file__).parent,
            check=False,
        )
        assert child.returncode == 0, child.stderr
        live, got = json.loads(child.stdout)
        assert live == [f"{h}:{port}" for h in hosts]
        assert got == want
        served = [s.batches_served() - b for s, b in zip(servers, before, strict=True)]
        assert served == [BATCHES / 3] * 3


def test_a_stride_stream_serves_every_rth_batch_from_its_start(server: RunningServer) -> None:
    """At the wire: StreamStart(start_batch=1, stride=3) gets batches 1, 4, 7, 10 of the
    13, and a negative stride is INVALID_ARGUMENT naming it."""
    with grpc.insecure_channel(server.address) as channel:
        stub = loader_pb2_grpc.LoaderStub(channel)
        reply = stub.OpenSession(
            loader_pb2.OpenSessionRequest(
                dataset="records",
                batch_size=16,
                pipeline=batchd.Array((RECORD_FLOATS,), "float32", raw=True)._to_proto(),
            ),
            timeout=60,
        )
        assert reply.num_batches == 13

        def start(stride: int) -> Iterator[loader_pb2.StreamBatchesRequest]:
            yield loader_pb2.StreamBatchesRequest(
                start=loader_pb2.StreamStart(
                    session_id=reply.session_id,
                    start_batch=1,
                    stride=stride,
                    transport=loader_pb2.TRANSPORT_INLINE,
                )
            )

        indices = [m.batch_index for m in stub.StreamBatches(start(3), timeout=60) if m.fields]
        assert indices == [1, 4, 7, 10]
        with pytest.raises(grpc.RpcError) as caught:
            list(stub.StreamBatches(start(-1), timeout=60))
        assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "stride=-1" in str(caught.value.details())
        stub.CloseSession(loader_pb2.CloseSessionRequest(session_id=reply.session_id))
