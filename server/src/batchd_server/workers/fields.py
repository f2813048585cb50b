"""A sample as fields: each has a source of bytes (a :class:`~batchd_server.workers.rows.RowReader`)
and what decodes them (a pipeline, through the decode cache where it applies).

A sample of one field has its payload: a file, a tar member, an object or a Parquet column,
decoded by the source's pipeline. A sample of several fields (an image and its caption, a
clip's video and audio: ``pipelines/fields.py``) is one :class:`SampleField` per field, each
with its own reader (``workers/field_rows.py``: a tar member by extension, a Parquet
column), pipeline and place in the batch; nothing in the fill (``workers/context.py``)
branches on what a field's bytes are. :func:`open_fields` is the one place that picks a
field's reader, by the source: byte-range rows over the root's reader (``storage/open.py``
picks that by its scheme), or Parquet rows when the dataset has a payload column.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

from batchd_server.catalog.types import SampleColumns, member_names
from batchd_server.decode_cache.keys import catalog_name
from batchd_server.decode_cache.worker import CachedSource, SampleCache
from batchd_server.parquet.rows import ParquetRows
from batchd_server.pipelines.array import ArrayPipeline
from batchd_server.pipelines.base import Block, Pipeline
from batchd_server.pipelines.fields import FieldsPipeline, FieldView
from batchd_server.pipelines.text import TextPipeline
from batchd_server.pipelines.tokens import TokensPipeline
from batchd_server.storage.open import open_reader
from batchd_server.storage.reader import SampleReader
from batchd_server.workers.field_rows import ColumnRows, MemberRows, member_columns
from batchd_server.workers.parquet_rows import ParquetRowReader
from batchd_server.workers.rows import Positions, RangeRows, RowReader
from batchd_server.workers.task import ReadOptions, SourceSpec

__all__ = ["SampleField", "open_fields"]


@dataclass(eq=False)
class SampleField:
    """One field of a source's samples: where its bytes come from and what decodes them."""

    rows: RowReader
    pipeline: Pipeline
    cached: CachedSource | None = None
    """Its samples through the decode cache; None when they are not cached."""
    numbers: Pipeline | None = None
    """What decodes a row whose bytes are raw numbers (``RowReader.numeric``); None: the
    field's rows never are."""
    numbers_cached: CachedSource | None = None
    view: FieldView | None = None
    """One field of several: its pipeline's outputs under their names in the batch, and
    whether it is optional; None for the one field of a sample (the payload)."""
    columns: SampleColumns | None = None
    """Where its bytes are when not at the sample's own range (a tar member's); None: there."""

    def __post_init__(self) -> None:
        decoder = self.numbers or self.pipeline
        self.batches = type(decoder).decode_batch is not Pipeline.decode_batch
        """Whether a run of rows may be read and decoded at once (the pipeline has a batch
        path): otherwise its rows are read one by one."""

    def block(self, block: Block) -> Block:
        """``block`` (a batch's or a row's) as this field's pipeline names its arrays."""
        return block if self.view is None else self.view.inner(block)

    def read_ahead(self, columns: SampleColumns, positions: Positions, *, together: bool) -> None:
        """Fetch ahead what these rows will read (``RowReader.read_ahead``): through the
        decode cache, only the rows it does not hold, where it can tell
        (``CachedSource.to_fetch``)."""
        skip_cached = False
        columns = self.columns or columns
        if self.cached is not None:
            positions, skip_cached = self.cached.to_fetch(columns, positions)
        self.rows.read_ahead(positions, together=together, decoded_cached=skip_cached)

    def decoder(self, position: int) -> tuple[Pipeline, CachedSource | None]:
        """What decodes row ``position``'s bytes, and through which cache.

        Raises:
            BadSample: the row cannot be read (to tell what its bytes are).
        """
        if self.numbers is None or not self.rows.numeric(position):
            return self.pipeline, self.cached
        return self.numbers, self.numbers_cached


