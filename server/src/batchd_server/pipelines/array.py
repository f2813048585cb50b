"""The array pipeline: fixed-shape NumPy data to the ``array`` field.

A sample is either a ``.npy`` (a whole file, or a ``.npy`` blob inside a byte range of a shard
file) or, with ``raw=True``, exactly ``prod(shape) * itemsize`` little-endian bytes. The
``.npy`` header is parsed without unpickling anything: object arrays are refused. Byte order
and Fortran order are converted on the copy into the row, so they cost nothing extra.

Raw records that all live in one file have a vectorised path, :meth:`ArrayPipeline.gather_into`:
one numpy fancy index over a view of the mapped file whose elements are whole records
(``V{record_bytes}`` with a stride of one byte), so a batch of small records costs a few
microseconds instead of one Python call per sample.
"""

from __future__ import annotations

import io
import math
from collections.abc import Sequence
from typing import Any, Final

import numpy as np
import numpy.typing as npt

from batchd_server.errors import FailedPrecondition, InvalidArgument
from batchd_server.pipelines.base import BadSample, Block, FieldSpec, Pipeline, SampleInfo

__all__ = ["MAX_DIMS", "ArrayPipeline", "little_endian"]

MAX_DIMS: Final = 32
_NPY_MAGIC: Final = b"\x93NUMPY"
_MAX_HEADER_BYTES: Final = 10_000
"""numpy's own default limit on a .npy header (``max_header_size``)."""
_KINDS: Final = "biufc"
"""bool, signed, unsigned, float, complex: the dtypes a batch can carry."""


def little_endian(dtype: np.dtype[Any]) -> np.dtype[Any]:
    """``dtype`` in little-endian byte order (single-byte types are left as they are)."""
    return dtype if dtype.itemsize == 1 else dtype.newbyteorder("<")


def _parse_npy(data: memoryview) -> tuple[tuple[int, ...], bool, np.dtype[Any], int]:
    """``(shape, fortran_order, dtype, data offset)`` of the .npy in ``data``.

    Raises:
        ValueError: Not a .npy of a supported version, or an unreadable header.
    """
    if bytes(data[:6]) != _NPY_MAGIC or len(data) < 10:
        raise ValueError(f"no .npy magic (starts {bytes(data[:8])!r})")
    major = data[6]
    if major == 1:
        end = 10 + int.from_bytes(data[8:10], "little")
    elif major in (2, 3) and len(data) >= 12:
        end = 12 + int.from_bytes(data[8:12], "little")
    else:
        raise ValueError(f".npy format version {major} is not supported")
    if end > len(data) or end > _MAX_HEADER_BYTES:
        raise ValueError(f".npy header of {end} bytes does not fit in {len(data)} bytes")
    fp = io.BytesIO(bytes(data[:end]))
    version = np.lib.format.read_magic(fp)
    # read_array_header_2_0 reads version 3 too: it differs only in allowing UTF-8 field
    # names, which the numeric dtypes accepted here never have.
    read = (
        np.lib.format.read_array_header_1_0
        if version == (1, 0)
        else np.lib.format.read_array_header_2_0
    )
    shape, fortran, dtype = read(fp, max_header_size=_MAX_HEADER_BYTES)
    return tuple(shape), bool(fortran), dtype, end


