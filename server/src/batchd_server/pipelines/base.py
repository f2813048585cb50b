"""What every decode pipeline is: the fields it fills and how it fills one sample's row.

A worker holds a batch's slot as one view per field, shaped ``(batch_size, *field.shape)``,
and calls :meth:`Pipeline.decode_into` once per sample with that sample's row of every
field. The pipeline writes the row in place (no intermediate batch, no collate copy) or
raises :class:`BadSample`; the worker applies the session's ``on_error`` policy. After the
last row, :meth:`Pipeline.finish` may rearrange the filled rows (tokens pad to the batch's
longest) and says each field's final shape. ``sample_id`` and ``label`` are added by the
worker, not by pipelines.

Samples that are byte ranges of shard files (small records) may instead be decoded a batch at
a time: the worker reads every range of the batch in a few reads and offers them all to
:meth:`Pipeline.decode_batch`, which fills rows ``0..n-1`` without a Python call per sample.
A pipeline that cannot (the default), or a batch with a sample that is not right, is decoded
one sample at a time, which is also how each bad sample is found and reported.
"""

from __future__ import annotations

import hashlib
import math
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np
import numpy.typing as npt

from batchd_server.pipelines.types import Bytes, Offsets

__all__ = ["BadSample", "Block", "FieldSpec", "Pipeline", "SampleInfo", "sample_rng"]

Block = dict[str, npt.NDArray[Any]]
"""Field name → array. For a batch: ``(batch_size, *shape)``; for one row: ``shape``."""


@dataclass(frozen=True)
class FieldSpec:
    """One field of every batch."""

    name: str
    dtype: np.dtype[Any]
    shape: tuple[int, ...]
    """One sample's shape; for padded fields the largest it can be."""

    def sample_bytes(self) -> int:
        """Bytes one sample takes at most."""
        return math.prod(self.shape) * self.dtype.itemsize  # Python ints: cannot overflow


def sample_rng(seed: int, epoch: int, sample_id: int) -> np.random.Generator:
    """The random stream of one sample in one epoch: the same whichever worker decodes it."""
    key = hashlib.blake2b(f"{seed}:{epoch}:{sample_id}".encode(), digest_size=16).digest()
    return np.random.Generator(np.random.PCG64(int.from_bytes(key, "little")))


@dataclass(frozen=True)
class SampleInfo:
    """What a pipeline may know about the sample it decodes."""

    sample_id: int
    label: int
    """-1 when the catalog has none."""
    path: str
    """Relative to the dataset root, for messages."""
    length: int
    """The catalog's sequence length, -1 when it has none."""
    seed: int
    epoch: int

    def rng(self) -> np.random.Generator:
        """This sample's augmentation randomness for this epoch (see :func:`sample_rng`)."""
        return sample_rng(self.seed, self.epoch, self.sample_id)


class BadSample(Exception):
    """A sample that cannot be served: the worker applies ``on_error`` instead of crashing.

    ``kind`` is one of :data:`KINDS`; it becomes ``sample_errors.kind`` in the catalog and a
    label of the errors metric.
    """

    KINDS: ClassVar[tuple[str, ...]] = (
        "missing",  # no such file
        "unreadable",  # permission, I/O error, byte range past the end of the file
        "too_large",  # more bytes than a sample may have (--max-sample-bytes): a sparse file?
        "bad_range",  # a byte range that ends past 2**63 - 1 (ingested with --no-verify)
        "unsafe_path",  # absolute, "..", or a symlink leading out of the dataset root
        "corrupt",  # not decodable as the pipeline's format
        "shape",  # decodes, but not to the shape/dtype the pipeline promised
        "decoder",  # a custom decoder raised something else
        "transient",  # an I/O error that is usually passing (EIO, ESTALE...), on every retry
        "timeout",  # reading or decoding it hung past the task deadline, twice
        "truncated",  # media whose stream ends before the frames or samples it must give
        "empty",  # media with no frames or no audio samples at all
        "missing_field",  # a sample of several fields has none of a required one
    )

    def __init__(self, kind: str, message: str) -> None:
        assert kind in self.KINDS, kind
        super().__init__(message)
        self.kind = kind


class Pipeline(ABC):
    """A decode pipeline, built in the worker from the session's spec and reused per batch.

    Instances must be cheap to build and hold no per-batch state between
    :meth:`decode_into` calls of different batches (only what :meth:`finish` needs).
    """

    @abstractmethod
    def fields(self) -> list[FieldSpec]:
        """The fields this pipeline fills, in slot order (without sample_id and label)."""

    @abstractmethod
    def decode_into(self, data: memoryview, sample: SampleInfo, row: Block) -> None:
        """Decode one sample's bytes into its row of every field.

        ``data`` is only valid during the call (the worker reuses its buffer).

        Raises:
            BadSample: The bytes are not a valid sample for this pipeline.
        """

    def decode_batch(self, data: Bytes, starts: Offsets, lengths: Offsets, block: Block) -> bool:
        """Decode samples ``0..n-1`` into rows ``0..n-1`` of ``block`` at once, if possible.

        Sample ``i``'s bytes are ``data[starts[i]:starts[i] + lengths[i]]`` (all inside
        ``data``, which is only valid during the call).

        Returns:
            True when every row was written as :meth:`decode_into` would have written it.
            False when this pipeline has no batch path or some sample is not one it can
            decode as a batch (rows may have been written): the worker then decodes the batch
            sample by sample, which finds and reports the bad ones. Never raises BadSample.
        """
        return False

    def finish(self, block: Block, rows: int) -> dict[str, tuple[int, ...]]:
        """Called once after rows ``0..rows-1`` of ``block`` were filled.

        Returns each field's final shape, batch dimension first. A field may be rewritten in
        place as a C-contiguous array of that shape starting at the field's first byte.
        """
        return {f.name: (rows, *f.shape) for f in self.fields()}