def open_fields(
    source: SourceSpec,
    columns: SampleColumns,
    pipeline: Pipeline,
    cache: SampleCache | None,
    read: ReadOptions,
    arrays: Mapping[str, npt.NDArray[Any]] | None = None,
) -> tuple[SampleField, ...]:
    """The fields of ``source``'s samples, their readers open (``arrays``: the catalog
    segment's, where a field's tar members' ranges are).

    Raises:
        FailedPrecondition: the source's root cannot be read here.
    """
    dataset = "" if source.dataset is None else catalog_name(source.dataset)
    if isinstance(pipeline, FieldsPipeline):
        # A reader each (its own read-ahead and staging); what is open is closed on a failure.
        fields: list[SampleField] = []
        try:
            for view in pipeline.views:
                fields.append(_open_field(view, source, columns, cache, read, dataset, arrays))
        except BaseException:
            for f in fields:
                f.rows.close()
            raise
        return tuple(fields)
    reader = open_reader(source.root, max_sample_bytes=read.max_sample_bytes, store=read.store)
    ranges = RangeRows(reader, columns)
    cached = CachedSource.of(cache, pipeline, source.root, dataset)
    if not len(columns) or columns.row_groups.max() < 0:
        return (SampleField(ranges, pipeline, cached),)
    if not source.parquet_payload:
        return (SampleField(ParquetRowReader(None, ranges), pipeline, cached),)
    parquet, pipeline, numbers = _parquet_rows(
        reader, source.parquet_payload, pipeline, read.max_sample_bytes
    )
    numbers_cached = (
        cached if numbers is pipeline else CachedSource.of(cache, numbers, source.root, dataset)
    )
    return (
        SampleField(ParquetRowReader(parquet, ranges), pipeline, cached, numbers, numbers_cached),
    )


def _parquet_rows(
    reader: SampleReader, column: str, pipeline: Pipeline, max_bytes: int
) -> tuple[ParquetRows, Pipeline, Pipeline]:
    """A Parquet source's row reader, the pipeline of its values' bytes and the pipeline of
    its numeric values: those arrive as raw numbers of the pipeline's own dtype (an array
    pipeline reads them raw); a string column's values arrive as their UTF-8 bytes."""
    if isinstance(pipeline, TextPipeline):
        text = pipeline.utf8()
        return ParquetRows(reader, column, None, max_bytes), text, text
    if isinstance(pipeline, ArrayPipeline):
        raw = pipeline if pipeline.raw else ArrayPipeline(pipeline.shape, pipeline.dtype.str, True)
        return ParquetRows(reader, column, pipeline.dtype, max_bytes), pipeline, raw
    if isinstance(pipeline, TokensPipeline):
        return ParquetRows(reader, column, pipeline.dtype, max_bytes), pipeline, pipeline
    return ParquetRows(reader, column, None, max_bytes), pipeline, pipeline


def _open_field(
    view: FieldView,
    source: SourceSpec,
    columns: SampleColumns,
    cache: SampleCache | None,
    read: ReadOptions,
    dataset: str,
    arrays: Mapping[str, npt.NDArray[Any]] | None,
) -> SampleField:
    """One field of several: a Parquet column of a Parquet source's rows, else a tar member
    of each sample's key by extension.

    Raises:
        FailedPrecondition: a tar source whose catalog rows have no member of that extension.
    """
    reader = open_reader(source.root, max_sample_bytes=read.max_sample_bytes, store=read.store)
    pipeline = view.pipeline
    if len(columns) and columns.row_groups.max() >= 0:
        parquet, pipeline, numbers = _parquet_rows(
            reader, view.source, pipeline, read.max_sample_bytes
        )
        cached = CachedSource.of(cache, pipeline, source.root, dataset)
        numbers_cached = (
            cached if numbers is pipeline else CachedSource.of(cache, numbers, source.root, dataset)
        )
        column = ColumnRows(parquet, RangeRows(reader, columns), view.name)
        return SampleField(column, pipeline, cached, numbers, numbers_cached, view)
    ext = view.source.removeprefix(".")
    offsets, lengths = member_names(ext)
    if arrays is not None and offsets in arrays:
        located = member_columns(columns, arrays[offsets], arrays[lengths])
    else:  # no sample has such a member
        none = np.full(len(columns), -1, np.int64)
        located = member_columns(columns, none, none)
    if isinstance(pipeline, TextPipeline):  # a member's text is its UTF-8 bytes
        pipeline = pipeline.utf8()
    cached = CachedSource.of(cache, pipeline, source.root, dataset)
    members = MemberRows(reader, located, view.name, ext)
    return SampleField(members, pipeline, cached, view=view, columns=located)
