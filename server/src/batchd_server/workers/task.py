"""What a worker is asked to do and what it answers: fill one slot with one batch.

Tasks and results are small, picklable dataclasses: a task names the session (its sources,
ring and pipeline), the batch, the slot and the batch's sample positions; the result says
how many rows were filled, each field's final shape and which samples failed. Sample data
never travels through a pipe: the worker reads each source's catalog arrays from a read-only
shared-memory segment and writes every field of every sample straight into the session's
ring (``context.py``; NOTE [ Slot lifecycle ] in ``batchd_server/sessions/slots.py``).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any, Final

from batchd_server.catalog.types import DatasetRef
from batchd_server.decode_cache.worker import CacheCounts, DecodeCacheSpec
from batchd_server.limits import MAX_SAMPLE_BYTES
from batchd_server.planning.packing import PackOptions
from batchd_server.storage.cache import NodeCacheCounts
from batchd_server.storage.options import StoreOptions

__all__ = [
    "ROW_FIELDS",
    "SOURCE_FIELD",
    "BatchResult",
    "BatchTask",
    "Filled",
    "ReadOptions",
    "SampleFailure",
    "SessionSpec",
    "SlotField",
    "SourceSpec",
    "StageTimes",
]

ROW_FIELDS: Final = ("sample_id", "label")
"""The fields a worker fills itself in every batch, beside the pipeline's: each row's sample
id and label (int64)."""
SOURCE_FIELD: Final = "source"
"""The field of each row's source index (int64), in the batches of a session whose
``Mixing.labels_rows`` (a mix's)."""


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
class SourceSpec:
    """One source of a session (its one split, or one of a mix's), as a worker opens it."""

    catalog_segment: str
    """The source's split arrays (``catalog_cache``)."""
    root: str
    """The dataset's root: its sample paths are relative to it."""
    start: int = 0
    """The source's first position: a task's positions are global over the sources' rows
    concatenated in order."""
    pipeline_kind: str = ""
    """The source's own pipeline; "" decodes it with the session's."""
    pipeline_options: dict[str, Any] = field(default_factory=dict)
    parquet_payload: str = ""
    """The dataset's Parquet payload column (``image.bytes``); "" when it has no Parquet rows."""
    dataset: DatasetRef | None = None
    """The dataset's catalog row: with a sample's row (path, range, id), what identifies an
    object's bytes in the decode cache's keys."""


@dataclass(frozen=True)
class ReadOptions:
    """How a server's workers read and decode samples: made once from the configuration at
    the composition root (``assembly.py``) and carried to the workers on every task's
    :class:`SessionSpec` (a worker is spawned before any session and knows nothing of the
    server's configuration)."""

    max_sample_bytes: int = MAX_SAMPLE_BYTES
    """The most bytes one sample may have (``--max-sample-bytes``); more is ``too_large``."""
    store: StoreOptions = field(default_factory=StoreOptions)
    """The object-store settings, for sources whose root is a store's."""
    decode_cache: DecodeCacheSpec | None = None
    """The server's decode cache; None when it has none (or, on a session's spec, the
    session opted out)."""

    def for_session(self, *, decode_cache: bool) -> ReadOptions:
        """These options for a session that asked for the decode cache or opted out."""
        return self if decode_cache else replace(self, decode_cache=None)


@dataclass(frozen=True)
class SessionSpec:
    """What a worker needs to know about a session; sent with every task (a few hundred bytes)."""

    session_id: str
    pipeline_kind: str
    pipeline_options: dict[str, Any]
    """The session's pipeline: it decodes every source without one of its own, and
    finishes every batch."""
    ring_segment: str
    header_bytes: int
    slot_bytes: int
    fields: tuple[SlotField, ...]
    batch_size: int
    seed: int
    on_error: str
    sources: tuple[SourceSpec, ...]
    """Every source, in order; one for a session on one split."""
    shm_dir: str = "/dev/shm"
    dataset: str = ""
    """The dataset's name: the label of the worker-timing metrics (never the session's id)."""
    client: str = ""
    """The client that opened the session (its quotas' identity): the pool's queue serves
    clients in turn (``fair_queue.py``), not sessions."""
    read: ReadOptions = field(default_factory=ReadOptions)
    """How its samples are read and decoded (the server's, less what the session opted out
    of)."""
    pack: PackOptions | None = None
    """A packed session's packing (``workers/packed.py``): its tasks carry pieces, not
    positions. None: not packed."""

    def __post_init__(self) -> None:
        assert self.sources and self.sources[0].start == 0, "sources start at position 0"

    @property
    def decode_cache(self) -> DecodeCacheSpec | None:
        """The decode cache its workers use; None: none."""
        return self.read.decode_cache

    @property
    def root(self) -> str:
        """The first source's dataset root: where a stalled file system is looked for."""
        return self.sources[0].root


@dataclass(frozen=True)
class BatchTask:
    spec: SessionSpec
    epoch: int
    batch_index: int
    slot: int
    positions: bytes
    """The batch's sample positions, int64, global over the session's sources (a source's
    row r is ``SourceSpec.start + r``). A packed session's: its pieces, four int64 each
    (row of the batch, position, first token, tokens; ``workers/packed.py``)."""
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
    node_cache: NodeCacheCounts | None = None
    """What the worker read through the node cache of object-store bytes since its previous
    result (None: nothing)."""


Filled = tuple[
    int, dict[str, tuple[int, ...]], list["SampleFailure"], bool, tuple[float, float, float, float]
]
"""What a fill of a task's slot did (``workers/context.py``, ``workers/packed.py``): the rows
filled, each field's shape, the failures, whether the batch must fail, and its
``StageTimes`` (started_at, read_s, decode_s, collate_s); the worker adds the caches' counts."""


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
    cache: CacheCounts = field(default_factory=CacheCounts, compare=False)
    """The decode cache's hits and misses on this batch."""
