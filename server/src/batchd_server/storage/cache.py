"""The node cache: a :class:`~batchd_server.storage.base.RangeFetcher` that keeps what it
fetched on a local disk, shared by every process and session of the server.

A worker's read of some ranges of an object becomes reads of the aligned blocks they fall in
(NOTE [ Cache files ] in ``blocks.py``): blocks on disk are read and checked, the missing
ones are fetched from the store in one request of one range per run of neighbouring blocks,
kept, and the asked ranges cut out of them. A store that streams (``StreamsRanges``: S3)
has each run's answer written to its blocks' files as it arrives (``BlockWriter``), and the
reader keeps copies of only its ranges: no buffer per block. Nothing in a worker decides
what leaves the cache: the cache manager in the server's main process does, from the plans
of the live sessions (``cache_policy/manager.py``), and prefetches through a fetcher of
this class too.

An object's size is looked up once (its record beside its blocks, else the inner fetcher's
``head``, with the version, or ``size``: a HEAD; a whole-object read,
:meth:`CachingFetcher.fetch_whole`, needs none: its one GET answers the size, which is then
recorded) so that the last block is asked for exactly; with no size known, a block is
fetched up to the last byte asked of it, and a later read that needs more of it fetches it
again. A range past the recorded size is ``unreadable``.

The cache holds one version of an object (NOTE [ Object versions ] in ``block_format.py``):
the one recorded with its size, whose every block is filled by asking the store for it, in
any process. When the store says the object changed (rewritten in place under the same key), the
object's blocks and record are dropped, its new version recorded, and what was asked read
again, all of it from the new version, with a warning; when it changes again during that
read, the read fails as an ``unreadable`` sample.

What a process read through its fetchers (hits, misses, bytes, the latency of each request
to the store) is counted in :data:`STATS`; a worker sends its counts back with each result
and the server adds them to its metrics (``metrics.node_cache.record_cache``).
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Final, Protocol, runtime_checkable

from batchd_server.pipelines.base import BadSample
from batchd_server.storage.base import (
    ObjectChanged,
    PinsVersions,
    RangeFetcher,
    StreamsRanges,
    TooLarge,
    WholeFetcher,
)
from batchd_server.storage.block_filling import fetch_unkept, fill_run, short_answer
from batchd_server.storage.block_format import version_tag
from batchd_server.storage.blocks import (
    BLOCK_BYTES,
    BlockKey,
    BlockRead,
    BlockStore,
    ObjectMeta,
    object_hash,
)
from batchd_server.storage.cache_stats import STATS, CacheStats, NodeCacheCounts
from batchd_server.storage.paths import sample_url

__all__ = [
    "STATS",
    "CacheStats",
    "CachingFetcher",
    "NodeCacheCounts",
    "SizesObjects",
    "cached",
    "object_url",
]

logger = logging.getLogger(__name__)

_MAX_SIZES: Final = 1 << 16
"""Object sizes a fetcher remembers in memory (the records on disk keep them all)."""


@runtime_checkable
class SizesObjects(Protocol):
    """A fetcher that can also say an object's size (a HEAD request)."""

    def size(self, url: str) -> int:
        """Raises BadSample (``missing``, ``transient``) as ``RangeFetcher.fetch`` does."""
        ...


def object_url(root: str, path: str) -> str:
    """The URL of a catalog path under a dataset root (``s3://bucket/prefix`` + ``a/b.tar``),
    by the one rule the reader and ingest use (``storage/paths.py``).

    Raises:
        BadSample: ``unsafe_path``: a path no reader reads (absolute, ``..``, ...).
    """
    return sample_url(root, path)


