"""A sample as fields: each has a source of bytes (a :class:`~batchd_server.workers.rows.RowReader`)
and what decodes them (a pipeline, through the decode cache where it applies).

Today every sample has one field, its payload: a file, a tar member, an object or a Parquet
column, decoded by the source's pipeline. A sample of several fields (an image and its
caption, a clip's video and audio) is more :class:`SampleField` values on the source, each
with its own reader and pipeline; nothing in the fill (``workers/context.py``) branches on
what a field's bytes are. :func:`open_fields` is the one place that picks a field's reader,
by the source: byte-range rows over the root's reader (``storage/open.py`` picks that by its
scheme), or Parquet rows when the dataset has a payload column.
"""

from __future__ import annotations

from dataclasses import dataclass

from batchd_server.catalog.types import SampleColumns
from batchd_server.decode_cache.keys import catalog_name
from batchd_server.decode_cache.worker import CachedSource, SampleCache
from batchd_server.parquet.rows import ParquetRows
from batchd_server.pipelines.array import ArrayPipeline
from batchd_server.pipelines.base import Pipeline
from batchd_server.pipelines.text import TextPipeline
from batchd_server.pipelines.tokens import TokensPipeline
from batchd_server.storage.open import open_reader
from batchd_server.storage.reader import SampleReader
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

    def __post_init__(self) -> None:
        decoder = self.numbers or self.pipeline
        self.batches = type(decoder).decode_batch is not Pipeline.decode_batch
        """Whether a run of rows may be read and decoded at once (the pipeline has a batch
        path): otherwise its rows are read one by one."""

    def read_ahead(self, columns: SampleColumns, positions: Positions, *, together: bool) -> None:
        """Fetch ahead what these rows will read (``RowReader.read_ahead``): through the
        decode cache, only the rows it does not hold, where it can tell
        (``CachedSource.to_fetch``)."""
        skip_cached = False
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
) -> tuple[SampleField, ...]:
    """The fields of ``source``'s samples, their readers open.

    Raises:
        FailedPrecondition: the source's root cannot be read here.
    """
    reader = open_reader(source.root, max_sample_bytes=read.max_sample_bytes, store=read.store)
    ranges = RangeRows(reader, columns)
    dataset = "" if source.dataset is None else catalog_name(source.dataset)
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
