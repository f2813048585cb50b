"""The array pipeline: fixed-shape NumPy data to the ``array`` field.

A sample is either a ``.npy`` (a whole file, or a ``.npy`` blob inside a byte range of a shard
file) or, with ``raw=True``, exactly ``prod(shape) * itemsize`` little-endian bytes. The
``.npy`` header is parsed without unpickling anything: object arrays are refused. Byte order
and Fortran order are converted on the copy into the row, so they cost nothing extra.

A ``.npy`` header is a Python literal that numpy parses with ``ast``: about 40 us, more than
reading and copying a small record. Records of one dataset almost always share their header
bytes, so each pipeline keeps the parsed header per distinct header bytes and parses each
only once.

Records read a batch at a time (:meth:`ArrayPipeline.decode_batch`) are copied with one numpy
fancy index over a view of the batch's bytes whose elements are whole records
(:func:`~batchd_server.pipelines.ranges.take_ranges`): the headers of a batch are compared
to each other in one vectorised pass and its payloads land in the slot in another, so a batch
of small records costs microseconds, not one Python call per sample.
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
from batchd_server.pipelines.ranges import take_ranges

__all__ = ["MAX_DIMS", "ArrayPipeline", "little_endian"]

MAX_DIMS: Final = 32
_NPY_MAGIC: Final = b"\x93NUMPY"
_MAX_HEADER_BYTES: Final = 10_000
"""numpy's own default limit on a .npy header (``max_header_size``)."""
_KINDS: Final = "biufc"
"""bool, signed, unsigned, float, complex: the dtypes a batch can carry."""
_MAX_CACHED_HEADERS: Final = 64

Header = tuple[tuple[int, ...], bool, np.dtype[Any], int]
"""A parsed .npy header: ``(shape, fortran_order, dtype, data offset)``."""


def little_endian(dtype: np.dtype[Any]) -> np.dtype[Any]:
    """``dtype`` in little-endian byte order (single-byte types are left as they are)."""
    return dtype if dtype.itemsize == 1 else dtype.newbyteorder("<")


def _npy_header_end(data: memoryview) -> int:
    """Where the header of the .npy in ``data`` ends (its data begins).

    Raises:
        ValueError: Not a .npy of a supported version, or a header longer than ``data``.
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
    return end


def _parse_npy_header(header: bytes) -> Header:
    """Parse a whole .npy header (magic included), which :func:`_npy_header_end` accepted.

    Raises:
        Exception: numpy's parser raises ValueError for most garbage, but the header is a
            Python literal from an untrusted file, so callers treat anything as "corrupt".
    """
    fp = io.BytesIO(header)
    version = np.lib.format.read_magic(fp)
    # read_array_header_2_0 reads version 3 too: it differs only in allowing UTF-8 field
    # names, which the numeric dtypes accepted here never have.
    read = (
        np.lib.format.read_array_header_1_0
        if version == (1, 0)
        else np.lib.format.read_array_header_2_0
    )
    shape, fortran, dtype = read(fp, max_header_size=_MAX_HEADER_BYTES)
    return tuple(shape), bool(fortran), dtype, len(header)


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
        self._headers: dict[bytes, Header] = {}
        """Parsed .npy headers by their bytes (see the module docs)."""

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
            shape, fortran, dtype, start = self._header(data)
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

    def decode_batch(
        self,
        data: npt.NDArray[np.uint8],
        starts: npt.NDArray[np.int64],
        lengths: npt.NDArray[np.int64],
        block: Block,
    ) -> bool:
        n, size = len(starts), self._sample_bytes
        out = block["array"][:n]
        if n == 0:
            return True
        if self.raw:
            if (lengths != size).any():
                return False
            out[...] = _as_arrays(take_ranges(data, starts, size), self.dtype, self.shape, False)
            return True
        length = int(lengths[0])
        skip = length - size  # every sample's header bytes, if they are all alike
        if skip < 10 or (lengths != length).any():
            return False
        heads = take_ranges(data, starts, skip).view(np.uint8).reshape(n, skip)
        if (heads == heads[0]).all():
            groups: list[tuple[bytes, Any]] = [(heads[0].tobytes(), slice(None))]
        else:  # records stored with different byte or memory orders
            distinct, which = np.unique(heads, axis=0, return_inverse=True)
            groups = [(d.tobytes(), which == k) for k, d in enumerate(distinct)]
        for header, rows in groups:
            try:
                shape, fortran, dtype, end = self._header(memoryview(header))
            except Exception:
                return False
            if (
                end != skip
                or shape != self.shape
                or dtype.hasobject
                or little_endian(dtype) != self.dtype
            ):
                return False
            payloads = take_ranges(data, starts[rows] + skip, size)
            out[rows] = _as_arrays(payloads, dtype, shape, fortran)
        return True

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
        out[...] = _as_arrays(take_ranges(file, offsets, size), self.dtype, self.shape, False)

    def _header(self, data: memoryview) -> Header:
        """The parsed header of the .npy in ``data``, from the cache when its bytes were seen.

        Raises:
            Exception: As :func:`_npy_header_end` and :func:`_parse_npy_header`.
        """
        key = bytes(data[: _npy_header_end(data)])
        found = self._headers.get(key)
        if found is None:
            found = _parse_npy_header(key)
            if len(self._headers) >= _MAX_CACHED_HEADERS:
                self._headers.clear()
            self._headers[key] = found
        return found


def _as_arrays(
    payloads: npt.NDArray[np.void], dtype: np.dtype[Any], shape: tuple[int, ...], fortran: bool
) -> npt.NDArray[Any]:
    """``(n,)`` raw payloads as ``(n, *shape)`` arrays of ``dtype`` stored in C or F order: a
    view; assigning it to the slot converts byte order and memory order in the same pass."""
    values = payloads.view(dtype)
    if not fortran:
        return values.reshape(len(payloads), *shape)
    flipped = values.reshape(len(payloads), *shape[::-1])
    return flipped.transpose(0, *range(len(shape), 0, -1))