class ArrayPipeline(Pipeline):
    """Fixed-shape arrays to ``array``: ``shape`` of little-endian ``dtype``.

    Args:
        shape: One sample's shape.
        dtype: A numeric dtype (``"float32"``, ``"<f4"``, ``">i8"``, ...); the field is its
            little-endian form.
        raw: Samples are raw little-endian bytes instead of ``.npy``.

    Raises:
        InvalidArgument: ``shape`` or ``dtype`` is not usable.
    """

    def __init__(self, shape: Sequence[int], dtype: str, raw: bool = False) -> None:
        try:
            dims = tuple(int(d) for d in shape)
        except (TypeError, ValueError):
            raise InvalidArgument(f"array shape={shape!r} must be a sequence of integers") from None
        if len(dims) > MAX_DIMS or any(d < 1 for d in dims):
            raise InvalidArgument(
                f"array shape={dims} must have at most {MAX_DIMS} dimensions, each >= 1"
            )
        try:
            parsed = np.dtype(dtype)
        except TypeError:
            raise InvalidArgument(f"array dtype={dtype!r} is not a numpy dtype") from None
        if parsed.kind not in _KINDS or parsed.fields is not None or parsed.subdtype:
            raise InvalidArgument(
                f"array dtype={dtype!r} must be a plain bool, integer, float or complex type"
            )
        self.shape = dims
        self.dtype = little_endian(parsed)
        self.raw = bool(raw)
        sample_bytes = math.prod(dims) * self.dtype.itemsize
        self.record_bytes: int | None = sample_bytes if self.raw else None
        """Bytes of one raw record; None for ``.npy`` samples."""
        self._sample_bytes = sample_bytes

    def fields(self) -> list[FieldSpec]:
        return [FieldSpec("array", self.dtype, self.shape)]

    def decode_into(self, data: memoryview, sample: SampleInfo, row: Block) -> None:
        if self.raw:
            if len(data) != self._sample_bytes:
                raise BadSample(
                    "shape",
                    f"{sample.path}: {len(data)} bytes, expected {self._sample_bytes} "
                    f"(shape {self.shape} of {self.dtype.str})",
                )
            np.copyto(row["array"], np.frombuffer(data, self.dtype).reshape(self.shape))
            return
        try:
            shape, fortran, dtype, start = _parse_npy(data)
        # numpy's header parser raises ValueError for most garbage, but the header is a Python
        # literal from an untrusted file: anything it raises means "corrupt", never a crash.
        except Exception as e:
            raise BadSample("corrupt", f"{sample.path}: not a readable .npy: {e}") from e
        if shape != self.shape or dtype.hasobject or little_endian(dtype) != self.dtype:
            raise BadSample(
                "shape",
                f"{sample.path}: .npy holds {dtype.str} {shape}, expected {self.dtype.str} "
                f"{self.shape}",
            )
        end = start + self._sample_bytes
        if end != len(data):
            raise BadSample(
                "corrupt",
                f"{sample.path}: .npy of {dtype.str} {shape} needs {end} bytes, has {len(data)}",
            )
        stored = np.frombuffer(data[start:], dtype).reshape(shape, order="F" if fortran else "C")
        # One pass converts byte order and memory order together.
        np.copyto(row["array"], stored)

    def gather_into(
        self,
        file: npt.NDArray[np.uint8],
        offsets: npt.NDArray[np.int64],
        out: npt.NDArray[Any],
    ) -> None:
        """Copy raw record ``i``, ``file[offsets[i]:offsets[i] + record_bytes]``, to ``out[i]``.

        For a batch whose samples all live in one file (see ``SampleFiles.map_whole``). The
        caller checks that every sample's catalog byte length equals :attr:`record_bytes`.

        Args:
            file: The whole file's bytes.
            offsets: One byte offset per record.
            out: ``(len(offsets), *shape)`` of the field's dtype (the block's first rows).

        Raises:
            BadSample: ``unreadable``: a record does not lie inside the file; decode those
                samples one by one to find which.
        """
        if self.record_bytes is None:
            raise FailedPrecondition("gather_into is for raw=True array pipelines only")
        n, size = len(offsets), self.record_bytes
        assert out.shape == (n, *self.shape) and out.dtype == self.dtype, "out is the block"
        bad = (offsets < 0) | (offsets > len(file) - size)
        if bad.any():
            i = int(np.argmax(bad))
            raise BadSample(
                "unreadable",
                f"record {i} at byte offset {int(offsets[i])} (+{size} bytes) is outside the "
                f"{len(file)} byte file",
            )
        if n == 0:
            return
        # Every byte offset as the start of one record-sized element: a view, no copy.
        records = np.ndarray((len(file) - size + 1,), np.dtype((np.void, size)), file, 0, (1,), "C")
        # Fancy indexing, not np.take: take first makes its input contiguous, which for this
        # overlapping view means copying record_bytes times the file.
        picked = records[offsets]
        if out.flags.c_contiguous:
            out.reshape(-1).view(records.dtype)[...] = picked
        else:
            np.copyto(out, picked.view(self.dtype).reshape(out.shape))
