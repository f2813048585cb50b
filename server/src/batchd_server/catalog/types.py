"""The catalog's values as the rest of the server holds them: no SQLAlchemy here.

A loaded split is :class:`SplitArrays`: which dataset, split and :class:`Snapshot` it is, and
its rows as flat column arrays. The columns a worker reads to fill a batch are
:class:`SampleColumns`, whose fields name the arrays of a catalog segment
(``catalog_cache`` packs them, ``workers/context.py`` maps them), so those names are
written once, here.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Final

import numpy as np
import numpy.typing as npt

from batchd_server.errors import InvalidArgument
from batchd_server.limits import INT64_MAX

__all__ = ["COLUMNS", "DatasetRef", "SampleColumns", "Snapshot", "SplitArrays"]

_TOKEN_RE: Final = re.compile(r"s1\.([0-9]{1,19})\.([0-9]{1,19})")

Int64Array = npt.NDArray[np.int64]


@dataclass(frozen=True)
class DatasetRef:
    """One row of ``datasets``: what a reader needs to find a dataset's files."""

    id: int
    name: str
    version: str
    root: str
    parquet_payload: str = ""
    """The payload column of its Parquet rows (``datasets.attrs["parquet"]["payload"]``);
    "" for a dataset without any."""
    text_identity: str = ""
    """What made its rows' ``length`` token counts (``datasets.attrs["text"]["identity"]``:
    the encoding and its tokenizer file's digest, see ``pipelines/text.py``); "" for none."""
    members: bool = False
    """Its samples' attrs hold every tar member's range (``datasets.attrs["tar_members"]``,
    set by the tar ingest): a load reads them for sessions of several fields."""


@dataclass(frozen=True)
class Snapshot:
    """Which rows of a split a load saw: the verified ones with ``id <= max_sample_id``.

    Rows are immutable and ids only grow, so passing a snapshot back pins every rank of a job
    to the same rows while new ones are ingested; ``row_count`` detects the rows that a
    snapshot cannot pin (deleted, or no longer verified).
    """

    max_sample_id: int
    row_count: int

    def __post_init__(self) -> None:
        if not 0 <= self.row_count <= self.max_sample_id <= INT64_MAX:
            raise InvalidArgument(
                f"snapshot max_sample_id={self.max_sample_id}, row_count={self.row_count} "
                f"is impossible: need 0 <= row_count <= max_sample_id <= {INT64_MAX}"
            )

    def token(self) -> str:
        """The snapshot as an opaque string for the wire, e.g. ``"s1.1048576.1000000"``."""
        return f"s1.{self.max_sample_id}.{self.row_count}"

    @classmethod
    def parse(cls, token: str) -> Snapshot:
        """The snapshot ``token()`` wrote.

        Raises:
            InvalidArgument: ``token`` is not a snapshot token.
        """
        match = _TOKEN_RE.fullmatch(token) if isinstance(token, str) else None
        if match is None:
            raise InvalidArgument(
                f"snapshot token {token!r} is not of the form s1.<max_sample_id>.<row_count>; "
                "pass the token an earlier load returned, or none to read the split as it is now"
            )
        return cls(max_sample_id=int(match[1]), row_count=int(match[2]))


