"""The catalog entries a session serves: every source of its ``Mixing``, in order.

A session on one split serves it as its one source; a mix's sources are splits like any
other. Each is its own entry in the catalog cache (shared with every session on the same
split and snapshot) at its own snapshot; the session's snapshot token pins them all at once
(``Mixing.token``: the split's own token, or a mix's ``mixing.mix_token``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from batchd_server.catalog_cache import CatalogCache, CatalogEntry
from batchd_server.errors import FailedPrecondition, InvalidArgument
from batchd_server.pipelines.base import Pipeline
from batchd_server.pipelines.registry import build_pipeline
from batchd_server.sessions.options import SessionOptions

__all__ = [
    "acquire_sources",
    "check_field_sources",
    "check_source_pipelines",
    "release_sources",
    "snapshot_token",
]


def acquire_sources(cache: CatalogCache, options: SessionOptions) -> tuple[CatalogEntry, ...]:
    """The entries of every source ``options`` serves, in order, each referenced once.

    Raises:
        InvalidArgument: the snapshot is not one of this session's kind or number of
            sources, or pins another version than a source asks for.
        NotFound, SnapshotMismatch, ResourceExhausted, Unavailable: as ``CatalogCache.acquire``.
    """
    mixing = options.mixing
    pins = mixing.pins(options.snapshot)
    entries: list[CatalogEntry] = []
    try:
        for source, (pinned_version, snapshot) in zip(mixing.sources, pins, strict=True):
            version = source.version
            if pinned_version is not None:
                if version is not None and version != pinned_version:
                    raise InvalidArgument(
                        f"mix source {source.name!r} asks for version {version!r}, but the "
                        f"snapshot pins version {pinned_version!r}; pass a snapshot of this "
                        "mix, or none"
                    )
                version = pinned_version
            entries.append(
                cache.acquire(
                    source.dataset,
                    version,
                    source.split,
                    snapshot,
                    members=options.pipeline_kind == "fields",
                )
            )
    except BaseException:
        release_sources(cache, entries)
        raise
    return tuple(entries)


def release_sources(cache: CatalogCache, entries: Sequence[CatalogEntry]) -> None:
    """Release every entry ``acquire_sources`` gave."""
    for entry in entries:
        cache.release(entry)


def snapshot_token(options: SessionOptions, entries: Sequence[CatalogEntry]) -> str:
    """What ``OpenSessionResponse.snapshot`` says: the token that pins every source."""
    return options.mixing.token(
        [(e.arrays.dataset.version, e.arrays.snapshot.token()) for e in entries]
    )


def check_field_sources(options: SessionOptions, entries: Sequence[CatalogEntry]) -> None:
    """Refuse a session of several fields on a source that cannot tell where each field is:
    fields come from Parquet columns or from the tar members the tar ingest records.

    Raises:
        FailedPrecondition: which dataset, and how to ingest it so.
    """
    if options.pipeline_kind != "fields":
        return
    for entry in entries:
        ref = entry.arrays.dataset
        if not ref.parquet_payload and not ref.members:
            raise FailedPrecondition(
                f"dataset {ref.name!r} version {ref.version!r} has one field per sample; a "
                "pipeline of several fields reads WebDataset shards (each field a member of a "
                "key: ingest them with `batchd-server ingest tar`; re-ingest shards cataloged "
                "before fields were recorded) or Parquet files (each field a column)"
            )


def check_source_pipelines(options: SessionOptions, pipeline: Pipeline) -> None:
    """Refuse a mix whose sources would not make one kind of batch: a source's own pipeline
    must fill the same fields (names, dtypes, one sample's shape) as the session's
    ``pipeline``, and one that finishes the whole batch (tokens' padding to the longest, a
    custom decoder) must be the session's own, since one ``finish`` runs per batch.

    Raises:
        InvalidArgument: which source, and how its fields differ.
        InvalidArgument, NotFound: a source's pipeline cannot be built (as ``build_pipeline``).
    """
    wanted = _schema(pipeline)
    session_pipeline = (options.pipeline_kind, options.pipeline_options)
    for source in options.mixing.sources:
        if source.pipeline_kind is None:
            continue
        own = build_pipeline(source.pipeline_kind, source.pipeline_options)
        schema = _schema(own)
        if schema != wanted:
            raise InvalidArgument(
                f"mix source {source.name!r} decodes to {_describe(schema)}, the session's "
                f"pipeline to {_describe(wanted)}; every source of a mix must decode to the "
                "same fields (names, dtypes, shapes): change the source's pipeline, or leave "
                "it out to use the session's"
            )
        works_on_batch = type(own).finish is not Pipeline.finish
        if works_on_batch and _decoding(source.pipeline_kind, source.pipeline_options) != (
            _decoding(*session_pipeline)
        ):
            raise InvalidArgument(
                f"mix source {source.name!r} has a {source.pipeline_kind} pipeline of its own, "
                "but that pipeline finishes the whole batch (padding, a custom decoder's "
                "collation), which one pipeline does for all sources; give every source the "
                "session's pipeline"
            )


def _decoding(kind: str, options: dict[str, Any]) -> tuple[str, Any]:
    """What finishes a batch of a pipeline: of several fields, each field's pipeline and not
    where its bytes come from (a mix of WebDataset shards and Parquet files of the same
    fields reads each field from a member in one, a column in the other)."""
    if kind != "fields":
        return kind, options
    fields = options.get("fields", [])
    return kind, [{k: v for k, v in f.items() if k != "source"} for f in fields]


def _schema(pipeline: Pipeline) -> list[tuple[str, str, tuple[int, ...]]]:
    return [(f.name, f.dtype.newbyteorder("<").str, tuple(f.shape)) for f in pipeline.fields()]


def _describe(schema: list[tuple[str, str, tuple[int, ...]]]) -> str:
    return ", ".join(
        f"{name} {np.dtype(dtype).name} {list(shape)}" for name, dtype, shape in schema
    )
