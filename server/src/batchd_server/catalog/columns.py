"""The rows of a split as they are read: column chunks, joined once into ``SplitArrays``."""

from __future__ import annotations

from typing import Any

import numpy as np
import numpy.typing as npt

from batchd_server.catalog.types import DatasetRef, Snapshot, SplitArrays

__all__ = ["ColumnBuilder"]


class ColumnBuilder:
    """Collects the column chunks of a load and joins them once at the end.

    Both ways of reading a split feed it: ``PackedCopyParser`` (Postgres' COPY output) and
    ``reader``'s streamed SELECT (SQLite).
    """

    def __init__(self) -> None:
        self._chunks: dict[str, list[npt.NDArray[Any]]] = {
            name: []
            for name in (
                "ids",
                "labels",
                "lengths",
                "weights",
                "byte_offsets",
                "byte_lengths",
                "path_bytes",
                "path_lengths",
                "row_groups",
                "row_indexes",
            )
        }
        self.row_count = 0
        self.last_id = 0

    def add(
        self,
        *,
        ids: npt.ArrayLike,
        labels: npt.ArrayLike,
        lengths: npt.ArrayLike,
        weights: npt.ArrayLike,
        byte_offsets: npt.ArrayLike,
        byte_lengths: npt.ArrayLike,
        path_bytes: npt.NDArray[np.uint8],
        path_lengths: npt.ArrayLike,
        row_groups: npt.ArrayLike,
        row_indexes: npt.ArrayLike,
    ) -> None:
        """One chunk of rows: every argument one entry per row (paths: their UTF-8 bytes
        concatenated, and each one's length)."""
        ids_array = np.asarray(ids, np.int64)
        if ids_array.size == 0:
            return
        put = self._chunks
        put["ids"].append(ids_array)
        put["labels"].append(np.asarray(labels, np.int64))
        put["lengths"].append(np.asarray(lengths, np.int32))
        put["weights"].append(np.asarray(weights, np.float32))
        put["byte_offsets"].append(np.asarray(byte_offsets, np.int64))
        put["byte_lengths"].append(np.asarray(byte_lengths, np.int64))
        put["path_bytes"].append(path_bytes)
        put["path_lengths"].append(np.asarray(path_lengths, np.int64))
        put["row_groups"].append(np.asarray(row_groups, np.int32))
        put["row_indexes"].append(np.asarray(row_indexes, np.int32))
        self.row_count += ids_array.size
        self.last_id = int(ids_array[-1])

    def _join(self, name: str, dtype: npt.DTypeLike) -> npt.NDArray[Any]:
        chunks = self._chunks[name]
        joined = np.concatenate(chunks) if chunks else np.empty(0, dtype)
        chunks.clear()
        return joined.astype(dtype, copy=False)

    def build(self, dataset: DatasetRef, split: str, snapshot: Snapshot) -> SplitArrays:
        path_offsets = np.zeros(self.row_count + 1, np.int64)
        np.cumsum(self._join("path_lengths", np.int64), out=path_offsets[1:])
        return SplitArrays(
            dataset=dataset,
            split=split,
            snapshot=snapshot,
            ids=self._join("ids", np.int64),
            labels=self._join("labels", np.int64),
            lengths=self._join("lengths", np.int32),
            weights=self._join("weights", np.float32),
            byte_offsets=self._join("byte_offsets", np.int64),
            byte_lengths=self._join("byte_lengths", np.int64),
            path_bytes=self._join("path_bytes", np.uint8),
            path_offsets=path_offsets,
            row_groups=self._join("row_groups", np.int32),
            row_indexes=self._join("row_indexes", np.int32),
        )
