"""A worker's side of a weighted mix: one task's rows come from several splits.

A mixed session's task positions are global over its sources concatenated in order
(NOTE [ Mixed order ] in ``batchd_server/mixing.py``); the plan groups each batch's rows by
source. :class:`MixedContext` is a :class:`SessionContext` that holds every source's catalog
arrays and files and, for each run of rows of one source, points the context at that source
and fills the run's rows with the context's own code (one vectorised read for byte-range
records, else sample by sample). The ring is the session's; each source decodes with the
session's pipeline or its own (same fields: ``sessions/sources.check_source_pipelines``),
and the session's pipeline finishes the batch. A replacement under ``on_error="replace"``
is drawn from the bad sample's own source. Each row's source index goes into the batch's
``source`` field.
"""

from __future__ import annotations

import itertools
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

from batchd_server.pipelines.base import Pipeline
from batchd_server.pipelines.files import SampleFiles
from batchd_server.pipelines.registry import build_pipeline
from batchd_server.shm.arrays import attach_arrays
from batchd_server.shm.segments import Attachment
from batchd_server.workers.task import (
    BatchResult,
    BatchTask,
    SampleFailure,
    SessionContext,
    SessionSpec,
    StageTimes,
    run_batch,
)

__all__ = ["MixedContext", "run_task"]

_COLUMNS = (
    "ids",
    "labels",
    "lengths",
    "byte_offsets",
    "byte_lengths",
    "path_bytes",
    "path_offsets",
)
"""The catalog columns a context reads: ``SessionContext``'s attributes and the names of the
arrays in a catalog segment."""


@dataclass(eq=False)
class _Source:
    columns: dict[str, npt.NDArray[Any]]
    files: SampleFiles
    attachment: Attachment | None
    """None for the first source, whose mapping the base context owns."""
    pipeline: Pipeline


class MixedContext(SessionContext):
    """A worker's open handles for a mixed session: every source's catalog arrays and files,
    one ring and one pipeline."""

    def __init__(self, spec: SessionSpec) -> None:
        assert spec.sources, "a mixed session has sources"
        first = spec.sources[0]
        assert (first.catalog_segment, first.root, first.start) == (
            spec.catalog_segment,
            spec.root,
            0,
        ), "the spec's own catalog is the first source"
        super().__init__(spec)
        self._session_pipeline = self.pipeline
        self._sources = [
            _Source(
                {name: getattr(self, name) for name in _COLUMNS},
                self.files,
                None,
                self._pipeline_of(first.pipeline_kind, first.pipeline_options),
            )
        ]
        try:
            for source in spec.sources[1:]:
                arrays, attachment = attach_arrays(
                    source.catalog_segment, shm_dir=Path(spec.shm_dir)
                )
                try:
                    files = SampleFiles(source.root)
                except BaseException:
                    arrays.clear()
                    attachment.close()
                    raise
                columns = {name: arrays[name] for name in _COLUMNS}
                pipeline = self._pipeline_of(source.pipeline_kind, source.pipeline_options)
                self._sources.append(_Source(columns, files, attachment, pipeline))
        except BaseException:
            self.close()
            raise
        self._starts = np.array([s.start for s in spec.sources], np.int64)

    def _pipeline_of(self, kind: str, options: dict[str, Any]) -> Pipeline:
        return build_pipeline(kind, options) if kind else self._session_pipeline

    def _use(self, index: int) -> None:
        """Point the context's catalog arrays, files and pipeline at source ``index``."""
        source = self._sources[index]
        for name, column in source.columns.items():
            setattr(self, name, column)
        self.files = source.files
        self.pipeline = source.pipeline
        self._offset = int(self._starts[index]) if index else 0

    def run(self, task: BatchTask) -> BatchResult:
        started_at = time.monotonic()
        self._read_s = self._decode_s = 0.0
        positions = np.frombuffer(task.positions, np.int64)
        block = self.slot_block(task.slot)
        source_of = np.searchsorted(self._starts, positions, side="right") - 1
        # Runs of rows from one source (the plan groups a batch by source: one run each).
        cuts = np.flatnonzero(np.diff(source_of)) + 1
        bounds = [0, *cuts.tolist(), len(positions)]
        for source in self._sources:
            source.files.begin_batch()
        self._hung = frozenset(task.hung)  # positions of the task, as ``where`` reports them
        self.where[0] = -1
        one_by_one = task.one_by_one or bool(task.hung)
        rows = 0
        failures: list[SampleFailure] = []
        fatal = False
        view: dict[str, npt.NDArray[Any]] = {}
        for a, b in itertools.pairwise(bounds):
            index = int(source_of[a])
            self._use(index)
            local = positions[a:b] - self._starts[index]
            # The run's rows start where the previous run's ended (after skipped samples).
            view = {name: array[rows:] for name, array in block.items() if name != "source"}
            got = None if one_by_one else self._read_records(local, view)
            if got is None:
                got, run_failures, fatal = self._decode_each(task, local, view)
                failures += run_failures
            block["source"][rows : rows + got] = index
            rows += got
            if fatal:
                break
        self._use(0)
        self.where[0] = -1
        finish_start = time.perf_counter()
        ours = ("sample_id", "label", "source")
        pipeline_block = {k: v for k, v in block.items() if k not in ours}
        shapes = self._session_pipeline.finish(pipeline_block, rows)
        shapes.update((name, (rows,)) for name in ours)
        del block, pipeline_block, view  # no view of the ring may outlive the task
        times = StageTimes(
            started_at=started_at,
            read_s=self._read_s,
            decode_s=self._decode_s,
            collate_s=time.perf_counter() - finish_start,
        )
        return BatchResult(task.batch_index, task.slot, rows, shapes, failures, fatal, times)

    def close(self) -> None:
        sources = getattr(self, "_sources", [])
        if sources:
            self._use(0)
            self.pipeline = self._session_pipeline
        for source in sources[1:]:
            source.columns.clear()
            source.files.close()
            assert source.attachment is not None, "every source but the first owns its mapping"
            source.attachment.close()
        sources.clear()
        super().close()


def run_task(
    contexts: dict[str, SessionContext],
    task: BatchTask,
    where: npt.NDArray[np.int64] | None = None,
) -> BatchResult:
    """Fill ``task``'s slot, opening the session's handles (a mix's too) on its first task
    here; ``where`` as ``run_batch`` takes it."""
    if task.spec.sources and task.spec.session_id not in contexts:
        contexts[task.spec.session_id] = MixedContext(task.spec)
    return run_batch(contexts, task, where)
