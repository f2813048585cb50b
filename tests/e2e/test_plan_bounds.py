"""What one OpenSession's plan may cost, on a real server over real gRPC: packed and mixed
opens over a million documents complete in seconds, while they run another client's calls
stay under 100 ms at the 99th percentile, and plans past a client's plan quota are refused
before they are built, leaving nothing charged or held."""

from __future__ import annotations

import itertools
import json
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import numpy as np
import pytest
from sqlalchemy.engine import Engine

from batchd._proto.batchd.v1 import loader_pb2 as pb
from batchd._proto.batchd.v1 import loader_pb2_grpc
from batchd._wire.metadata import CLIENT_ID_KEY
from batchd_server.api import RunningServer

from serving import RECORD_FLOATS, record_dataset, serve

# Plans do not depend on the catalog's backend: the embedded one is enough.
pytestmark = [pytest.mark.slow(seconds=240), pytest.mark.backend("sqlite")]

N_DOCS = 1_000_000
N_VAL = 100_000
OPEN_BOUND_S = 30.0
"""Generous: each open takes a few seconds on one loaded core."""
P99_BOUND_S = 0.1
PROBE_S = 0.005
"""Another client's health check every 5 ms while the big opens run."""
_TOKENS = pb.Pipeline(tokens=pb.TokensPipeline(max_len=8192, dtype="uint16"))
_RECORDS = pb.Pipeline(array=pb.ArrayPipeline(shape=[RECORD_FLOATS], dtype="float32", raw=True))


_INGEST = """
import sys
from batchd_server.catalog.db import make_engine
from batchd_server.catalog.ingest import ingest_manifest
url, root, manifest = sys.argv[1:]
ingest_manifest(make_engine(url), dataset="docs", root=root, manifest=manifest, verify=False)
"""


def _documents(engine: Engine, root: Path) -> None:
    """A million token documents of lengths 1 to 6,000 (the manifest gives each one's), the
    last ``N_VAL`` in split val: only planned here, never read. Ingested by a process of
    its own, as the CLI would, so that the million rows' Python objects are not the server
    process's to collect."""
    root.mkdir(parents=True)
    (root / "shard.bin").write_bytes(bytes(16))
    lengths = np.minimum(np.random.default_rng(0).lognormal(6.0, 1.1, N_DOCS), 6000) + 1
    manifest = root.parent / "docs.jsonl"
    with manifest.open("w") as out:
        for i, length in enumerate(lengths.astype(int).tolist()):
            split = "val" if i >= N_DOCS - N_VAL else "train"
            row = {"key": f"d{i:07d}", "path": "shard.bin", "byte_offset": 0, "byte_length": 2}
            out.write(json.dumps({**row, "split": split, "length": length}) + "\n")
    url = engine.url.render_as_string(hide_password=False)
    subprocess.run(
        [sys.executable, "-c", _INGEST, url, str(root), str(manifest)], check=True, timeout=600
    )


@pytest.fixture
def server(engine: Engine, tmp_path: Path) -> Iterator[RunningServer]:
    _documents(engine, tmp_path / "docs")
    with serve(engine.url.render_as_string(hide_password=False), tmp_path, workers=1) as srv:
        yield srv


def _packed(method: int) -> pb.OpenSessionRequest:
    return pb.OpenSessionRequest(
        dataset="docs",
        batch_size=8,
        shuffle=True,
        pipeline=_TOKENS,
        pack=pb.Pack(seq_len=2048, method=method),
    )


def _mixed(pack: pb.Pack | None = None) -> pb.OpenSessionRequest:
    """The two splits mixed 0.7/0.3, the weights moving linearly to 0.3/0.7 by step 5,000."""
    mix = pb.Mix(
        sources=[
            pb.MixSource(dataset="docs", split="train", weight=0.7),
            pb.MixSource(dataset="docs", split="val", weight=0.3),
        ],
        schedule=[pb.MixSchedulePoint(step=5000, weights=[0.3, 0.7])],
        interpolate="linear",
    )
    request = pb.OpenSessionRequest(mix=mix, batch_size=32, shuffle=True, pipeline=_TOKENS)
    if pack is not None:
        request.pack.CopyFrom(pack)
    return request


BIG_OPENS = {
    "concat": _packed(pb.PACK_METHOD_CONCAT),
    "first_fit": _packed(pb.PACK_METHOD_FIRST_FIT),
    "best_fit": _packed(pb.PACK_METHOD_BEST_FIT),
    "mixed": _mixed(),
    "mixed and packed": _mixed(pb.Pack(seq_len=4096, method=pb.PACK_METHOD_FIRST_FIT)),
}


def _open_and_close(
    stub: loader_pb2_grpc.LoaderStub, request: pb.OpenSessionRequest, client: str
) -> float:
    """Seconds OpenSession took; the session is closed again."""
    metadata = [(CLIENT_ID_KEY, client)]
    began = time.perf_counter()
    reply = stub.OpenSession(request, timeout=120, metadata=metadata)
    took = time.perf_counter() - began
    assert reply.num_batches > 0
    stub.CloseSession(
        pb.CloseSessionRequest(session_id=reply.session_id), timeout=60, metadata=metadata
    )
    return took


