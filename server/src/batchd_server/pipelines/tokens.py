"""The tokens pipeline: token files to ``input_ids``, ``attention_mask`` and ``length``.

A sample is raw little-endian tokens (``int32`` or ``uint16``), truncated to ``max_len``.
:meth:`TokensPipeline.decode_into` writes only the tokens and the length of its row; the
padding and the mask are written once per batch by :meth:`TokensPipeline.finish`, which also
shrinks the batch to its longest row: ``input_ids`` and ``attention_mask`` become
C-contiguous ``(rows, L)`` arrays at the start of their fields, ``L`` being the longest
length in the batch, so a batch of short sequences crosses the ring in ``L`` columns, not
``max_len``.

Token records read a batch at a time (:meth:`TokensPipeline.decode_batch`) are copied in one
vectorised gather of the batch's longest row for every row, then padded by ``finish``.
"""

from __future__ import annotations

from typing import Any, Final

import numpy as np
import numpy.typing as npt

from batchd_server.errors import InvalidArgument
from batchd_server.pipelines.base import BadSample, Block, FieldSpec, Pipeline, SampleInfo
from batchd_server.pipelines.ranges import take_ranges

__all__ = ["DTYPES", "MAX_LEN", "TokensPipeline"]

DTYPES: Final[dict[str, np.dtype[Any]]] = {"int32": np.dtype("<i4"), "uint16": np.dtype("<u2")}
"""Accepted ``dtype`` names and the field dtype each gives."""
MAX_LEN: Final = 1 << 20


class TokensPipeline(Pipeline):
    """Token sequences, padded to the batch's longest.

    Fields: ``input_ids`` (``(max_len,)`` of the token dtype, padded with ``pad_id``),
    ``attention_mask`` (``uint8``, 1 for real tokens, 0 for padding), ``length`` (``int32``,
    the tokens kept).

    Args:
        max_len: Longest sequence kept; longer samples are truncated.
        dtype: ``"int32"`` or ``"uint16"`` (also ``"<i4"``, ``"<u2"``): the file's tokens.
        pad_id: Token written after the end of each sequence.

    Raises:
        InvalidArgument: An argument is out of range.
    """

    def __init__(self, max_len: int, dtype: str = "int32", pad_id: int = 0) -> None:
        if not isinstance(max_len, int) or not 1 <= max_len <= MAX_LEN:
            raise InvalidArgument(f"tokens max_len={max_len!r} must be an integer in 1..{MAX_LEN}")
        by_str = {d.str: d for d in DTYPES.values()}
        token_dtype = DTYPES.get(dtype) or by_str.get(dtype)
        if token_dtype is None:
            raise InvalidArgument(f"tokens dtype={dtype!r} must be one of {sorted(DTYPES)}")
        info = np.iinfo(token_dtype.str)
        if not isinstance(pad_id, int) or not info.min <= pad_id <= info.max:
            raise InvalidArgument(
                f"tokens pad_id={pad_id!r} must be an integer in {info.min}..{info.max} "
                f"for dtype {dtype}"
            )
        self.max_len = max_len
        self.dtype = token_dtype
        self.pad_id = pad_id

    def fields(self) -> list[FieldSpec]:
        return [
            FieldSpec("input_ids", self.dtype, (self.max_len,)),
            FieldSpec("attention_mask", np.dtype(np.uint8), (self.max_len,)),
            FieldSpec("length", np.dtype("<i4"), ()),
        ]

    def decode_into(self, data: memoryview, sample: SampleInfo, row: Block) -> None:
        itemsize = self.dtype.itemsize
        if len(data) % itemsize:
            raise BadSample(
                "shape",
                f"{sample.path}: {len(data)} bytes is not a whole number of {self.dtype.str} "
                f"tokens ({itemsize} bytes each)",
            )
        n = min(len(data) // itemsize, self.max_len)
        row["input_ids"][:n] = np.frombuffer(data, self.dtype, count=n)
        row["length"][...] = n

    def decode_batch(
        self,
        data: npt.NDArray[np.uint8],
        starts: npt.NDArray[np.int64],
        lengths: npt.NDArray[np.int64],
        block: Block,
    ) -> bool:
        # Every row takes the batch's longest count of tokens in one gather: the tokens past
        # a row's own length are whatever follows it in ``data``, and finish() overwrites them
        # with padding, as it does after decode_into. Rows too close to the end of ``data``
        # for that are copied one by one.
        itemsize, n = self.dtype.itemsize, len(starts)
        if (lengths % itemsize).any():
            return False
        counts = np.minimum(lengths // itemsize, self.max_len)
        width = int(counts.max()) * itemsize if n else 0
        ids = block["input_ids"]
        if width:
            fits = starts + width <= len(data)
            if fits.any():
                wide = slice(0, n) if fits.all() else np.flatnonzero(fits)
                taken = take_ranges(data, starts[wide], width).view(self.dtype)
                ids[wide, : width // itemsize] = taken.reshape(-1, width // itemsize)
            for row in np.flatnonzero(~fits).tolist():
                start, count = int(starts[row]), int(counts[row])
                ids[row, :count] = data[start : start + count * itemsize].view(self.dtype)
        block["length"][:n] = counts
        return True

    def finish(self, block: Block, rows: int) -> dict[str, tuple[int, ...]]:
        lengths = block["length"][:rows]
        longest = int(lengths.max()) if rows else 0
        ids, mask = block["input_ids"], block["attention_mask"]
        assert ids.flags.c_contiguous and mask.flags.c_contiguous, "fields are slot views"
        # The (rows, longest) result overlaps the (rows, max_len) rows it is made from, so
        # the kept columns are copied out before being written back.
        kept = ids[:rows, :longest].copy()
        real = np.arange(longest) < lengths[:, None]
        kept[~real] = self.pad_id
        ids.reshape(-1)[: rows * longest].reshape(rows, longest)[...] = kept
        mask.reshape(-1)[: rows * longest].reshape(rows, longest)[...] = real
        return {
            "input_ids": (rows, longest),
            "attention_mask": (rows, longest),
            "length": (rows,),
        }
