"""Ingest WebDataset-style tar shards: each sample a byte range inside its shard, nothing
extracted (the shards are read by ``tar_shards.TarSamples``)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path
from typing import Any

from sqlalchemy.engine import Engine

from batchd_server.catalog.ingest.load import IngestReport, Source, Target, find_files, load
from batchd_server.catalog.manifest import SPLIT_MAX_CHARS, check_name
from batchd_server.catalog.members import MEMBERS_ATTR
from batchd_server.catalog.tar_shards import TarSamples
from batchd_server.catalog.types import DatasetRef
from batchd_server.storage.options import DEFAULT_RETRY_S

__all__ = ["ingest_tar"]


def ingest_tar(
    engine: Engine,
    *,
    dataset: str,
    version: str = "1",
    root: str | Path,
    shards: list[str],
    split: str | None = None,
    label_key: str = "label",
    description: str | None = None,
    progress: Callable[[int, int, int], None] | None = None,
    object_store_retry_s: float = DEFAULT_RETRY_S,
) -> IngestReport:
    """Add the samples of WebDataset-style tar shards, as byte ranges inside them.

    Members are grouped by key (the name up to its first dot); each sample's payload member
    (the first that is not ``.cls``/``.json``/``.txt``) is its row's byte range, the label is
    the ``.cls`` integer, the ``.json`` field ``label_key`` or an integer ``.txt``, and the
    other members' ranges go to ``attrs["members"]`` (a session of several fields reads each
    field's member from there). Keys are ``<shard>#<key>``. Malformed
    samples are skipped and listed in the report's ``skipped``; see ``tar_shards``.

    Args:
        shards: Paths, globs or brace ranges (``shard-{000..099}.tar``); relative ones are
            relative to ``root``. Every shard must be under ``root``.
        split: The split of every sample; default the one word of ``train``/``val``/``test``
            in each shard's name.
        progress: Called after each shard with (shards done, shards, samples so far).

    Raises:
        DataError: a pattern that matches nothing, a compressed shard, a shard outside
            ``root`` or of unknown split, no sample at all, or (dataset, version) already
            rooted elsewhere.
    """
    if split is not None:
        check_name("split", split, SPLIT_MAX_CHARS)
    stored_root, found = find_files(root, shards, object_store_retry_s=object_store_retry_s)
    samples = TarSamples(found, split, label_key=label_key, progress=progress)
    report = load(
        engine,
        Target(dataset, version, description),
        Source(
            root=stored_root,
            rows=samples.rows(),
            attrs_update=_members_attrs,
            empty=f"no samples found in {len(samples.shards)} shard(s) under {stored_root}"
            + "".join(f"\n  {s}" for s in samples.skipped[:20]),
        ),
    )
    return dataclasses.replace(report, skipped=tuple(samples.skipped))


def _members_attrs(ref: DatasetRef, attrs: dict[str, Any]) -> bool:
    """Mark the dataset as one whose samples' attrs hold every member's range, which the
    catalog load then reads for sessions of several fields (``catalog/members.py``)."""
    if attrs.get(MEMBERS_ATTR):
        return False
    attrs[MEMBERS_ATTR] = True
    return True
