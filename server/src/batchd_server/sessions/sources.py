"""The catalog entries a session serves: one split, or every source of a weighted mix.

Each source of a mix is a split like any other: its own entry in the catalog cache (shared
with single-split sessions on the same snapshot) and its own snapshot. A mixed session's
snapshot token pins every source's version and rows at once (``mixing.mix_token``).
"""

from __future__ import annotations

from collections.abc import Sequence

from batchd_server.catalog_cache import CatalogCache, CatalogEntry
from batchd_server.errors import InvalidArgument
from batchd_server.mixing import mix_token, parse_mix_token
from batchd_server.sessions.options import SessionOptions

__all__ = ["acquire_sources", "release_sources", "snapshot_token"]


def acquire_sources(cache: CatalogCache, options: SessionOptions) -> tuple[CatalogEntry, ...]:
    """The entries of every split ``options`` serves, in source order, each referenced once.

    Raises:
        InvalidArgument: a mix's snapshot is not one of this mix, or pins another version
            than a source asks for.
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
            entries.append(cache.acquire(source.dataset, version, source.split, snapshot))
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
