"""The catalog cache keeps one entry, one load and one shared-memory segment per set of rows:
snapshot tokens that pin the same rows (``s1.N.C`` and ``s1.N'.C`` with no row of the split
between N and N') share it. Real catalog (SQLite), real shared memory."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from sqlalchemy.engine import Engine

from batchd_server import metrics
from batchd_server.catalog_cache import CatalogCache, CatalogEntry
from batchd_server.shm import ShmRegistry

from serving import record_dataset

# The embedded catalog: what is under test does not depend on the backend.
pytestmark = pytest.mark.backend("sqlite")

MiB = 1 << 20


@pytest.fixture
def cache(engine: Engine) -> Iterator[CatalogCache]:
    with ShmRegistry(budget_bytes=64 * MiB) as registry:
        cache = CatalogCache(engine, registry)
        try:
            yield cache
        finally:
            cache.close()


def _loads() -> float:
    """Loads of the "records" split so far (the catalog-load histogram's count)."""
    count = metrics.REGISTRY.get_sample_value(
        "batchd_catalog_load_seconds_count", {"dataset": "records"}
    )
    return count or 0.0


def _segments(cache: CatalogCache) -> int:
    return len(cache._registry.segments())


def test_equivalent_snapshot_tokens_share_one_entry_one_load_and_one_segment(
    engine: Engine, cache: CatalogCache, tmp_path: Path
) -> None:
    """The split "records" has 10 rows, then another dataset's ids, then 10 more rows. A pin
    of the rows it has now (20 rows, any id bound at or past the last) is the current entry,
    with no load of its own; its first 10 rows pinned by their last id and by ids in the gap
    after it are one entry and one segment, and each new such token loads once, a repeated
    one never. Every entry says its rows' own token."""
    record_dataset(engine, tmp_path / "a", n=10)
    record_dataset(engine, tmp_path / "other", n=10, name="other")
    record_dataset(engine, tmp_path / "a", n=20)  # the first 10 keys exist: 10 rows added
    held: list[CatalogEntry] = []

    def acquire(snapshot: str | None) -> CatalogEntry:
        held.append(cache.acquire("records", None, "train", snapshot))
        return held[-1]

    loads = _loads()
    now = acquire(None)
    ids = now.arrays.ids.tolist()
    assert len(ids) == 20 and ids[9] + 10 < ids[10], "the split's ids have a gap of 10"
    last = ids[-1]
    assert now.arrays.snapshot.token() == f"s1.{last}.20"
    for token in (f"s1.{last}.20", f"s1.{last + 7}.20", f"s1.{last + 10**6}.20"):
        assert acquire(token) is now, token
    assert _loads() == loads + 1 and _segments(cache) == 1

    older = acquire(f"s1.{ids[9]}.10")
    assert older is not now and older.arrays.ids.tolist() == ids[:10]
    for token in (f"s1.{ids[9] + 5}.10", f"s1.{ids[9] + 5}.10", f"s1.{ids[10] - 1}.10"):
        assert acquire(token) is older, token
    assert older.arrays.snapshot.token() == f"s1.{ids[9]}.10"
    assert _segments(cache) == 2, "one segment per set of rows"
    assert _loads() == loads + 4, "each new equivalent token loads once, a repeated one never"
    assert older.refs == 4 and now.refs == 4
    for entry in held:
        cache.release(entry)
