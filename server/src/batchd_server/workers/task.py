"""What a worker is asked to do, and how it does it: fill one slot with one batch.

Tasks and results are small, picklable dataclasses: a task names the session, the batch,
the slot and the batch's sample positions; the result says how many rows were filled, each
field's final shape and which samples failed. Sample data never travels through a pipe: the
worker reads the catalog arrays from a read-only shared-memory segment and writes every
field of every sample straight into the session's ring (see NOTE [ Slot lifecycle ] in
``batchd_server/sessions/slots.py``).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import numpy.typing as npt

from batchd._wire.ring import slot_offset
from batchd_server.pipelines.base import BadSample, Block, Pipeline, SampleInfo, sample_rng
from batchd_server.pipelines.files import SampleFiles
from batchd_server.pipelines.registry import build_pipeline
from batchd_server.shm.arrays import attach_arrays
from batchd_server.shm.segments import Attachment, attach

__all__ = [
    "BatchResult",
    "BatchTask",
    "MixSourceSpec",
    "SampleFailure",
    "SessionContext",
    "SessionSpec",
    "SlotField",
    "StageTimes",
    "run_batch",
]

_REPLACE_ATTEMPTS = 8
"""Substitutes tried for one bad sample under on_error="replace" before it is skipped."""


@dataclass(frozen=True)
class SlotField:
    """One field's place in every slot of a ring."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    """One sample's shape at most."""
    offset: int
    """From the slot's start."""
    capacity_bytes: int


@dataclass(frozen=True)
class MixSourceSpec:
    """One source of a mixed session, as a worker opens it (``workers/mixed.py``)."""

    catalog_segment: str
    root: str
    start: int
    """The source's first position: a task's positions are global over the sources."""
    pipeline_kind: str = ""
    """The source's own pipeline; "" decodes it with the session's."""
    pipeline_options: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class SessionSpec:
    """What a worker needs to know about a session; sent with every task (a few hundred bytes)."""

    session_id: str
    root: str
    pipeline_kind: str
    pipeline_options: dict[str, Any]
    catalog_segment: str
    ring_segment: str
    header_bytes: int
    slot_bytes: int
    fields: tuple[SlotField, ...]
    batch_size: int
    seed: int
    on_error: str
    shm_dir: str = "/dev/shm"
    dataset: str = ""
    """The dataset's name: the label of the worker-timing metrics (never the session's id)."""
    sources: tuple[MixSourceSpec, ...] = ()
    """A mix's sources, in order (the first is ``catalog_segment`` and ``root``); empty for a
    session on one split."""


@dataclass(frozen=True)
class BatchTask:
    spec: SessionSpec
    epoch: int
    batch_index: int
    slot: int
    positions: bytes
    """The batch's sample positions in the split arrays, int64."""
    one_by_one: bool = False
    """Read and decode each sample on its own, never the batch at once (a redo after a
    worker hung on the batch; see ``workers/deadline.py``)."""
    hung: tuple[int, ...] = ()
    """Positions whose read or decode hung past the task deadline twice: reported as bad
    samples of kind ``timeout`` without touching them again."""


@dataclass(frozen=True)
class SampleFailure:
    sample_id: int
    path: str
    kind: str
    message: str
    replaced_by: int | None = None
    """Under on_error="replace": the substitute's sample id, None when none could be found."""


@dataclass(frozen=True)
class StageTimes:
    """Where a worker's time on one batch went, in seconds; the server's stall metrics."""

    started_at: float = 0.0
    """``time.monotonic()`` when the worker began the task. Linux's monotonic clock is one
    for the whole machine, so the server subtracts its own submit time to get the queue wait."""
    read_s: float = 0.0
    """Reading sample bytes: files, byte ranges, mapping shards."""
    decode_s: float = 0.0
    """Decoding and transforming samples, each written into its place in the slot (for raw
    fixed-size records: the one vectorised gather)."""
    collate_s: float = 0.0
    """Batch-wide work after the samples: padding to the longest, the pipeline's finish."""


@dataclass(frozen=True)
class BatchResult:
    batch_index: int
    slot: int
    rows: int
    shapes: dict[str, tuple[int, ...]]
    failures: list[SampleFailure] = field(default_factory=list)
    fatal: bool = False
    """on_error="raise" and a sample failed: the batch must not be served."""
    times: StageTimes = field(default_factory=StageTimes, compare=False)
    """How long the worker took; not part of what the batch is (two runs of it differ)."""


