"""A stand-in for batchd-server on the wire, for client tests without a server.

``WireDouble`` speaks loader.proto's inline transport with synthetic, deterministic batches
and records what the client sent (acks, half-closes, early ends), so that client tests can
check the client's side of the contract (credits, acknowledgement timing, inline chunking,
resume) in ways the real server cannot show. It names no doorbell, so a client's
``transport="auto"`` falls back to inline against it; the shm path (ring, doorbell, leases,
lent slots) is tested against the real server in ``e2e/test_loader.py``.
"""

from __future__ import annotations

import contextlib
import math
import os
import queue
import secrets
import shutil
import tempfile
import threading
from collections.abc import Iterator
from concurrent import futures
from pathlib import Path
from typing import Any

import grpc
import numpy as np

from batchd._proto.batchd.v1 import loader_pb2, loader_pb2_grpc
from batchd._transport.shm import SHM_DIR

__all__ = [
    "FIELDS",
    "ROWS",
    "TAG",
    "WireDouble",
    "inline_chunks",
    "serve_double",
    "tagged_segments",
]

TAG = f"bdclient-test-{os.getpid()}-"
"""Prefix of the segments client tests make. Not "batchd-": other suites running beside
these check that no batchd entry is left in /dev/shm, and the pid keeps two runs apart."""
ROWS = 10
FIELDS = (("sample_id", "<i8", ()), ("label", "<i8", ()), ("array", "<f4", (2,)))
CANCEL_GRACE_S = 5.0
"""How long the double waits for a cancel to follow a half-close before it calls the
batches still out unacked (only a client that did not cancel waits this long)."""


def tagged_segments() -> list[str]:
    """The entries in /dev/shm that this test process's client tests made (``TAG``)."""
    return sorted(p.name for p in SHM_DIR.iterdir() if p.name.startswith(TAG))


def inline_chunks(head: Any, data: bytes, size: int) -> list[Any]:
    """``head`` and ``data`` as the inline transport sends them: ``data`` in pieces of
    ``size`` bytes, the first in ``head`` (which announces the total), ``more`` on all but
    the last."""
    pieces = [data[i : i + size] for i in range(0, len(data), size)] or [b""]
    messages = []
    for i, piece in enumerate(pieces):
        msg = loader_pb2.StreamBatchesResponse() if i else head
        msg.data, msg.more = piece, i < len(pieces) - 1
        messages.append(msg)
    head.inline_bytes = len(data)
    return messages


def _order(request: Any, epoch: int) -> np.ndarray:
    """The double's plan: id order or a per-(seed, epoch) permutation, padded by wrapping."""
    shuffle = np.random.default_rng([request.seed, epoch]).permutation(ROWS)
    order = shuffle if request.shuffle else np.arange(ROWS)
    world_size = request.world_size or 1
    order = np.resize(order, math.ceil(ROWS / world_size) * world_size)
    return order[request.rank :: world_size]


