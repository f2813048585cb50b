"""What a share group's loans may keep, end to end: a real server, worker processes, shm.

A reader's loop here is NumPy's (torch hidden from the client), so it holds a batch it read
in another member's ring as a read-only view of that ring, a loan, for as long as the test
keeps the array: what a reader that never gives a batch back does. With torch the client
copies such a batch and gives the slot back at once (a tensor cannot be read-only).
"""

from __future__ import annotations

import gc
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest

import batchd
from batchd import _device, errors
from batchd._channel import client_id
from batchd._proto.batchd.v1 import loader_pb2 as pb
from batchd._proto.batchd.v1 import loader_pb2_grpc
from batchd._wire.metadata import CLIENT_ID_KEY
from batchd_server.api import RunningServer

from chaos_harness import wait_until
from serving import RECORD_FLOATS, records_loader, serve

pytestmark = pytest.mark.slow(seconds=20)

LOAN_TIMEOUT_S = 2.0


@pytest.fixture
def numpy_loop(monkeypatch: pytest.MonkeyPatch) -> None:
    """The client's loops get NumPy arrays, as without torch installed."""
    monkeypatch.setattr(_device, "torch_or_none", lambda: None)


@pytest.fixture
def server(catalog: dict[str, Any], tmp_path: Path) -> Iterator[RunningServer]:
    with serve(catalog["url"], tmp_path, share_loan_timeout_s=LOAN_TIMEOUT_S) as srv:
        yield srv


def _member(server: RunningServer) -> batchd.Loader:
    return records_loader(server, share="sweep-9", batch_size=4, prefetch=2, seed=3)


def _ring(loader: batchd.Loader) -> Path:
    session = loader._replicas.primary.session
    assert session is not None and session.transport.ring is not None
    return Path("/dev/shm") / session.reply.ring.shm_name


def _borrowed(one: batchd.Loader, two: batchd.Loader) -> tuple[Iterator[Any], dict[str, Any]]:
    """One's stream runs a ring ahead; two reads batches until one it reads in one's ring:
    two's iterator, and that batch (read-only views of one's ring)."""
    ring = _ring(one)
    a_iter, b_iter = iter(one), iter(two)
    next(a_iter)
    next(a_iter)
    for batch in b_iter:
        array = batch["array"]
        assert isinstance(array, np.ndarray)
        if _mapped_from(array) == ring:
            assert not array.flags.writeable, "another member's ring is mapped read-only"
            return b_iter, batch
    raise AssertionError("two read no batch in one's ring")


def _mapped_from(array: np.ndarray) -> Path | None:
    address = array.ctypes.data
    for line in Path("/proc/self/maps").read_text().splitlines():
        fields = line.split(maxsplit=5)
        low, high = (int(x, 16) for x in fields[0].split("-"))
        if low <= address < high and len(fields) == 6:
            return Path(fields[5].removesuffix(" (deleted)"))
    return None


def test_a_closed_members_ring_is_charged_to_the_client_still_reading_it(
    server: RunningServer, numpy_loop: None
) -> None:
    """This process holds two members' rings, its quota's worth; member one closes while
    two's loop keeps a batch in one's ring: one's ring stays, charged to this client (two
    reads it), so a third open is refused with a message that says so; once two's loop lets
    the batch go, the ring is freed and the open passes."""
    channel = grpc.insecure_channel(server.address)
    stub = loader_pb2_grpc.LoaderStub(channel)
    request = pb.OpenSessionRequest(
        dataset="records",
        batch_size=4,
        prefetch=2,
        pipeline=pb.Pipeline(
            array=pb.ArrayPipeline(shape=[RECORD_FLOATS], dtype="float32", raw=True)
        ),
    )
    meta = [(CLIENT_ID_KEY, client_id())]
    try:
        with _member(server) as one, _member(server) as two:
            b_iter, held = _borrowed(one, two)
            ring = _ring(one)
            ring_bytes = ring.stat().st_size
            # This client's quota: the two rings it holds and less than a third.
            server.sessions._client_shm_quota = 2 * ring_bytes + ring_bytes // 2
            one.close()
            assert ring.exists(), "one's ring went while two's loop held a batch in it"
            with pytest.raises(grpc.RpcError) as refused:
                stub.OpenSession(request, timeout=60, metadata=meta)
            assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert "closed share-group members' rings" in str(refused.value.details())
            del held, b_iter
            gc.collect()
            wait_until(lambda: not ring.exists(), "one's ring to be freed", 30)
            opened = stub.OpenSession(request, timeout=60, metadata=meta)
            stub.CloseSession(
                pb.CloseSessionRequest(session_id=opened.session_id), timeout=60, metadata=meta
            )
    finally:
        channel.close()


def test_a_loan_kept_past_the_timeout_is_reclaimed_and_the_reader_told(
    server: RunningServer, numpy_loop: None
) -> None:
    """Two's loop keeps a batch read in one's ring, and one closes: after
    --share-loan-timeout-s the loan is reclaimed, one's ring segment is gone (nothing
    leaked, with two still open), and two's epoch ends with an error naming the setting."""
    with _member(server) as one, _member(server) as two:
        b_iter, held = _borrowed(one, two)
        ring = _ring(one)
        one.close()
        assert ring.exists()
        wait_until(lambda: not ring.exists(), "the loan to be reclaimed", 10 * LOAN_TIMEOUT_S)
        assert server.sessions.shares.kept_bytes(client_id()) == 0
        with pytest.raises(errors.ResourceExhausted, match="--share-loan-timeout-s"):
            for _ in b_iter:
                pass
        del held
    assert len(server.sessions) == 0