@dataclass(frozen=True, eq=False)
class SampleColumns:
    """What a worker reads of a split's rows to fill a batch, as read-only flat arrays.

    Nullable columns hold -1 for null: ``labels``, ``lengths``, ``byte_offsets`` /
    ``byte_lengths`` (-1 there means "the whole file"), and ``row_groups`` / ``row_indexes``
    (-1 for every sample that is not a row of a Parquet file). Paths, relative to the
    dataset's root, are UTF-8 concatenated in ``path_bytes``; sample ``i``'s are
    ``path_bytes[path_offsets[i]:path_offsets[i + 1]]``.
    """

    ids: Int64Array
    labels: Int64Array
    lengths: npt.NDArray[np.int32]
    byte_offsets: Int64Array
    byte_lengths: Int64Array
    path_bytes: npt.NDArray[np.uint8]
    path_offsets: Int64Array
    row_groups: npt.NDArray[np.int32]
    """Parquet rows: the row group of the file (``byte_offsets``/``byte_lengths`` are its
    payload column's chunk); -1 otherwise."""
    row_indexes: npt.NDArray[np.int32]
    """Parquet rows: the row's index inside its row group; -1 otherwise."""

    def __post_init__(self) -> None:
        n = len(self.ids)
        for name in _SAMPLE_COLUMNS:
            array = getattr(self, name)
            assert array.ndim == 1, "column arrays are flat"
            array.setflags(write=False)
        per_sample = (
            self.labels,
            self.lengths,
            self.byte_offsets,
            self.byte_lengths,
            self.row_groups,
            self.row_indexes,
        )
        assert all(len(a) == n for a in per_sample), "one row per id"
        assert len(self.path_offsets) == n + 1, "path_offsets has n + 1 entries"
        assert self.path_offsets[-1] == len(self.path_bytes), "path_offsets ends at the bytes"

    @classmethod
    def of(cls, arrays: Mapping[str, npt.NDArray[Any]]) -> SampleColumns:
        """The columns among ``arrays`` (a catalog segment's, as ``attach_arrays`` maps it).

        Arrays packed without ``row_groups`` / ``row_indexes`` (by hand, in tests and
        benchmarks) have no Parquet rows: both are then all -1.
        """
        found = {name: arrays[name] for name in _SAMPLE_COLUMNS if name in arrays}
        for name in _ROW_COLUMNS:
            if name not in found:
                found[name] = np.full(len(arrays["ids"]), -1, np.int32)
        return cls(**found)

    def __len__(self) -> int:
        return len(self.ids)

    def path(self, i: int) -> str:
        """Sample ``i``'s path relative to the dataset root (``i`` is a position, not an id)."""
        n = len(self)
        if not -n <= i < n:
            raise IndexError(f"sample index {i} is out of range for a split of {n} samples")
        i %= n
        start, end = self.path_offsets[i], self.path_offsets[i + 1]
        return self.path_bytes[start:end].tobytes().decode("utf-8")


_SAMPLE_COLUMNS: Final = tuple(f.name for f in dataclasses.fields(SampleColumns))
_ROW_COLUMNS: Final = ("row_groups", "row_indexes")


@dataclass(frozen=True, eq=False)
class SplitArrays(SampleColumns):
    """The verified rows of one split, in id order: the :class:`SampleColumns` and each
    sample's sampling weight, with which dataset, split and snapshot they are."""

    weights: npt.NDArray[np.float32]
    dataset: DatasetRef
    split: str
    snapshot: Snapshot

    def __post_init__(self) -> None:
        super().__post_init__()
        assert self.weights.ndim == 1 and len(self.weights) == len(self.ids), "one weight a row"
        self.weights.setflags(write=False)

    def columns(self) -> dict[str, npt.NDArray[Any]]:
        """Every column array by name (``COLUMNS``): what a catalog segment holds."""
        return {name: getattr(self, name) for name in COLUMNS}

    @property
    def nbytes(self) -> int:
        """Bytes held by all the arrays together."""
        return sum(a.nbytes for a in self.columns().values())

    def bytes_per_sample_beyond_paths(self) -> float:
        """Array bytes per sample, not counting ``path_bytes`` (``path_offsets`` counts)."""
        return (self.nbytes - self.path_bytes.nbytes) / max(len(self), 1)


COLUMNS: Final = (*_SAMPLE_COLUMNS, "weights")
"""The names of a split's column arrays: ``SplitArrays.columns()``, a catalog segment's."""


def member_names(ext: str) -> tuple[str, str]:
    """The catalog segment's arrays of the ranges of each sample's ``.ext`` tar member
    (``catalog/members.py``): its offsets and its lengths, -1 where a sample has none."""
    return f"member.{ext}.offset", f"member.{ext}.length"
