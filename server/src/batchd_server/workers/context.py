"""How a worker fills a slot: one session's open handles, over each of its sources.

A session serves one or more sources (a split, or a mix's splits). Its task positions are
global over the sources' rows concatenated in order, and the plan groups each batch's rows
by source (NOTE [ Mixed order ] in ``planning/mixing.py``), so a batch is a few runs of rows
of one source each, one run for a session on one split. Each run is filled with its
source's catalog columns and fields (``workers/fields.py``: each field's rows come from one
:class:`~batchd_server.workers.rows.RowReader`, whatever the bytes are: byte ranges of files,
tar members or objects, rows of Parquet files): a run is read and decoded in one go where
its reader and pipeline can (``RowReader.read_batch``, ``Pipeline.decode_batch``), sample by
sample otherwise; the session's pipeline then finishes the whole batch. A replacement under
``on_error="replace"`` is drawn from the bad sample's own source. Where the layout has a
``source`` field (a mix's batches), each row's source index goes there.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

import numpy as np
import numpy.typing as npt

from batchd._wire.ring import slot_offset
from batchd_server.catalog.types import SampleColumns
from batchd_server.decode_cache.worker import CacheCounts, SampleCache
from batchd_server.pipelines.base import BadSample, Block, Pipeline, SampleInfo, sample_rng
from batchd_server.pipelines.registry import build_pipeline
from batchd_server.shm.arrays import attach_arrays
from batchd_server.shm.segments import Attachment, attach
from batchd_server.storage.cache import STATS as CACHE_STATS
from batchd_server.workers.field_rows import ColumnRows
from batchd_server.workers.fields import SampleField, open_fields
from batchd_server.workers.packed import packed_fill, session_pipeline
from batchd_server.workers.rows import RowReader, sample_path
from batchd_server.workers.task import (
    ROW_FIELDS,
    SOURCE_FIELD,
    BatchResult,
    BatchTask,
    Filled,
    SampleFailure,
    SessionSpec,
    SourceSpec,
    StageTimes,
)

__all__ = ["SessionContext", "run_batch"]

_REPLACE_ATTEMPTS: Final = 8
"""Substitutes tried for one bad sample under on_error="replace" before it is skipped."""
_OWN_FIELDS: Final = (*ROW_FIELDS, SOURCE_FIELD)
"""Fields the context fills, not the pipeline (``source`` only where the layout has it)."""


@dataclass(eq=False)
class _Source:
    """One source's open handles in a worker: its catalog columns and its samples' fields."""

    start: int
    """Its first task position."""
    columns: SampleColumns
    fields: tuple[SampleField, ...]
    """Its samples' fields: the payload, or each of several (``workers/fields.py``)."""
    attachment: Attachment

    def path(self, position: int) -> str:
        return sample_path(self.columns, position)

    def describe(self, position: int) -> str:
        """Sample ``position`` for messages: its path, and its place in it."""
        return self.fields[0].rows.describe(position)

    def begin_batch(self) -> None:
        for f in self.fields:
            f.rows.begin_batch()

    def close(self) -> None:
        for f in self.fields:
            f.rows.close()
        self.attachment.close()


