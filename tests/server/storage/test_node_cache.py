"""The node cache's block store and caching fetcher: exact bytes, blocks shared between
processes and restarts, bad files fetched again, and a size never passed."""

from __future__ import annotations

import multiprocessing
import threading
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from batchd_server.pipelines.base import BadSample
from batchd_server.storage.blocks import HEADER_BYTES, RECORD_BYTES, BlockKey, object_hash
from batchd_server.storage.cache import CacheStats, CachingFetcher, cached
from batchd_server.storage.fetch_locks import FetchLocks
from tests.cache_support import (
    BLOCK,
    ROOT_URL,
    DirFetcher,
    StatDirFetcher,
    StreamDirFetcher,
    StreamStatDirFetcher,
    being_written,
    small_store,
)


@pytest.fixture
def objects(tmp_path: Path) -> Path:
    root = tmp_path / "objects"
    root.mkdir()
    rng = np.random.default_rng(7)
    for i in range(4):
        (root / f"shard{i}.bin").write_bytes(rng.bytes(10 * BLOCK + 123))
    return root


_STREAMED = [False]
"""Whether :func:`make`'s store streams its ranges (set per test by :func:`path`)."""


@pytest.fixture(autouse=True, params=["ranges", "streamed"])
def path(request: pytest.FixtureRequest) -> Iterator[str]:
    """Every test twice: misses fetched as whole ranges, and streamed piece by piece into
    the block files (the path an S3 store takes)."""
    _STREAMED[0] = request.param == "streamed"
    yield request.param
    _STREAMED[0] = False


def make(
    objects: Path, cache: Path, *, capacity: int = 1 << 30, stat: bool = True
) -> tuple[CachingFetcher, DirFetcher]:
    if _STREAMED[0]:
        inner: DirFetcher = StreamStatDirFetcher(objects) if stat else StreamDirFetcher(objects)
    else:
        inner = StatDirFetcher(objects) if stat else DirFetcher(objects)
    store = small_store(cache, capacity)
    return CachingFetcher(inner, store, stats=CacheStats()), inner


def random_ranges(rng: np.random.Generator, size: int, n: int) -> list[tuple[int, int]]:
    offsets = rng.integers(0, size, n)
    lengths = rng.integers(0, 3 * BLOCK, n)
    return [(int(o), int(min(ln, size - o))) for o, ln in zip(offsets, lengths, strict=True)]


@pytest.mark.parametrize("stat", [True, False], ids=["size-known", "size-unknown"])
def test_ranges_read_through_the_cache_are_the_objects_bytes(
    objects: Path, tmp_path: Path, stat: bool
) -> None:
    """Any ranges, across block edges and at the object's end, come back exactly, the first
    time (from the store) and the second (from the disk, with no request to the store)."""
    fetcher, inner = make(objects, tmp_path / "cache", stat=stat)
    rng = np.random.default_rng(0)
    data = (objects / "shard0.bin").read_bytes()
    url = inner.url("shard0.bin")
    ranges = [*random_ranges(rng, len(data), 40), (len(data) - 5, 5), (0, len(data))]
    want = [data[o : o + n] for o, n in ranges]
    assert fetcher.fetch(url, ranges) == want
    requests = len(inner.requests)
    assert fetcher.fetch(url, ranges) == want
    assert len(inner.requests) == requests, "the second read came from the disk"
    counts = fetcher.stats.take()
    assert counts.hits > 0 and counts.misses > 0
    assert counts.fetched_bytes == inner.fetched_bytes()


def test_missing_blocks_are_fetched_in_one_request_a_run(objects: Path, tmp_path: Path) -> None:
    """A read of blocks 0..9 where 3 and 4 are cached asks the store once, for two runs."""
    fetcher, inner = make(objects, tmp_path / "cache")
    url = inner.url("shard1.bin")
    fetcher.fetch(url, [(3 * BLOCK, 2 * BLOCK)])
    inner.requests.clear()
    fetcher.fetch(url, [(0, 10 * BLOCK)])
    runs = [(0, 3 * BLOCK), (5 * BLOCK, 5 * BLOCK)]
    if isinstance(inner, StreamDirFetcher):  # a GET of each run, streamed
        assert inner.requests == [(url, [run]) for run in runs]
    else:  # one call for both runs (the store's client sends them at once)
        assert inner.requests == [(url, runs)]


