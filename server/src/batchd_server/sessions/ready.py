"""What a session hands out and what it is handed: a batch ready to go out (its fields'
places, its lease, the ring it is in), the client's doorbell and the worker pool as a
session sees them."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from batchd_server.sessions.ring import RingRef
from batchd_server.workers.task import BatchResult, BatchTask, SlotField

__all__ = ["Bell", "FieldView", "ReadyBatch", "SubmitsTasks", "field_views"]


class Bell(Protocol):
    """A client's doorbell connection, as a session sees it (``delivery/doorbell.py``)."""

    def close(self) -> None:
        """Hang up: the client's next read fails, and the connection's streams end."""
        ...


class SubmitsTasks(Protocol):
    """The worker pool, as a session sees it (``batchd_server.workers.pool.WorkerPool``)."""

    def submit(self, task: BatchTask) -> Future[BatchResult]:
        """Queue ``task``; its future is done when a worker wrote the batch (or failed)."""
        ...


@dataclass(frozen=True)
class FieldView:
    """One field of one batch, as its slot holds it (its place in every slot is a
    ``SlotField``)."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    """This batch's shape of the field, rows first."""
    offset: int
    """From the slot's start."""
    nbytes: int
    """What this batch fills of the field's place."""


def field_views(
    layout: Sequence[SlotField], shapes: Mapping[str, Sequence[int]]
) -> list[FieldView]:
    """Where each field of a batch lies in its slot, at the ``shapes`` its worker wrote."""
    views = []
    for f in layout:
        shape = shapes[f.name]
        nbytes = math.prod(shape) * np.dtype(f.dtype).itemsize
        views.append(FieldView(f.name, f.dtype, tuple(shape), f.offset, nbytes))
    return views


@dataclass(frozen=True)
class ReadyBatch:
    """Batch ``batch_index`` is in ``slot``, ready to go out; ``fields`` are at offsets from
    the slot's start."""

    batch_index: int
    slot: int
    rows: int
    fields: list[FieldView]
    failed_sample_ids: list[int]
    lease: int = 0
    """shm streams: what the client acks to give the slot back (NOTE [ Slot lifecycle ])."""
    ring: RingRef | None = None
    """shm, a loan from a share group's member: ``slot`` is a slot of this ring, not of the
    session's own (NOTE [ Share groups ])."""
