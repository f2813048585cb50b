"""Every tar member's byte range, per sample of a split: what a session of several fields
reads each field from (``workers/field_rows.py``).

The tar ingest records each sample's payload member as its row's byte range and every
other member's in ``samples.attrs`` (``{"payload": "jpg", "members": {"txt": [offset,
length], ...}}``), and marks the dataset (``datasets.attrs["tar_members"]``). A load of such
a split reads those attrs once, beside its rows, into one offset and one length array per
extension (``member.<ext>.offset`` / ``.length``, -1 where a sample has no such member),
which go into the split's catalog segment with its other arrays. No table of their own:
the ranges are the rows' own, immutable with them, and a dataset of one field never reads
them.
"""

from __future__ import annotations

import json
from typing import Any, Final

import numpy as np
import numpy.typing as npt
import sqlalchemy as sa
from sqlalchemy.engine import Engine

from batchd_server.catalog.db import connect
from batchd_server.catalog.schema import samples
from batchd_server.catalog.types import SplitArrays, member_names

__all__ = ["MEMBERS_ATTR", "load_members"]

MEMBERS_ATTR: Final = "tar_members"
"""The key of ``datasets.attrs`` that says its samples' attrs hold their members' ranges."""


def load_members(engine: Engine, arrays: SplitArrays) -> dict[str, npt.NDArray[np.int64]]:
    """Each member extension's offset and length arrays, one entry per row of ``arrays``
    (the split's rows as loaded: its ids, in order)."""
    ref, ids = arrays.dataset, arrays.ids
    n = len(ids)
    found: dict[str, tuple[npt.NDArray[np.int64], npt.NDArray[np.int64]]] = {}
    if not n:
        return {}
    c = samples.c
    query = (
        sa.select(c.id, c.attrs, c.byte_offset, c.byte_length)
        .where(
            c.dataset_id == ref.id,
            c.split == arrays.split,
            c.is_verified == sa.true(),
            c.id <= int(ids[-1]),
        )
        .order_by(c.id)
    )

    def put(ext: str, row: int, offset: int, length: int) -> None:
        pair = found.get(ext)
        if pair is None:
            pair = found[ext] = (np.full(n, -1, np.int64), np.full(n, -1, np.int64))
        pair[0][row], pair[1][row] = offset, length

    with connect(engine) as conn:
        result = conn.execution_options(stream_results=True).execute(query)
        row = 0
        for sample_id, attrs, offset, length in result:
            while row < n and ids[row] < sample_id:
                row += 1
            if row >= n or ids[row] != sample_id:
                continue
            parsed: Any = json.loads(attrs) if isinstance(attrs, str) else attrs
            if not isinstance(parsed, dict):
                continue
            payload = parsed.get("payload")
            if isinstance(payload, str) and offset is not None:
                put(payload, row, int(offset), int(length))
            members = parsed.get("members")
            if isinstance(members, dict):
                for ext, where in members.items():
                    if isinstance(where, list) and len(where) == 2:
                        put(str(ext), row, int(where[0]), int(where[1]))
    out: dict[str, npt.NDArray[np.int64]] = {}
    for ext, (offsets, lengths) in found.items():
        names = member_names(ext)
        out[names[0]], out[names[1]] = offsets, lengths
    return out