def test_blocks_outlive_the_fetcher_that_wrote_them(objects: Path, tmp_path: Path) -> None:
    """A new store on the same directory (a restarted server) finds every block, and its
    scan counts the bytes they take."""
    first, inner = make(objects, tmp_path / "cache")
    url = inner.url("shard2.bin")
    first.fetch(url, [(0, 10 * BLOCK + 123)])
    used = first.store.used_bytes()
    first.store.close()
    (tmp_path / "cache" / "usage").unlink()  # a ledger lost in the restart is rebuilt
    second, inner2 = make(objects, tmp_path / "cache")
    found = second.store.scan()
    assert len(found) == 11
    files = 10 * second.store.file_bytes(BLOCK) + second.store.file_bytes(123)
    files += RECORD_BYTES  # the object's record of its size
    assert second.store.used_bytes() == used == files
    inner2.stopped = True  # and no request is needed: not even for the size
    assert second.fetch(url, [(5, 100)]) == [(objects / "shard2.bin").read_bytes()[5:105]]


@pytest.mark.parametrize("damage", ["flip", "table", "truncate", "empty", "header", "older"])
def test_a_corrupt_or_truncated_block_file_is_fetched_again(
    objects: Path, tmp_path: Path, damage: str
) -> None:
    """A block file with a flipped byte in a chunk read or in the chunk table, cut short,
    emptied, with a wrong header or of the earlier format (CRC-32s, magic ``batchdB2``) is
    detected, deleted and fetched again; the answer is right."""
    fetcher, inner = make(objects, tmp_path / "cache")
    url = inner.url("shard3.bin")
    data = (objects / "shard3.bin").read_bytes()
    fetcher.fetch(url, [(BLOCK, BLOCK)])
    path = fetcher.store.path(BlockKey(object_hash(url), 1))
    raw = bytearray(path.read_bytes())
    if damage == "flip":  # in the chunk the read needs (the range is in the first chunk)
        raw[len(raw) - BLOCK + 10] ^= 0xFF
    elif damage == "table":
        raw[HEADER_BYTES + 1] ^= 0xFF
    elif damage == "truncate":
        raw = raw[:-1]
    elif damage == "empty":
        raw = bytearray()
    elif damage == "older":
        raw[:8] = b"batchdB2"
    else:
        raw[0] ^= 0xFF
    path.write_bytes(bytes(raw))
    fetcher.stats.take()
    inner.requests.clear()
    assert fetcher.fetch(url, [(BLOCK + 7, 50)]) == [data[BLOCK + 7 : BLOCK + 57]]
    assert inner.requests == [(url, [(BLOCK, BLOCK)])]
    assert fetcher.stats.take().corrupt == 1
    assert path.read_bytes()[-BLOCK:] == data[BLOCK : 2 * BLOCK]
    # The damage happened behind the ledger's back; a scan sets it right.
    one = fetcher.store.file_bytes(BLOCK)
    assert sum(size for size, _ in fetcher.store.scan().values()) == one
    assert fetcher.store.used_bytes() == one + RECORD_BYTES * len(fetcher.store.listing()[1])


def test_the_files_never_pass_the_capacity(objects: Path, tmp_path: Path) -> None:
    """With room for 3 blocks, reads of 40 blocks keep at most 3, and serve them all right."""
    fetcher, inner = make(objects, tmp_path / "cache")
    capacity = 3 * fetcher.store.file_bytes(BLOCK) + 10
    fetcher.store.capacity_bytes = capacity
    data = (objects / "shard0.bin").read_bytes()
    url = inner.url("shard0.bin")
    assert fetcher.fetch(url, [(0, len(data))]) == [data]
    assert fetcher.store.used_bytes() <= capacity
    assert len(fetcher.store.scan()) == 3
    assert fetcher.store.used_bytes() == 3 * fetcher.store.file_bytes(BLOCK)


def test_a_block_kept_short_is_extended_when_more_is_needed(objects: Path, tmp_path: Path) -> None:
    """With no size known, a block is fetched up to the last byte asked; a later read that
    needs more of it fetches it again and replaces the file."""
    fetcher, inner = make(objects, tmp_path / "cache", stat=False)
    url = inner.url("shard1.bin")
    data = (objects / "shard1.bin").read_bytes()
    assert fetcher.fetch(url, [(10, 20)]) == [data[10:30]]
    assert fetcher.fetch(url, [(100, 200)]) == [data[100:300]]
    assert inner.requests[-1] == (url, [(0, 300)])
    path = fetcher.store.path(BlockKey(object_hash(url), 0))
    assert len(path.read_bytes()) == fetcher.store.file_bytes(300)
    assert fetcher.store.used_bytes() == fetcher.store.file_bytes(300)