class SessionContext:
    """A worker's open handles for one session: every source's catalog columns and fields
    (their row readers and pipelines), the ring's mapping and the session's pipeline."""

    def __init__(self, spec: SessionSpec) -> None:
        self.spec = spec
        decoder = build_pipeline(spec.pipeline_kind, spec.pipeline_options)
        self._decoder = decoder
        """What decodes every source without a pipeline of its own."""
        self.pipeline: Pipeline = session_pipeline(decoder, spec.pack)
        """The session's: it finishes every batch (a packed session's fills it)."""
        self._fill = packed_fill(self, self.pipeline) or self._fill_rows
        """How a task's slot is filled: rows of samples, or the session pipeline's own."""
        decode_cache = spec.read.decode_cache
        self._cache = SampleCache(decode_cache) if decode_cache is not None else None
        self._sources: list[_Source] = []
        self._ring: Attachment | None = None
        try:
            for source in spec.sources:
                self._sources.append(self._open(source))
            self._ring = attach(spec.ring_segment, writable=True, shm_dir=Path(spec.shm_dir))
        except BaseException:
            self.close()
            raise
        self._later_starts = np.array([s.start for s in self._sources[1:]], np.int64)
        """Every source's first position but the first's (which is 0)."""
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
        self._one_by_one = False
        """The current task reads each sample on its own (a redo after a hang)."""

    def _open(self, source: SourceSpec) -> _Source:
        arrays, attachment = attach_arrays(source.catalog_segment, shm_dir=Path(self.spec.shm_dir))
        try:
            pipeline = self._decoder
            if source.pipeline_kind:
                pipeline = build_pipeline(source.pipeline_kind, source.pipeline_options)
            columns = SampleColumns.of(arrays)
            fields = open_fields(source, columns, pipeline, self._cache, self.spec.read, arrays)
            return _Source(source.start, columns, fields, attachment)
        except BaseException:
            attachment.close()
            raise

    def slot_block(self, slot: int) -> Block:
        """Every field of ``slot`` as a ``(batch_size, *shape)`` array over the ring."""
        cached = self._blocks.get(slot)
        if cached is None:
            cached = self._blocks[slot] = self._make_block(slot)
        return dict(cached)

    def _make_block(self, slot: int) -> Block:
        assert self._ring is not None, "the ring is mapped while the context is open"
        base = slot_offset(slot, self.spec.slot_bytes, self.spec.header_bytes)
        block: Block = {}
        for f in self.spec.fields:
            count = self.spec.batch_size * int(np.prod(f.shape, dtype=np.int64))
            flat = np.frombuffer(self._ring.buf, np.dtype(f.dtype), count, base + f.offset)
            block[f.name] = flat.reshape(self.spec.batch_size, *f.shape)
        return block

    def close(self) -> None:
        """Drop every handle; views into the mappings must be gone already. Idempotent."""
        self._blocks = {}
        sources, self._sources = self._sources, []
        for source in sources:
            source.close()
        if self._ring is not None:
            self._ring.close()

    # -- filling a slot -----------------------------------------------------------------

    def locate(self, position: int) -> tuple[_Source, int]:
        """The source of a task position, and the position's row in it."""
        index = int(np.searchsorted(self._later_starts, position, side="right"))
        source = self._sources[index]
        return source, position - source.start

    def piece_ids(
        self, positions: npt.NDArray[np.int64]
    ) -> tuple[npt.NDArray[np.int64], npt.NDArray[np.int64], npt.NDArray[np.int64]]:
        """Each task position's sample id, label and source index."""
        ids = np.empty(positions.size, np.int64)
        labels = np.empty(positions.size, np.int64)
        index = np.searchsorted(self._later_starts, positions, side="right")
        for s, source in enumerate(self._sources):
            mine = index == s
            local = positions[mine] - source.start
            ids[mine] = source.columns.ids[local]
            labels[mine] = source.columns.labels[local]
        return ids, labels, index.astype(np.int64)

    def run(self, task: BatchTask) -> BatchResult:
        for source in self._sources:
            source.begin_batch()
        rows, shapes, failures, fatal, times = self._fill(task)
        # What the task read through the node cache and the decode cache comes with it.
        started_at, read_s, decode_s, collate_s = times
        stages = StageTimes(started_at, read_s, decode_s, collate_s, CACHE_STATS.take() or None)
        counts = self._cache.take_counts() if self._cache is not None else CacheCounts()
        return BatchResult(
            task.batch_index, task.slot, rows, shapes, failures, fatal, stages, counts
        )

    def _fill_rows(self, task: BatchTask) -> Filled:
        """Fill ``task``'s slot with one row per sample position."""
        started_at = time.monotonic()
        self._read_s = self._decode_s = 0.0
        positions = np.frombuffer(task.positions, np.int64)
        block = self.slot_block(task.slot)
        self._hung = frozenset(task.hung)  # task positions, as ``where`` reports them
        self.where[0] = -1
        one_by_one = task.one_by_one or bool(task.hung)
        self._one_by_one = one_by_one
        source_column = block.get(SOURCE_FIELD)
        fill = {name: array for name, array in block.items() if name != SOURCE_FIELD}
        rows = 0
        failures: list[SampleFailure] = []
        fatal = False
        for index, local in self._runs(positions):
            source = self._sources[index]
            # A run's rows start where the previous run's ended (after skipped samples).
            view = {name: array[rows:] for name, array in fill.items()} if rows else fill
            got = None if one_by_one else self._read_records(source, local, view)
            if got is None:
                got, run_failures, fatal = self._decode_each(source, task.epoch, local, view)
                failures += run_failures
            if source_column is not None:
                source_column[rows : rows + got] = index
            rows += got
            if fatal:
                break
        self.where[0] = -1
        finish_start = time.perf_counter()
        ours = [name for name in _OWN_FIELDS if name in block]
        pipeline_block = {k: v for k, v in block.items() if k not in ours}
        shapes = self.pipeline.finish(pipeline_block, rows)
        shapes.update((name, (rows,)) for name in ours)
        # No view of the ring may outlive the task.
        del block, pipeline_block, fill, source_column
        collate_s = time.perf_counter() - finish_start
        return rows, shapes, failures, fatal, (started_at, self._read_s, self._decode_s, collate_s)

    def _runs(self, positions: npt.NDArray[np.int64]) -> Iterator[tuple[int, npt.NDArray[Any]]]:
        """The task's positions as runs of one source each: (source index, the run's rows in
        that source). The plan groups a batch by source, so each source has one run."""
        if positions.size == 0:
            return
        source_of = np.searchsorted(self._later_starts, positions, side="right")
        cuts = np.flatnonzero(source_of[1:] != source_of[:-1]) + 1
        for a, b in itertools.pairwise([0, *cuts.tolist(), positions.size]):
            index = int(source_of[a])
            start = self._sources[index].start
            yield index, positions[a:b] - start if start else positions[a:b]

    def _read_records(
        self, source: _Source, positions: npt.NDArray[np.int64], block: Block
    ) -> int | None:
        """A run of samples read at once and decoded in one go (``RowReader.read_batch``,
        ``Pipeline.decode_batch``), no Python call per sample. None when the run does not
        qualify or a sample in it is not right; then each sample is read on its own, which
        also finds and reports whichever sample is bad."""
        for f in source.fields:
            if not f.batches:
                return None
            read_start = time.perf_counter()
            gathered = f.rows.read_batch(positions)
            self._read_s += time.perf_counter() - read_start
            if gathered is None:
                return None
            data, starts, lengths, numbers = gathered
            pipeline = f.numbers if numbers and f.numbers is not None else f.pipeline
            decode_start = time.perf_counter()
            decoded = pipeline.decode_batch(data, starts, lengths, f.block(block))
            self._decode_s += time.perf_counter() - decode_start
            if not decoded:
                return None
        rows = len(positions)
        for f in source.fields:
            if f.view is not None:
                f.view.mark(block, slice(0, rows), True)
        block["sample_id"][:rows] = source.columns.ids[positions]
        block["label"][:rows] = source.columns.labels[positions]
        return rows

    def _decode_one(self, source: _Source, position: int, epoch: int, row: Block) -> None:
        self.where[0] = source.start + position
        columns = source.columns
        sample_id = int(columns.ids[position])
        info = SampleInfo(
            sample_id=sample_id,
            label=int(columns.labels[position]),
            path=source.path(position),
            length=int(columns.lengths[position]),
            seed=self.spec.seed,
            epoch=epoch,
        )
        if source.start + position in self._hung:
            raise BadSample(
                "timeout",
                f"{info.path}: reading or decoding it hung past the server's task deadline "
                "(--task-timeout-s) twice, and the worker was killed each time; check the "
                "file and the file system it is on",
            )
        offset, length = int(columns.byte_offsets[position]), int(columns.byte_lengths[position])
        read_s = 0.0
        start = time.perf_counter()
        try:
            for f in source.fields:

                def read(rows: RowReader = f.rows) -> memoryview:
                    nonlocal read_s
                    read_start = time.perf_counter()
                    try:
                        return rows.read(position)
                    finally:
                        read_s += time.perf_counter() - read_start

                if f.view is None:
                    where, into = (offset, length), row
                else:  # one of several fields: its own range, its own arrays
                    where, into = self._field_range(f, position, offset, length), f.block(row)
                try:
                    pipeline, cached = f.decoder(position)
                    if cached is not None:
                        cached.decode(info, where[0], where[1], read, into)
                    else:
                        pipeline.decode_into(read(), info, into)
                except BadSample as e:
                    if f.view is None or not f.view.optional or e.kind != "missing_field":
                        raise
                    f.view.mark(row, (), False)
                    continue
                if f.view is not None:
                    f.view.mark(row, (), True)
            row["sample_id"][...] = sample_id
            row["label"][...] = info.label
        finally:
            self._read_s += read_s
            self._decode_s += time.perf_counter() - start - read_s

    @staticmethod
    def _field_range(f: SampleField, position: int, offset: int, length: int) -> tuple[int, int]:
        """Where field ``f`` of sample ``position`` is, for the decode cache's key: its own
        member's range, or (a Parquet column) its column's chunk."""
        if f.columns is not None:
            return int(f.columns.byte_offsets[position]), int(f.columns.byte_lengths[position])
        if isinstance(f.rows, ColumnRows):
            return f.rows.range_of(position)
        return offset, length

    def _decode_each(
        self, source: _Source, epoch: int, positions: npt.NDArray[np.int64], block: Block
    ) -> tuple[int, list[SampleFailure], bool]:
        policy = self.spec.on_error
        failures: list[SampleFailure] = []
        rows = 0
        read_start = time.perf_counter()
        together = positions.size >= 2 and not self._one_by_one
        for f in source.fields:
            f.read_ahead(source.columns, positions, together=together)
        self._read_s += time.perf_counter() - read_start
        for position in positions.tolist():
            row = {name: array[rows, ...] for name, array in block.items()}
            try:
                self._decode_one(source, position, epoch, row)
                rows += 1
                continue
            except BadSample as e:
                sample_id = int(source.columns.ids[position])
                failure = SampleFailure(sample_id, source.describe(position), e.kind, str(e))
            if policy == "raise":
                return rows, [failure], True
            if policy == "replace":
                substitute = self._replace(source, sample_id, epoch, row, failures)
                failure = SampleFailure(
                    failure.sample_id, failure.path, failure.kind, failure.message, substitute
                )
                if substitute is not None:
                    rows += 1
            failures.append(failure)
        return rows, failures, False

    def _replace(
        self, source: _Source, sample_id: int, epoch: int, row: Block, failures: list[SampleFailure]
    ) -> int | None:
        """Decode a substitute from the bad sample's source, drawn from (seed, epoch, sample
        id), into ``row``."""
        rng = sample_rng(self.spec.seed, epoch, sample_id)
        ids = source.columns.ids
        for _ in range(_REPLACE_ATTEMPTS):
            position = int(rng.integers(len(ids)))
            try:
                self._decode_one(source, position, epoch, row)
            except BadSample as e:
                failures.append(
                    SampleFailure(int(ids[position]), source.describe(position), e.kind, str(e))
                )
                continue
            return int(ids[position])
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
