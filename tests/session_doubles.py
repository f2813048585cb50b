"""What a ``Session`` is built from, without a catalog, shared memory or workers: for the
session unit tests (``tests/server/sessions/``), which hand each task's result back by hand."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np

from batchd._wire.ring import HEADER_BYTES
from batchd_server.pipelines.base import FieldSpec
from batchd_server.sessions import slot_layout
from batchd_server.sessions.ring import SessionRing
from batchd_server.workers.task import BatchResult, BatchTask

__all__ = ["CatalogRows", "fake_ring", "fake_source", "result_of"]


class CatalogRows:
    """The catalog arrays as a session reads them: a length and the optional columns."""

    def __init__(self, n: int) -> None:
        self._n = n
        self.dataset = SimpleNamespace(root="/data", parquet_payload=None)
        self.weights = self.labels = self.lengths = None

    def __len__(self) -> int:
        return self._n


def fake_source(samples: int) -> Any:
    """A catalog entry of ``samples`` rows, as ``Session(sources=...)`` takes it."""
    return SimpleNamespace(
        arrays=CatalogRows(samples), segment=SimpleNamespace(name="batchd-test-catalog")
    )


def fake_ring(session_id: str, slots: int, batch_size: int, name: str) -> SessionRing:
    """A ring of exactly ``slots`` slots of ``batch_size`` rows of one float32[3] field ``x``,
    in process memory under the segment name ``name``."""
    layout, slot_bytes = slot_layout([FieldSpec("x", np.dtype("<f4"), (3,))], batch_size)
    ring_bytes = HEADER_BYTES + slots * slot_bytes
    segment: Any = SimpleNamespace(
        name=name, nbytes=ring_bytes, path=Path("/dev/shm/x"), buf=bytearray(ring_bytes)
    )
    return SessionRing(session_id, segment, layout, slot_bytes, b"t" * 16)


def result_of(task: BatchTask, batch_size: int) -> BatchResult:
    """What a worker answers for ``task`` once it filled ``batch_size`` rows of its slot."""
    return BatchResult(
        task.batch_index,
        task.slot,
        batch_size,
        {"x": (batch_size, 3), "sample_id": (batch_size,), "label": (batch_size,)},
    )