class WireDouble(loader_pb2_grpc.LoaderServicer):
    """Serves ROWS synthetic samples (label = id % 3, array = [id, -id]) over loader.proto."""

    def __init__(self) -> None:
        self.sessions: dict[str, tuple[Any, Any, Path, list[int]]] = {}
        self.opened: list[Any] = []
        self.closed: list[str] = []
        self.starts: list[Any] = []
        self.acks: list[int] = []
        self.acked_wait_s = 0.0
        self.stream_ends: queue.Queue[str] = queue.Queue()
        self.fail_at_batch = -1
        self.failed_ids: dict[int, list[int]] = {}

    def OpenSession(self, request: Any, context: Any) -> Any:
        if request.dataset != "synthetic":
            context.abort(grpc.StatusCode.NOT_FOUND, f"no dataset {request.dataset!r}")
        if request.snapshot == "gone":
            context.set_trailing_metadata((("batchd-error-class", "SnapshotMismatch"),))
            context.abort(grpc.StatusCode.FAILED_PRECONDITION, "snapshot 'gone' has changed")
        rows, prefetch = request.batch_size, request.prefetch or 4
        offsets, slot_bytes = [], 0
        for _, dtype, shape in FIELDS:
            offsets.append(slot_bytes)
            slot_bytes += -(-rows * math.prod(shape) * np.dtype(dtype).itemsize // 64) * 64
        layout = loader_pb2.RingLayout(
            shm_name=f"{TAG}{secrets.token_hex(8)}",
            segment_bytes=64 + prefetch * slot_bytes,
            header_bytes=64,
            slot_bytes=slot_bytes,
            slots=prefetch,
            token=secrets.token_bytes(16),
        )
        path = SHM_DIR / layout.shm_name
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
        try:
            os.ftruncate(fd, layout.segment_bytes)
            os.pwrite(fd, layout.token, 0)
        finally:
            os.close(fd)
        per_rank = math.ceil(ROWS / (request.world_size or 1))
        reply = loader_pb2.OpenSessionResponse(
            session_id=secrets.token_hex(8),
            num_batches=math.ceil(per_rank / rows),
            num_samples=per_rank,
            fields=[loader_pb2.FieldSchema(name=n, dtype=d, shape=s) for n, d, s in FIELDS],
            snapshot=request.snapshot or "snap-1",
            ring=layout,
            lease_timeout_s=30.0,
            version=request.version or "v1",
            split=request.split,
            prefetch=prefetch,
        )
        self.sessions[reply.session_id] = (request, reply, path, offsets)
        self.opened.append(request)
        return reply

    def _take_ack(self, acks: queue.Queue[Any], free: list[int], slot_of: dict[int, int]) -> bool:
        ack = acks.get(timeout=30)
        if ack is None:
            return False
        for index in ack.batch_indices:
            free.append(slot_of.pop(index))  # an ack of a batch not held fails the stream
            self.acks.append(index)
        self.acked_wait_s += ack.wait_s
        return True

    def StreamBatches(self, request_iterator: Any, context: Any) -> Iterator[Any]:
        start = next(request_iterator).start
        self.starts.append(start)
        request, reply, _path, offsets = self.sessions[start.session_id]
        acks: queue.Queue[Any] = queue.Queue()

        def read() -> None:
            try:
                for message in request_iterator:
                    acks.put(message.ack)
            except grpc.RpcError:
                pass
            finally:
                acks.put(None)

        threading.Thread(target=read, daemon=True).start()
        free, slot_of = list(range(reply.prefetch)), {}
        order, size, slot_bytes = (
            _order(request, start.epoch),
            request.batch_size,
            reply.ring.slot_bytes,
        )
        ended = "early"
        try:
            for k in range(start.start_batch, reply.num_batches):
                while not free:
                    if not self._take_ack(acks, free, slot_of):
                        return
                if k == self.fail_at_batch:
                    context.abort(grpc.StatusCode.DATA_LOSS, f"batch {k}: sample is corrupt")
                ids = order[k * size : (k + 1) * size].astype("<i8")
                columns = [ids, ids % 3, np.stack([ids, -ids], 1).astype("<f4")]
                slot = free.pop(0)
                slot_of[k] = slot
                buffer = np.zeros(slot_bytes, dtype=np.uint8)
                msg = loader_pb2.StreamBatchesResponse(
                    batch_index=k, rows=len(ids), failed_sample_ids=self.failed_ids.get(k, [])
                )
                for (name, dtype, _), offset, column in zip(FIELDS, offsets, columns, strict=True):
                    buffer[offset : offset + column.nbytes] = column.view(np.uint8).ravel()
                    msg.fields.add(
                        name=name,
                        dtype=dtype,
                        shape=column.shape,
                        offset=offset,
                        nbytes=column.nbytes,
                    )
                assert start.transport == loader_pb2.TRANSPORT_INLINE, "the double has no doorbell"
                msg.slot = -1
                yield from inline_chunks(msg, buffer.tobytes(), 40)
            while self._take_ack(acks, free, slot_of):
                pass
            # Every batch went out; a client that cancels now (a break after the first batch
            # of a short epoch) still ended early, not with batches unacked. A client that
            # breaks may half-close its requests just before its cancel lands: with batches
            # unacked, give the cancel a bounded moment to arrive before calling them unacked.
            if slot_of and context.is_active():
                terminated = threading.Event()
                if context.add_callback(terminated.set):
                    terminated.wait(CANCEL_GRACE_S)
            if context.is_active():
                ended = "complete" if not slot_of else f"unacked {sorted(slot_of)}"
        finally:
            self.stream_ends.put(ended)

    def CloseSession(self, request: Any, context: Any) -> Any:
        _, _, path, _ = self.sessions.pop(request.session_id)
        path.unlink()
        self.closed.append(request.session_id)
        return loader_pb2.CloseSessionResponse()


@contextlib.contextmanager
def serve_double() -> Iterator[tuple[WireDouble, str]]:
    """A WireDouble on a unix socket in a temp dir, and its address; on exit, asserts that
    the client closed every session it opened."""
    directory = tempfile.mkdtemp(prefix="batchd-client-", dir="/tmp")
    servicer = WireDouble()
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=8))
    loader_pb2_grpc.add_LoaderServicer_to_server(servicer, server)
    address = f"unix://{directory}/grpc.sock"
    assert server.add_insecure_port(address) != 0
    server.start()
    try:
        yield servicer, address
    finally:
        server.stop(None).wait()
        shutil.rmtree(directory)
        left = [path for _, _, path, _ in servicer.sessions.values()]
        for path in left:
            path.unlink(missing_ok=True)
        assert not left, "the client left sessions open"