def test_a_range_past_the_objects_end_is_a_bad_sample(objects: Path, tmp_path: Path) -> None:
    fetcher, inner = make(objects, tmp_path / "cache")
    with pytest.raises(BadSample) as caught:
        fetcher.fetch(inner.url("shard0.bin"), [(10 * BLOCK, 1000)])
    assert caught.value.kind == "unreadable"
    with pytest.raises(BadSample) as missing:
        fetcher.fetch(inner.url("nope.bin"), [(0, 1)])
    assert missing.value.kind == "missing"


def _read_all(cache: str, objects: str, seed: int, streamed: bool) -> list[bytes]:
    store = small_store(Path(cache))
    kind = StreamStatDirFetcher if streamed else StatDirFetcher
    fetcher = CachingFetcher(kind(Path(objects)), store, stats=CacheStats())
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(30):
        shard = f"shard{int(rng.integers(4))}.bin"
        got = fetcher.fetch(f"{ROOT_URL}/{shard}", random_ranges(rng, 10 * BLOCK + 123, 5))
        out += [bytes(b) for b in got]
    return out


def test_processes_reading_the_same_blocks_at_once_leave_one_file_each(
    objects: Path, tmp_path: Path
) -> None:
    """Four processes read overlapping blocks together: every answer is right, each block
    has one intact file, and the ledger counts each once."""
    ctx = multiprocessing.get_context("spawn")
    with ctx.Pool(4) as pool:
        results = pool.starmap(
            _read_all,
            [(str(tmp_path / "cache"), str(objects), s % 2, _STREAMED[0]) for s in range(4)],
        )
    assert results[0] == results[2] and results[1] == results[3]
    store = small_store(tmp_path / "cache")
    used = store.used_bytes()
    found, records = store.listing()
    assert used == sum(size for size, _ in found.values()) + RECORD_BYTES * len(records)
    for key in found:
        intact = store.read(key, [(0, 1)])
        assert intact is not None and intact.parts is not None
    assert being_written(tmp_path / "cache") == []


def test_no_cache_dir_means_the_store_itself(objects: Path) -> None:
    inner = DirFetcher(objects)
    assert cached(inner, None, capacity_bytes=1) is inner


def test_fetchers_of_one_process_share_one_store(objects: Path, tmp_path: Path) -> None:
    """Every session's fetcher in a worker uses the same ledger descriptor."""
    a = cached(DirFetcher(objects), tmp_path / "c", capacity_bytes=1 << 20)
    b = cached(DirFetcher(objects), tmp_path / "c", capacity_bytes=1 << 20)
    assert isinstance(a, CachingFetcher) and isinstance(b, CachingFetcher)
    assert a.store is b.store


def test_a_cached_objects_size_needs_no_request(objects: Path, tmp_path: Path) -> None:
    """The size recorded with an object's first block answers later, with the store gone."""
    fetcher, inner = make(objects, tmp_path / "cache")
    url = inner.url("shard0.bin")
    fetcher.fetch(url, [(0, 1)])
    again, inner2 = make(objects, tmp_path / "cache")
    inner2.stopped = True
    assert again.size(url) == (objects / "shard0.bin").stat().st_size
    with pytest.raises(BadSample) as caught:
        again.size(inner2.url("shard1.bin"))
    assert caught.value.kind == "transient"


def test_a_hit_reads_and_checks_only_the_chunks_it_needs(objects: Path, tmp_path: Path) -> None:
    """A few bytes of a cached block cost a read of their chunk: a flipped byte in another
    chunk of the block does not spoil them (it is found when that chunk is read)."""
    fetcher, inner = make(objects, tmp_path / "cache")
    url = inner.url("shard0.bin")
    data = (objects / "shard0.bin").read_bytes()
    fetcher.fetch(url, [(0, BLOCK)])
    path = fetcher.store.path(BlockKey(object_hash(url), 0))
    raw = bytearray(path.read_bytes())
    raw[len(raw) - 1] ^= 0xFF  # in the block's last chunk
    path.write_bytes(bytes(raw))
    inner.requests.clear()
    assert fetcher.fetch(url, [(10, 20)]) == [data[10:30]]
    assert inner.requests == [], "the first chunk is intact: no request"
    assert fetcher.fetch(url, [(BLOCK - 5, 5)]) == [data[BLOCK - 5 : BLOCK]]
    assert inner.requests == [(url, [(0, BLOCK)])], "the bad chunk sent the block back"