class CachingFetcher:
    """A :class:`RangeFetcher` over ``inner`` that keeps every block it fetches in ``store``.

    Thread-safe (a worker uses it from one thread, the cache manager's prefetch from many).

    Args:
        inner: The store's fetcher.
        store: The blocks on disk.
        stats: Where the counts go (default: this process's :data:`STATS`).
    """

    coalesces = True
    """Misses are fetched as runs of neighbouring blocks, so a reader need not merge nearby
    ranges into one (``ObjectFiles``)."""

    def __init__(
        self, inner: RangeFetcher, store: BlockStore, *, stats: CacheStats | None = None
    ) -> None:
        self.inner = inner
        # What the inner fetcher can do, asked once (a runtime Protocol check is slow).
        self._whole = inner if isinstance(inner, WholeFetcher) else None
        self._sizer = inner if isinstance(inner, SizesObjects) else None
        self._streams = inner if isinstance(inner, StreamsRanges) else None
        self._pins = inner if isinstance(inner, PinsVersions) else None
        self.store = store
        self.stats = STATS if stats is None else stats
        self._known: dict[str, tuple[ObjectMeta, int]] = {}
        """URL -> its record as this process knows it, and its version's ``version_tag``."""
        store.on_corrupt = lambda: self.stats.add(corrupt=1)

    def fetch(self, url: str, ranges: Sequence[tuple[int, int]]) -> list[bytes | memoryview]:
        """The bytes of each range, from the disk where cached, else from the store (and kept).

        Raises:
            BadSample: ``missing``/``transient`` from the store, or ``unreadable`` for a range
                past the end of the object (by its recorded size) or a short answer.
        """
        blocks, _ = self._blocks(url, ranges, prefetch=False)
        return [self._cut(blocks, offset, length) for offset, length in ranges]

    def prefetch(self, url: str, ranges: Sequence[tuple[int, int]]) -> int:
        """Cache the blocks that ``ranges`` touch; how many had to be fetched.

        Raises:
            BadSample: as :meth:`fetch`.
        """
        return self._blocks(url, ranges, prefetch=True)[1]

    def fetch_whole(self, url: str, max_bytes: int) -> bytes | memoryview:
        """The whole object: from its cached blocks when its size is recorded, else in one
        GET without a HEAD first (when the inner fetcher can), its size then recorded and its
        blocks kept from the bytes in hand.

        Raises:
            TooLarge: the object has more than ``max_bytes``.
            BadSample: as :meth:`fetch`.
        """
        size, data = self._whole_size(url, max_bytes, prefetch=False)
        if data is not None:
            return data
        if not size:
            return b""
        if size <= self.store.block_bytes:
            known = self._known.get(url)
            version = 0 if known is None else known[1]
            data = self.store.read_whole(BlockKey(object_hash(url), 0), size, version)
            if data is not None:
                self.stats.add(hits=1, hit_bytes=size)
                return data
        return bytes(self.fetch(url, [(0, size)])[0])

    def prefetch_whole(self, url: str, max_bytes: int) -> int:
        """Cache the whole object, counted as a prefetch; how many blocks were fetched (0:
        it looked cached). An object never seen costs one GET where the inner fetcher can
        read it whole (no HEAD first), as a reader's :meth:`fetch_whole` does.

        Raises:
            TooLarge: the object has more than ``max_bytes``.
            BadSample: as :meth:`fetch`.
        """
        if self.has_whole(url):
            return 0
        size, data = self._whole_size(url, max_bytes, prefetch=True)
        if data is not None:
            return -(-len(data) // self.store.block_bytes)
        return self.prefetch(url, [(0, size)]) if size else 0

    def _whole_size(
        self, url: str, max_bytes: int, *, prefetch: bool
    ) -> tuple[int, bytes | memoryview | None]:
        """A whole object's size, checked against ``max_bytes``, and its bytes when learning
        the size meant fetching it (an object never seen, through a fetcher that reads whole
        objects: one GET, no HEAD first; its blocks are then kept)."""
        size = self._recorded_size(url)
        if size is None and self._whole is not None:
            data = self._get_whole(self._whole, url, max_bytes, prefetch=prefetch)
            return len(data), data
        if size is None:
            size = self.size(url)
        if size > max_bytes:
            raise TooLarge(url, size)
        return size, None

    def has_whole(self, url: str) -> bool:
        """Whether the whole object looks cached (its size recorded, a small object's block
        on disk): a reader then reads it where it is, rather than handing it to a prefetch
        thread, whose handoff costs more than the read. Not a promise: the block may be
        evicted before it is read, and is then fetched."""
        size = self._recorded_size(url)
        if size is None:
            return False
        return size <= self.store.block_bytes and self.has_ranges(url, [(0, size)])

    def has_ranges(self, url: str, ranges: Sequence[tuple[int, int]]) -> bool:
        """Whether every block ``ranges`` touch looks cached (its file is there): a reader
        then reads them in its own thread (as :meth:`has_whole`; not a promise either)."""
        b, h = self.store.block_bytes, object_hash(url)
        return all(
            os.path.exists(self.store.file(BlockKey(h, i)))
            for offset, length in ranges
            if length > 0
            for i in range(offset // b, (offset + length - 1) // b + 1)
        )

    def _get_whole(
        self, inner: WholeFetcher, url: str, max_bytes: int, *, prefetch: bool = False
    ) -> bytes | memoryview:
        """A whole object not known here: one GET, then its record and its blocks."""
        started = time.perf_counter()
        if self._pins is not None:
            tag, data = self._pins.fetch_whole_version(url, max_bytes)
        else:
            tag, data = None, inner.fetch_whole(url, max_bytes)
        self.stats.latency(time.perf_counter() - started)
        if len(data) > max_bytes:  # a client that does not bound its read: nothing is kept
            raise TooLarge(url, len(data))
        b = self.store.block_bytes
        count = -(-len(data) // b)
        self.stats.add(
            misses=0 if prefetch else count,
            fetched_bytes=len(data),
            prefetched_bytes=len(data) if prefetch else 0,
        )
        meta = ObjectMeta(url, len(data), tag)
        self.store.record(meta)
        version = self._remember(meta)[1]
        h = object_hash(url)
        view = memoryview(data)
        for i in range(count):
            self.store.write(BlockKey(h, i), view[i * b : (i + 1) * b], version=version)
        return data

    def _recorded_size(self, url: str) -> int | None:
        """``url``'s size as this process or the cache's record knows it (no request);
        None when neither does."""
        known = self._recorded(url)
        return None if known is None else known[0].size

    def _recorded(self, url: str) -> tuple[ObjectMeta, int] | None:
        """``url``'s record (and its version's tag) as this process or the cache knows it
        (no request); None when neither does."""
        known = self._known.get(url)
        if known is None:
            meta = self.store.meta(url)
            if meta is not None:
                known = self._remember(meta)
        return known

    def _remember(self, meta: ObjectMeta) -> tuple[ObjectMeta, int]:
        if len(self._known) >= _MAX_SIZES:
            self._known.clear()
        known = self._known[meta.url] = (meta, version_tag(meta.version))
        return known

    def size(self, url: str) -> int:
        """``url``'s size in bytes: as recorded when it was first cached (no request, so a
        cached object's size is known with the store gone), else the store's answer.

        Raises:
            BadSample: the store's (``missing``, ``transient``), or ``unreadable`` when the
                inner fetcher cannot tell sizes.
        """
        size = self.known_size(url)
        if size < 0:
            raise BadSample(
                "unreadable", f"{url}: the object store's client cannot say the object's size"
            )
        return size

    def known_size(self, url: str) -> int:
        """As :meth:`size`, but -1 when the inner fetcher cannot tell sizes."""
        return self._object(url)[0].size

    def _object(self, url: str) -> tuple[ObjectMeta, int]:
        """``url``'s record (size -1 when the inner fetcher cannot tell sizes), asked of the
        store (and recorded) when neither this process nor the cache knows it."""
        known = self._recorded(url)
        if known is not None:
            return known
        if self._pins is not None:
            meta = ObjectMeta(url, *self._pins.head(url))
        elif self._sizer is not None:
            meta = ObjectMeta(url, self._sizer.size(url))
        else:
            return ObjectMeta(url, -1), 0
        self.store.record(meta)
        return self._remember(meta)

    def _blocks(
        self, url: str, ranges: Sequence[tuple[int, int]], *, prefetch: bool
    ) -> tuple[dict[int, BlockRead], int]:
        """For every block that ``ranges`` touch, the parts of it they need; and how many
        blocks were fetched. All of one version of the object: when the store says it
        changed, its cached blocks are dropped and all of them read again from the new one
        (NOTE [ Object versions ] in ``block_format.py``).

        Raises:
            BadSample: as :meth:`fetch`, or ``unreadable`` when the object changed again
                while it was read anew.
        """
        known = self._object(url)
        try:
            return self._version_blocks(url, known, ranges, prefetch=prefetch)
        except ObjectChanged:
            pass
        renewed = self._renew(url, known[0])
        try:
            return self._version_blocks(url, renewed, ranges, prefetch=prefetch)
        except ObjectChanged:
            raise BadSample(
                "unreadable",
                f"{url}: the object changed while it was read (rewritten in place); its "
                "samples are read again at the next epoch. Objects a session reads should "
                "not be rewritten: write a new key, and ingest a new version of the dataset",
            ) from None

    def _renew(self, url: str, old: ObjectMeta) -> tuple[ObjectMeta, int]:
        """The object's record once the store said it is no longer of ``old``'s version:
        the one another process recorded since, else (its blocks and record dropped) the
        store's answer, recorded."""
        self._known.pop(url, None)
        found = self.store.meta(url)
        if found is not None and found.version != old.version:
            known = self._remember(found)
        else:
            self.store.forget(url)
            known = self._object(url)
        logger.warning(
            "%s changed in place (its version was %s, is now %s): the node cache dropped "
            "its blocks, and it is read whole from the new version; re-ingest the dataset "
            "if its byte ranges moved",
            url,
            old.version or "not known",
            known[0].version or "not known",
        )
        return known

    def _version_blocks(
        self,
        url: str,
        known: tuple[ObjectMeta, int],
        ranges: Sequence[tuple[int, int]],
        *,
        prefetch: bool,
    ) -> tuple[dict[int, BlockRead], int]:
        """:meth:`_blocks` of the version ``known`` names.

        Raises:
            ObjectChanged: the store has another version.
        """
        meta, version = known
        size = meta.size
        b = self.store.block_bytes
        need: dict[int, list[tuple[int, int]]] = {}
        """Block -> the spans of it the ranges need, from its first byte."""
        for offset, length in ranges:
            if offset < 0 or length < 0:
                raise BadSample("unreadable", f"{url}: byte range ({offset}, {length}) is invalid")
            end = offset + length
            if size >= 0 and end > size:
                raise BadSample(
                    "unreadable",
                    f"{url}: byte range [{offset}, {end}) is past the end of the object "
                    f"({size} bytes)",
                )
            if length == 0:
                continue
            for i in range(offset // b, (end - 1) // b + 1):
                span = (max(offset, i * b) - i * b, min(end, (i + 1) * b) - i * b)
                need.setdefault(i, []).append(span)
        h = object_hash(url)
        have: dict[int, BlockRead] = {}
        short: set[int] = set()
        for i in sorted(need):
            found = self.store.read(BlockKey(h, i), need[i], version)
            if found is None:
                continue
            if found.parts is not None:
                have[i] = found
            else:
                short.add(i)
        missing = [i for i in sorted(need) if i not in have]
        if not missing:
            self._count(have, 0, prefetch=prefetch)
            return have, 0
        keys = {i: BlockKey(h, i) for i in missing}
        # A reader waits for the blocks another reader is fetching, then reads them from the
        # disk: at the start of a cold epoch, the workers and the prefetch all want most
        # blocks of a shuffled dataset at once, and each block comes from the store once. The
        # prefetch does not wait: a block being fetched is its fetcher's.
        with self.store.fetch_locks.hold(list(keys.values()), wait=not prefetch) as mine:
            for i in missing:  # whoever held a lock before may have cached its blocks
                if keys[i] in mine:
                    found = self.store.read(keys[i], need[i], version)
                    if found is not None and found.parts is not None:
                        have[i] = found
                        short.discard(i)
            fetch = [i for i in missing if i not in have and keys[i] in mine]
            self._count(have, len(fetch), prefetch=prefetch)
            if fetch:
                have.update(self._fetch_missing(known, need, fetch, short, prefetch=prefetch))
                if size >= 0 and self.store.meta(url) is None:  # evicted with earlier blocks
                    self.store.record(meta)
        return have, len(fetch)

    def _count(self, hits: dict[int, BlockRead], misses: int, *, prefetch: bool) -> None:
        """A reader's hits (the blocks found on disk) and misses; a prefetch counts none."""
        if not prefetch:
            hit_bytes = sum(len(d) for r in hits.values() for _, d in r.parts or ())
            self.stats.add(hits=len(hits), misses=misses, hit_bytes=hit_bytes)

    def _fetch_missing(
        self,
        known: tuple[ObjectMeta, int],
        need: dict[int, list[tuple[int, int]]],
        missing: list[int],
        short: set[int],
        *,
        prefetch: bool,
    ) -> dict[int, BlockRead]:
        """Fetch ``missing`` blocks, one range per run of neighbours, and keep them; those
        the cache has no room for, only in the spans asked (``block_filling.fetch_unkept``)."""
        meta, b = known[0], self.store.block_bytes
        size = meta.size
        room, keep = self.store.room(), 0
        for i in missing:  # a block's file: what of it is fetched (all of it, if size known)
            room -= self.store.file_bytes(b if size < 0 else min(b, size - i * b))
            if room < 0:
                break
            keep += 1
        kept, unkept = missing[:keep], missing[keep:]
        got: dict[int, BlockRead] = {}
        if unkept and not prefetch:  # a prefetch fetches none: nothing of them could be kept
            got = fetch_unkept(
                lambda spans: self._get(meta, spans), self.stats, meta.url, b, need, unkept
            )
        if kept:
            got.update(self._fetch_kept(known, need, kept, short, prefetch=prefetch))
        return got

    def _fetch_kept(
        self,
        known: tuple[ObjectMeta, int],
        need: dict[int, list[tuple[int, int]]],
        missing: list[int],
        short: set[int],
        *,
        prefetch: bool,
    ) -> dict[int, BlockRead]:
        """Fetch ``missing`` blocks whole, one range per run of neighbours, and keep them."""
        (meta, version), url, size = known, known[0].url, known[0].size
        b = self.store.block_bytes
        runs: list[list[int]] = []
        for i in missing:
            if runs and runs[-1][-1] == i - 1:
                runs[-1].append(i)
            else:
                runs.append([i])

        def want_end(i: int) -> int:
            return min((i + 1) * b, size) if size >= 0 else i * b + max(hi for _, hi in need[i])

        spans = [(run[0] * b, want_end(run[-1]) - run[0] * b) for run in runs]
        if self._streams is not None:
            return self._stream_missing(self._streams, known, runs, spans, need, short, prefetch)
        started = time.perf_counter()
        datas = self._get(meta, spans)
        self.stats.latency(time.perf_counter() - started)
        fetched = sum(len(d) for d in datas)
        self.stats.add(fetched_bytes=fetched, prefetched_bytes=fetched if prefetch else 0)
        got: dict[int, BlockRead] = {}
        h = object_hash(url)
        for run, (start, length), data in zip(runs, spans, datas, strict=True):
            if len(data) != length:
                raise short_answer(url, len(data), length, start)
            view = memoryview(data)
            for i in run:
                # A view, not a copy: the block's file and the reader take it from here.
                content = view[i * b - start : min((i + 1) * b, start + length) - start]
                got[i] = BlockRead(len(content), [(0, content)])
                self.store.write(BlockKey(h, i), content, replace=i in short, version=version)
        return got

    def _get(self, meta: ObjectMeta, spans: list[tuple[int, int]]) -> list[bytes | memoryview]:
        """The spans of the object, of the version ``meta`` names where the store can say."""
        if self._pins is not None:
            return self._pins.fetch_version(meta.url, spans, meta.version)
        return self.inner.fetch(meta.url, spans)

    def _stream_missing(
        self,
        inner: StreamsRanges,
        known: tuple[ObjectMeta, int],
        runs: list[list[int]],
        spans: list[tuple[int, int]],
        need: dict[int, list[tuple[int, int]]],
        short: set[int],
        prefetch: bool,
    ) -> dict[int, BlockRead]:
        """:meth:`_fetch_missing` through a fetcher that streams: the pieces of each run go
        to their blocks' files as they arrive (:class:`BlockWriter`), and a reader keeps
        copies of the spans it asked for. No buffer is taken per block: a fresh 4 MiB buffer,
        its pages touched for the first time, cost more CPU than the transfer did."""
        (meta, version), url = known, known[0].url
        got: dict[int, BlockRead] = {}
        for run, (start, length) in zip(runs, spans, strict=True):
            pieces = (  # a generator: nothing is asked before the first piece is
                inner.stream(url, start, length)
                if self._pins is None
                else self._pins.stream_version(url, start, length, meta.version)
            )
            got.update(
                fill_run(
                    self.store,
                    self.stats,
                    pieces,
                    url,
                    run,
                    (start, length),
                    need,
                    short,
                    prefetch=prefetch,
                    version=version,
                )
            )
        return got

    def _cut(self, blocks: dict[int, BlockRead], offset: int, length: int) -> bytes | memoryview:
        if length == 0:
            return b""
        b = self.store.block_bytes
        parts = []
        for i in range(offset // b, (offset + length - 1) // b + 1):
            lo, hi = max(offset, i * b) - i * b, min(offset + length, (i + 1) * b) - i * b
            parts.append(blocks[i].cut(lo, hi))
        return parts[0] if len(parts) == 1 else b"".join(parts)


_STORES: dict[tuple[int, Path, int, int], BlockStore] = {}
"""The block stores this process opened, by (pid, directory, capacity, block size): one
ledger descriptor each, however many sessions read. The pid keeps a forked child from
using its parent's descriptor, whose ``flock`` the two would share."""
_STORES_LOCK = threading.Lock()


def cached(
    inner: RangeFetcher,
    cache_dir: Path | None,
    *,
    capacity_bytes: int,
    block_bytes: int = BLOCK_BYTES,
) -> RangeFetcher:
    """``inner`` read through the node cache in ``cache_dir``; ``inner`` itself when there is
    none (``--cache-dir`` unset), or when the disk refuses to open it (a warning is logged).
    What the object-store reader calls to get its fetcher.

    Raises:
        FailedPrecondition: the directory may be changed by another user
            (``cache_dir.check_dir``): the server refuses to start on it.
    """
    if cache_dir is None:
        return inner
    key = (os.getpid(), cache_dir, capacity_bytes, block_bytes)
    with _STORES_LOCK:
        store = _STORES.get(key)
        if store is None or store.closed:
            try:
                store = BlockStore(
                    cache_dir, capacity_bytes=capacity_bytes, block_bytes=block_bytes
                )
            except OSError as e:  # a read-only or failing disk: read without the cache
                logger.warning(
                    "the node cache in %s cannot be opened (%s); objects are read from the "
                    "store without it until the disk is fixed",
                    cache_dir,
                    e.strerror or e,
                )
                return inner
            _STORES[key] = store
    return CachingFetcher(inner, store)
