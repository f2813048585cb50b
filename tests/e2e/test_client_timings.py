"""A client's batch timings cost the server what it delivered, no more: an ack that carries
4,096 timings after one batch went out is cut to the batches the stream delivered, on a real
server over a real inline stream (the histograms count what was accepted)."""

from __future__ import annotations

import queue
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from sqlalchemy.engine import Engine

from batchd._proto.batchd.v1 import loader_pb2 as pb
from batchd._proto.batchd.v1 import loader_pb2_grpc
from batchd._wire.metadata import CLIENT_ID_KEY
from batchd_server.metrics.stall import CLIENT_WAIT_SECONDS, MAX_TIMINGS_PER_ACK

from serving import RECORD_FLOATS, record_dataset, serve

pytestmark = pytest.mark.backend("postgres")

_RECORDS = pb.Pipeline(array=pb.ArrayPipeline(shape=[RECORD_FLOATS], dtype="float32", raw=True))


def _observed(dataset: str) -> float:
    return sum(
        s.value
        for family in CLIENT_WAIT_SECONDS.collect()
        for s in family.samples
        if s.name.endswith("_count") and s.labels.get("dataset") == dataset
    )


def test_timings_beyond_the_batches_delivered_are_not_accepted(
    engine: Engine, tmp_path: Path
) -> None:
    """203 records in batches of 16 (13 batches): the first ack carries 4,096 timings; over
    the whole epoch the server accepts at most one per batch it delivered."""
    name = "timings_cap"
    record_dataset(engine, tmp_path / "r", n=203, name=name)
    url = engine.url.render_as_string(hide_password=False)
    before = _observed(name)
    with serve(url, tmp_path, workers=1) as srv:
        channel = grpc.insecure_channel(srv.address)
        stub = loader_pb2_grpc.LoaderStub(channel)
        meta = [(CLIENT_ID_KEY, "flood")]
        opened = stub.OpenSession(
            pb.OpenSessionRequest(dataset=name, batch_size=16, prefetch=2, pipeline=_RECORDS),
            timeout=60,
            metadata=meta,
        )
        acks: queue.Queue[pb.StreamBatchesRequest | None] = queue.Queue()

        def requests() -> Iterator[pb.StreamBatchesRequest]:
            yield pb.StreamBatchesRequest(
                start=pb.StreamStart(session_id=opened.session_id, transport=pb.TRANSPORT_INLINE)
            )
            while (ack := acks.get(timeout=60)) is not None:
                yield ack

        flood = [1.0] * MAX_TIMINGS_PER_ACK
        batches: set[int] = set()
        for response in stub.StreamBatches(requests(), timeout=120, metadata=meta):
            if response.more or response.accepted:
                continue
            timings = {} if batches else {"batch_wait_s": flood, "batch_step_s": flood}
            batches.add(response.batch_index)
            acks.put(
                pb.StreamBatchesRequest(ack=pb.Ack(batch_indices=[response.batch_index], **timings))
            )
            if len(batches) == opened.num_batches:
                acks.put(None)  # half-close: the server reads every ack before it ends the call
        stub.CloseSession(
            pb.CloseSessionRequest(session_id=opened.session_id), timeout=60, metadata=meta
        )
        channel.close()
    assert len(batches) == opened.num_batches == 13
    accepted = _observed(name) - before
    assert 1 <= accepted <= opened.num_batches, f"{accepted:g} timings accepted for 13 batches"