class _HeldFetcher(StatDirFetcher):
    """A store whose first request waits until the test lets it go."""

    def __init__(self, root: Path) -> None:
        super().__init__(root)
        self.inside = threading.Event()
        self.go = threading.Event()
        self._first = True

    def fetch(self, url: str, ranges: Sequence[tuple[int, int]]) -> list[bytes]:
        with self._lock:
            first, self._first = self._first, False
        if first:
            self.inside.set()
            assert self.go.wait(30), "the test never let the first fetch go"
        return super().fetch(url, ranges)


def test_a_reader_waits_for_a_block_another_is_fetching_and_reads_its_file(
    objects: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """While one reader fetches blocks 0-2 of an object (its request held), a second reader
    of a few bytes of block 1 waits for that fetch and reads the block from the disk: the
    store answers one request in all."""
    inner = _HeldFetcher(objects)
    store = small_store(tmp_path / "c")
    fetcher = CachingFetcher(inner, store, stats=CacheStats())
    url = inner.url("shard0.bin")
    data = (objects / "shard0.bin").read_bytes()
    asking = threading.Event()
    real = FetchLocks.hold

    def hold(self: FetchLocks, keys: Sequence[BlockKey], *, wait: bool = True) -> Any:
        if threading.current_thread().name == "second":
            asking.set()
        return real(self, keys, wait=wait)

    monkeypatch.setattr(FetchLocks, "hold", hold)
    first: list[bytes] = []
    second: list[bytes] = []
    a = threading.Thread(
        target=lambda: first.extend(bytes(b) for b in fetcher.fetch(url, [(0, 3 * BLOCK)]))
    )
    b = threading.Thread(
        target=lambda: second.extend(bytes(x) for x in fetcher.fetch(url, [(BLOCK + 10, 100)])),
        name="second",
    )
    a.start()
    assert inner.inside.wait(30)
    b.start()
    try:
        assert asking.wait(30)  # the second reader missed block 1 and asks for its lock
    finally:
        inner.go.set()
        a.join(30)
        b.join(30)
    assert first == [data[: 3 * BLOCK]]
    assert second == [data[BLOCK + 10 : BLOCK + 110]]
    assert inner.requests == [(url, [(0, 3 * BLOCK)])]
    assert sorted(k.index for k in store.blocks()) == [0, 1, 2]


def test_a_prefetch_leaves_a_block_being_fetched_to_its_fetcher(
    objects: Path, tmp_path: Path
) -> None:
    inner = _HeldFetcher(objects)
    store = small_store(tmp_path / "c")
    fetcher = CachingFetcher(inner, store, stats=CacheStats())
    url = inner.url("shard0.bin")
    reader = threading.Thread(target=lambda: fetcher.fetch(url, [(0, 2 * BLOCK)]))
    reader.start()
    assert inner.inside.wait(30)
    try:
        # Blocks 0 and 1 are being fetched: only block 2 is the prefetch's to fetch.
        assert fetcher.prefetch(url, [(0, 3 * BLOCK)]) == 1
        assert inner.requests == [(url, [(2 * BLOCK, BLOCK)])]  # the held one is not in yet
    finally:
        inner.go.set()
        reader.join(30)
    assert sorted(k.index for k in store.blocks()) == [0, 1, 2]


def _hold_stripe(cache: str, key: tuple[str, int], held: Any, release: Any) -> bool:
    store = small_store(Path(cache), 1 << 20)
    with store.fetch_locks.hold([BlockKey(*key)]) as mine:
        held.set()
        release.wait(30)
        return BlockKey(*key) in mine


def test_fetch_locks_exclude_other_processes_and_go_with_them(tmp_path: Path) -> None:
    """A block's fetch lock held by another process is refused to a taker that will not
    wait, and given once that process lets go."""
    ctx = multiprocessing.get_context("spawn")
    key = (object_hash("s3://b/k"), 3)
    other = BlockKey(object_hash("s3://b/other"), 0)
    store = small_store(tmp_path / "c", 1 << 20)
    with ctx.Manager() as manager, ctx.Pool(1) as pool:
        held, release = manager.Event(), manager.Event()
        result = pool.apply_async(_hold_stripe, (str(tmp_path / "c"), key, held, release))
        assert held.wait(60)
        with store.fetch_locks.hold([BlockKey(*key), other], wait=False) as mine:
            assert mine == {other}
        release.set()
        assert result.get(60) is True
    with store.fetch_locks.hold([BlockKey(*key)], wait=False) as mine:
        assert mine == {BlockKey(*key)}