class SessionContext:
    """A worker's open handles for one session: catalog arrays, ring mapping, pipeline, files."""

    def __init__(self, spec: SessionSpec) -> None:
        from pathlib import Path

        self.spec = spec
        arrays, self._catalog = attach_arrays(spec.catalog_segment, shm_dir=Path(spec.shm_dir))
        self.ids: npt.NDArray[np.int64] = arrays["ids"]
        self.labels: npt.NDArray[np.int64] = arrays["labels"]
        self.lengths: npt.NDArray[np.int32] = arrays["lengths"]
        self.byte_offsets: npt.NDArray[np.int64] = arrays["byte_offsets"]
        self.byte_lengths: npt.NDArray[np.int64] = arrays["byte_lengths"]
        self.path_bytes: npt.NDArray[np.uint8] = arrays["path_bytes"]
        self.path_offsets: npt.NDArray[np.int64] = arrays["path_offsets"]
        self._ring: Attachment = attach(
            spec.ring_segment, writable=True, shm_dir=Path(spec.shm_dir)
        )
        self.pipeline: Pipeline = build_pipeline(spec.pipeline_kind, spec.pipeline_options)
        self.files = SampleFiles(spec.root)
        self._read_s = 0.0
        self._decode_s = 0.0
        """Time spent in the current task's reads and decodes (see ``StageTimes``)."""
        self._blocks: dict[int, Block] = {}
        """Each slot's field views, made on its first task (about 30 us a batch otherwise)."""
        self.where: npt.NDArray[np.int64] = np.zeros(1, np.int64)
        """Where the current task is: the position being read or decoded, -1 for a step of
        the whole batch. The worker points this into memory its pool reads when the task
        overruns its deadline (``workers/deadline.py``)."""
        self._hung: frozenset[int] = frozenset()
        self._offset = 0
        """The task position of this context's catalog row 0 (a mix's source's start)."""

    def slot_block(self, slot: int) -> Block:
        """Every field of ``slot`` as a ``(batch_size, *shape)`` array over the ring."""
        cached = self._blocks.get(slot)
        if cached is None:
            cached = self._blocks[slot] = self._make_block(slot)
        return dict(cached)

    def _make_block(self, slot: int) -> Block:
        base = slot_offset(slot, self.spec.slot_bytes, self.spec.header_bytes)
        block: Block = {}
        for f in self.spec.fields:
            count = self.spec.batch_size * int(np.prod(f.shape, dtype=np.int64))
            flat = np.frombuffer(self._ring.buf, np.dtype(f.dtype), count, base + f.offset)
            block[f.name] = flat.reshape(self.spec.batch_size, *f.shape)
        return block

    def path(self, position: int) -> str:
        start, end = self.path_offsets[position], self.path_offsets[position + 1]
        return self.path_bytes[start:end].tobytes().decode("utf-8", "replace")

    def close(self) -> None:
        """Drop every handle; views into the mappings must be gone already."""
        self._blocks.clear()
        for name in list(vars(self)):
            if isinstance(getattr(self, name), np.ndarray):
                delattr(self, name)
        self.files.close()
        self._ring.close()
        self._catalog.close()

    # -- filling a slot -----------------------------------------------------------------

    def run(self, task: BatchTask) -> BatchResult:
        started_at = time.monotonic()
        self._read_s = self._decode_s = 0.0
        positions = np.frombuffer(task.positions, np.int64)
        block = self.slot_block(task.slot)
        self.files.begin_batch()
        self._hung = frozenset(task.hung)
        self.where[0] = -1
        rows = None if task.one_by_one or task.hung else self._read_records(positions, block)
        failures: list[SampleFailure] = []
        fatal = False
        if rows is None:
            rows, failures, fatal = self._decode_each(task, positions, block)
        self.where[0] = -1
        finish_start = time.perf_counter()
        pipeline_block = {k: v for k, v in block.items() if k not in ("sample_id", "label")}
        shapes = self.pipeline.finish(pipeline_block, rows)
        shapes["sample_id"] = (rows,)
        shapes["label"] = (rows,)
        del block, pipeline_block  # no view of the ring may outlive the task
        times = StageTimes(
            started_at=started_at,
            read_s=self._read_s,
            decode_s=self._decode_s,
            collate_s=time.perf_counter() - finish_start,
        )
        return BatchResult(task.batch_index, task.slot, rows, shapes, failures, fatal, times)

    def _read_records(self, positions: npt.NDArray[np.int64], block: Block) -> int | None:
        """A batch of byte-range samples: read in a few reads, decoded in one go
        (``Pipeline.decode_batch``), no Python call per sample. None when the batch does not
        qualify or a sample in it is not right; then each sample is read on its own, which
        also finds and reports whichever sample is bad."""
        if len(positions) == 0:
            return None
        offsets = self.byte_offsets[positions]
        lengths = self.byte_lengths[positions]
        if offsets.min() < 0 or lengths.min() < 0:  # whole files, or "to the end"
            return None
        read_start = time.perf_counter()
        paths, files = self._batch_paths(positions)
        try:
            data, starts = self.files.read_ranges(paths, files, offsets, lengths)
        except BadSample:
            return None
        finally:
            self._read_s += time.perf_counter() - read_start
        rows = len(positions)
        decode_start = time.perf_counter()
        decoded = self.pipeline.decode_batch(data, starts, lengths, block)
        self._decode_s += time.perf_counter() - decode_start
        if not decoded:
            return None
        block["sample_id"][:rows] = self.ids[positions]
        block["label"][:rows] = self.labels[positions]
        return rows

    def _batch_paths(self, positions: npt.NDArray[np.int64]) -> tuple[list[str], npt.NDArray[Any]]:
        """The distinct paths of the samples at ``positions``, and each sample's index in them."""
        starts = self.path_offsets[positions]
        ends = self.path_offsets[positions + 1]
        width = int(ends[0] - starts[0])
        if (ends - starts == width).all():  # the usual batch: one shard for all its samples
            names = self.path_bytes[starts[:, None] + np.arange(width)]
            if (names == names[0]).all():
                return [self.path(int(positions[0]))], np.zeros(len(positions), np.intp)
        seen: dict[bytes, int] = {}
        raw = self.path_bytes
        files = np.fromiter(
            (
                seen.setdefault(raw[a:b].tobytes(), len(seen))
                for a, b in zip(starts.tolist(), ends.tolist(), strict=True)
            ),
            np.intp,
            len(positions),
        )
        return [k.decode("utf-8", "replace") for k in seen], files

    def _decode_one(self, position: int, epoch: int, row: Block) -> None:
        self.where[0] = self._offset + position
        sample_id = int(self.ids[position])
        info = SampleInfo(
            sample_id=sample_id,
            label=int(self.labels[position]),
            path=self.path(position),
            length=int(self.lengths[position]),
            seed=self.spec.seed,
            epoch=epoch,
        )
        if self._offset + position in self._hung:
            raise BadSample(
                "timeout",
                f"{info.path}: reading or decoding it hung past the server's task deadline "
                "(--task-timeout-s) twice, and the worker was killed each time; check the "
                "file and the file system it is on",
            )
        read_start = time.perf_counter()
        try:
            data = self.files.read(
                info.path, int(self.byte_offsets[position]), int(self.byte_lengths[position])
            )
        finally:
            decode_start = time.perf_counter()
            self._read_s += decode_start - read_start
        try:
            self.pipeline.decode_into(data, info, row)
            row["sample_id"][...] = sample_id
            row["label"][...] = info.label
        finally:
            self._decode_s += time.perf_counter() - decode_start

    def _decode_each(
        self, task: BatchTask, positions: npt.NDArray[np.int64], block: Block
    ) -> tuple[int, list[SampleFailure], bool]:
        policy = self.spec.on_error
        failures: list[SampleFailure] = []
        rows = 0
        for position in positions.tolist():
            row = {name: array[rows, ...] for name, array in block.items()}
            try:
                self._decode_one(position, task.epoch, row)
                rows += 1
                continue
            except BadSample as e:
                sample_id = int(self.ids[position])
                failure = SampleFailure(sample_id, self.path(position), e.kind, str(e))
            if policy == "raise":
                return rows, [failure], True
            if policy == "replace":
                substitute = self._replace(sample_id, task.epoch, row, failures)
                failure = SampleFailure(
                    failure.sample_id, failure.path, failure.kind, failure.message, substitute
                )
                if substitute is not None:
                    rows += 1
            failures.append(failure)
        return rows, failures, False

    def _replace(
        self, sample_id: int, epoch: int, row: Block, failures: list[SampleFailure]
    ) -> int | None:
        """Decode a substitute drawn from (seed, epoch, sample id) into ``row``."""
        rng = sample_rng(self.spec.seed, epoch, sample_id)
        n = len(self.ids)
        for _ in range(_REPLACE_ATTEMPTS):
            position = int(rng.integers(n))
            try:
                self._decode_one(position, epoch, row)
            except BadSample as e:
                bad_id = int(self.ids[position])
                failures.append(SampleFailure(bad_id, self.path(position), e.kind, str(e)))
                continue
            return int(self.ids[position])
        return None


def run_batch(
    contexts: dict[str, SessionContext],
    task: BatchTask,
    where: npt.NDArray[np.int64] | None = None,
) -> BatchResult:
    """Fill ``task``'s slot, opening the session's handles on its first task here.

    ``where``: one int64 the context keeps up to date with the position it works on (see
    ``SessionContext.where``).
    """
    context = contexts.get(task.spec.session_id)
    if context is None:
        context = contexts[task.spec.session_id] = SessionContext(task.spec)
    if where is not None:
        context.where = where
    return context.run(task)