_PROBE = """
import json, select, sys, time
import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
address, interval = sys.argv[1], float(sys.argv[2])
with grpc.insecure_channel(address) as channel:
    health = health_pb2_grpc.HealthStub(channel)
    request = health_pb2.HealthCheckRequest(service="")
    health.Check(request, timeout=30)
    print("ready", flush=True)
    calls, began = [], time.monotonic()
    while not select.select([sys.stdin], [], [], 0)[0]:
        due = began + len(calls) * interval
        time.sleep(max(0.0, due - time.monotonic()))
        health.Check(request, timeout=30)
        calls.append((due, time.monotonic() - due))
print(json.dumps(calls))
"""
"""Another client, in a process of its own: a health check every ``interval`` seconds until
its stdin closes, each timed from when it was due (not from when the last one returned: a
server that stalls for a second delays every call due in that second, as it would a client
calling on its own schedule); then (due, seconds) of every call, as JSON."""


def test_big_opens_complete_in_seconds_and_other_clients_stay_fast(
    server: RunningServer,
) -> None:
    """Packed (each method) and mixed (a linear schedule, packed or not) opens over a
    million documents each complete within 30 s; while they run, another client's health
    checks, due every 5 ms, stay under 100 ms at p99 from when each was due (a call that
    needs the server's main process and nothing else; ListDatasets would time the catalog
    counting its million rows)."""
    took: dict[str, float] = {}
    spans: list[tuple[float, str]] = []
    with grpc.insecure_channel(server.address) as big:
        opener = loader_pb2_grpc.LoaderStub(big)
        # The splits' arrays load once, before anything is timed.
        for split in ("train", "val"):
            warm = _packed(pb.PACK_METHOD_CONCAT)
            warm.split = split
            _open_and_close(opener, warm, "big")
        probe = subprocess.Popen(
            [sys.executable, "-c", _PROBE, server.address, str(PROBE_S)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        try:
            assert probe.stdout is not None and probe.stdout.readline() == "ready\n"
            # Twice: the second round finds the placements of the first kept.
            for round_ in range(2):
                for name, request in BIG_OPENS.items():
                    spans.append((time.monotonic(), f"{name} {round_}"))
                    took[f"{name} {round_}"] = _open_and_close(opener, request, "big")
            spans.append((time.monotonic(), "end"))
            report, _ = probe.communicate(timeout=60)
        finally:
            probe.kill()
            probe.wait()
    slow = {name: s for name, s in took.items() if s >= OPEN_BOUND_S}
    assert len(took) == 2 * len(BIG_OPENS) and not slow, took
    calls = [(due, s) for due, s in json.loads(report) if due >= spans[0][0]]
    assert len(calls) >= 100, calls
    latencies = [s for _, s in calls]
    p99 = float(np.percentile(latencies, 99))
    during = [
        name
        for due, s in calls
        if s >= P99_BOUND_S
        for (start, name), (end, _) in itertools.pairwise(spans)
        if start <= due < end
    ]
    assert p99 < P99_BOUND_S, (p99, max(latencies), sorted(set(during)), took)


@pytest.fixture
def records_url(engine: Engine, tmp_path: Path) -> str:
    record_dataset(engine, tmp_path / "r", n=203)
    return engine.url.render_as_string(hide_password=False)


def _mix_of_records(stop: int) -> pb.OpenSessionRequest:
    """A mix of one source, the records, ``stop`` samples an epoch."""
    mix = pb.Mix(
        sources=[pb.MixSource(dataset="records", split="train", weight=1.0)],
        stop_samples=stop,
    )
    return pb.OpenSessionRequest(mix=mix, batch_size=16, pipeline=_RECORDS)


def test_a_plan_past_the_client_plan_quota_is_refused_and_nothing_stays_charged(
    records_url: str, tmp_path: Path
) -> None:
    """With a 1 MiB plan quota, a mix of 20,000 samples an epoch (about 1.2 MiB of plan) is
    RESOURCE_EXHAUSTED naming the quota and the remedy, and leaves the client nothing
    charged and nothing held (the server's teardown checks shared memory and processes); one
    of 9,000 opens, is charged while open, and nothing once closed."""
    client = "planner"
    metadata = [(CLIENT_ID_KEY, client)]
    quota = 1 << 20
    with (
        serve(records_url, tmp_path, client_plan_quota_bytes=quota) as srv,
        grpc.insecure_channel(srv.address) as channel,
    ):
        stub = loader_pb2_grpc.LoaderStub(channel)
        with pytest.raises(grpc.RpcError) as refused:
            stub.OpenSession(_mix_of_records(20_000), timeout=60, metadata=metadata)
        assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        message = refused.value.details() or ""
        assert "--client-plan-quota" in message and "BATCHD_CLIENT_PLAN_QUOTA" in message
        assert f"client 'unix {client}'" in message
        assert srv.sessions.plan_usage(f"unix {client}") == 0
        assert srv.sessions.usage(f"unix {client}") == (0, 0) and len(srv.sessions) == 0

        reply = stub.OpenSession(_mix_of_records(9_000), timeout=60, metadata=metadata)
        charged = srv.sessions.plan_usage(f"unix {client}")
        assert 9_000 * 8 < charged <= quota
        # A second one would pass the quota together with the first.
        with pytest.raises(grpc.RpcError) as second:
            stub.OpenSession(_mix_of_records(9_000), timeout=60, metadata=metadata)
        assert second.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert srv.sessions.plan_usage(f"unix {client}") == charged
        stub.CloseSession(
            pb.CloseSessionRequest(session_id=reply.session_id), timeout=60, metadata=metadata
        )
        assert srv.sessions.plan_usage(f"unix {client}") == 0
