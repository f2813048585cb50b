"""The catalog entries a session serves: one split, or every source of a weighted mix.

Each source of a mix is a split like any other: its own entry in the catalog cache (shared
with single-split sessions on the same snapshot) and its own snapshot. A mixed session's
snapshot token pins every source's version and rows at once (``mixing.mix_token``).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from batchd_server.catalog_cache import CatalogCache, CatalogEntry
from batchd_server.errors import FailedPrecondition, InvalidArgument
from batchd_server.pipelines.base import Pipeline
from batchd_server.pipelines.registry import build_pipeline
from batchd_server.planning.mixing import mix_token, parse_mix_token
from batchd_server.sessions.options import SessionOptions

__all__ = ["acquire_sources", "check_source_pipelines", "release_sources", "snapshot_token"]


def acquire_sources(cache: CatalogCache, options: SessionOptions) -> tuple[CatalogEntry, ...]:
    """The entries of every split ``options`` serves, in source order, each referenced once.

    Raises:
        InvalidArgument: a mix's snapshot is not one of this mix, or pins another version
            than a source asks for.
        FailedPrecondition: a mix's source has no verified samples.
        NotFound, SnapshotMismatch, ResourceExhausted, Unavailable: as ``CatalogCache.acquire``.
    """
    mix = options.mix
    if mix is None:
        return (cache.acquire(options.dataset, options.version, options.split, options.snapshot),)
    count = len(mix.sources)
    pins = parse_mix_token(options.snapshot, count) if options.snapshot else None
    entries: list[CatalogEntry] = []
    try:
        for index, source in enumerate(mix.sources):
            version, snapshot = source.version, None
            if pins is not None:
                pinned_version, snapshot = pins[index]
                if version is not None and version != pinned_version:
                    raise InvalidArgument(
                        f"mix source {source.name!r} asks for version {version!r}, but the "
                        f"snapshot pins version {pinned_version!r}; pass a snapshot of this "
                        "mix, or none"
                    )
                version = pinned_version
            entry = cache.acquire(source.dataset, version, source.split, snapshot)
            entries.append(entry)
            if len(entry.arrays) == 0:
                raise FailedPrecondition(
                    f"mix source {source.name!r} has no verified samples; ingest or verify "
                    "samples of that split, or leave it out of the mix"
                )
    except BaseException:
        release_sources(cache, entries)
        raise
    return tuple(entries)


def release_sources(cache: CatalogCache, entries: Sequence[CatalogEntry]) -> None:
    """Release every entry ``acquire_sources`` gave."""
    for entry in entries:
        cache.release(entry)


def snapshot_token(options: SessionOptions, entries: tuple[CatalogEntry, ...]) -> str:
    """What ``OpenSessionResponse.snapshot`` says: the split's snapshot, or the mix's token."""
    if options.mix is None:
        return entries[0].arrays.snapshot.token()
    return mix_token([(e.arrays.dataset.version, e.arrays.snapshot.token()) for e in entries])


def check_source_pipelines(options: SessionOptions, pipeline: Pipeline) -> None:
    """Refuse a mix whose sources would not make one kind of batch: a source's own pipeline
    must fill the same fields (names, dtypes, one sample's shape) as the session's
    ``pipeline``, and one that finishes the whole batch (tokens' padding to the longest, a
    custom decoder) must be the session's own, since one ``finish`` runs per batch.

    Raises:
        InvalidArgument: which source, and how its fields differ.
        InvalidArgument, NotFound: a source's pipeline cannot be built (as ``build_pipeline``).
    """
    if options.mix is None:
        return
    wanted = _schema(pipeline)
    session_pipeline = (options.pipeline_kind, options.pipeline_options)
    for source in options.mix.sources:
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
        if works_on_batch and (source.pipeline_kind, source.pipeline_options) != session_pipeline:
            raise InvalidArgument(
                f"mix source {source.name!r} has a {source.pipeline_kind} pipeline of its own, "
                "but that pipeline finishes the whole batch (padding, a custom decoder's "
                "collation), which one pipeline does for all sources; give every source the "
                "session's pipeline"
            )


def _schema(pipeline: Pipeline) -> list[tuple[str, str, tuple[int, ...]]]:
    return [(f.name, f.dtype.newbyteorder("<").str, tuple(f.shape)) for f in pipeline.fields()]


def _describe(schema: list[tuple[str, str, tuple[int, ...]]]) -> str:
    return ", ".join(
        f"{name} {np.dtype(dtype).name} {list(shape)}" for name, dtype, shape in schema
    )
