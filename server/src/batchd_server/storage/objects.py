"""Read sample bytes from an object-store prefix: the sibling of ``storage/files.py``.

:class:`ObjectFiles` is the :class:`~batchd_server.storage.reader.SampleReader` of a dataset
whose root is ``s3://BUCKET/PREFIX`` (``storage/open.py`` picks a reader by the root's
scheme); its batch hooks (``stage``, ``prefetch``, ``warm``) do what a local reader's
skip. Every byte comes through a
:class:`~batchd_server.storage.base.RangeFetcher` (the store's client, or the node cache
around it), so this class knows nothing of HTTP.

- **Confinement.** A catalog path is untrusted: an absolute path, a ``..`` component, an
  empty component or a NUL would name a key outside the prefix, and is refused as
  ``unsafe_path`` before any request (``storage/paths.py``: the rule ingest applies too).
- **Coalescing.** A batch's byte ranges of one object are sorted and neighbours within
  :data:`OBJECT_GAP_BYTES` merged into runs (``storage/ranges.plan_reads``): a request
  costs a round trip of a millisecond or more, so fetching up to 1 MiB of gap is cheaper
  than another request; the gaps one object's runs span add up to at most
  :data:`OBJECT_EXTRA_BYTES` or the bytes asked, whichever is larger. Through the node
  cache only touching ranges are merged: the cache fetches its misses as runs of whole
  blocks anyway, and a gap read from its disk would be read and checked for nothing.
- **Several requests in flight.** The objects of a batch are fetched at once, from the
  process's one pool of fetch threads (``storage/fetch_pool.py``; the store's calls release
  the GIL), and a run of whole objects (image files) is fetched ahead by :meth:`prefetch`
  while the worker decodes the first ones. A fetch of one object's runs is itself one GET
  per run, several in flight, all of one version of the object (``storage/s3_gets.py``).
- **Bounded ahead.** What is fetched ahead is reserved first from the process's budget
  (``fetch_pool.AHEAD``), by its size when known, else by a guess from the sizes seen: a
  fetch ahead never brings more than it reserved (a larger object grows its reservation if
  the budget allows, else is left for :meth:`read`), so the budget holds while sizes are
  unknown. A read itself brings at most ``max_sample_bytes``.
- **Failures.** The client retries (see ``storage/s3.py``); what still fails is a bad sample
  of kind ``missing`` (naming the URL) or ``transient``. After one ``transient`` failure a
  batch's remaining fetches fail at once (the store is down: one retry window per batch,
  not one per sample); :meth:`begin_batch` clears that.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Final

import numpy as np
import numpy.typing as npt

from batchd._wire.lifetime import Closeable
from batchd_server.pipelines.base import BadSample
from batchd_server.storage.base import RangeFetcher, TooLarge, WholeFetcher
from batchd_server.storage.fetch_pool import AHEAD, AheadBudget, fetch_pool
from batchd_server.storage.paths import sample_url
from batchd_server.storage.ranges import Ranges, ReadPlan
from batchd_server.storage.reader import check_ranges, check_read, too_large

__all__ = [
    "OBJECT_EXTRA_BYTES",
    "OBJECT_GAP_BYTES",
    "PREFETCH_BYTES",
    "ObjectFiles",
]

OBJECT_GAP_BYTES: Final = 1 << 20
"""Ranges of one object closer than this are fetched in one request, the gap included."""
OBJECT_EXTRA_BYTES: Final = 4 << 20
"""Gap bytes one object's coalesced runs may fetch beyond what was asked, at least: the
bound is the larger of this and the bytes asked (a batch fetches at most twice what it
reads, plus this); the smallest gaps are bridged first."""
PREFETCH_BYTES: Final = 256 << 20
"""A batch's byte ranges staged at once, at most this many bytes in all."""
AHEAD_GUESS_BYTES: Final = 1 << 20
"""What a whole object of unknown size reserves of the budget ahead before any size is seen;
then twice the mean of the sizes seen (at least :data:`_MIN_GUESS_BYTES`)."""
_MIN_GUESS_BYTES: Final = 64 << 10
_MAX_SIZES: Final = 65536
_MAX_MAPS: Final = 8

SizeOf = Callable[[str], int]
"""The size of the object at a URL (a HEAD); raises BadSample like a fetch."""


class ObjectFiles(Closeable):
    """Confined reads of the objects under one ``s3://`` prefix, through a fetcher.

    Not thread-safe itself (a worker process holds one per session); its fetches run on
    threads, so the fetcher must be.

    Args:
        root: ``s3://BUCKET/PREFIX``.
        fetcher: Where the bytes come from (``storage/open.make_fetcher``).
        size_of: The size of an object, for whole-object reads.
        max_sample_bytes: The most bytes one sample may have; more is ``too_large``.
        ahead: The budget of bytes fetched ahead (default: the process's).
    """

    fresh_buffers: Final = True
    """What :meth:`read` and :meth:`read_ranges` return is memory of its own, never reused by
    a later read (a local reader's buffer is), so a caller may keep a view of it."""
    fetches_ahead: Final = True
    """A read costs a round trip: :meth:`stage` and :meth:`prefetch` fetch a batch's bytes
    together."""

    def __init__(
        self,
        root: str,
        fetcher: RangeFetcher,
        size_of: SizeOf,
        *,
        max_sample_bytes: int,
        ahead: AheadBudget | None = None,
    ) -> None:
        if max_sample_bytes < 1:
            raise ValueError(f"max_sample_bytes={max_sample_bytes} must be >= 1")
        self.root = root.rstrip("/")
        self.max_sample_bytes = max_sample_bytes
        self._fetcher = fetcher
        self._whole = fetcher if isinstance(fetcher, WholeFetcher) else None
        """The fetcher, when it reads a whole object in one GET (asked once: a check against
        a runtime Protocol costs microseconds, and a warm image's read is not much more)."""
        self._size_of = size_of
        self.cached: bool = getattr(fetcher, "coalesces", False)
        """Whether reads go through the node cache (a small read is then a file read)."""
        # Through the node cache, a gap between two ranges would be read from the disk and
        # checked for nothing: the cache itself fetches what it misses in runs of blocks.
        self._gap = 0 if self.cached else OBJECT_GAP_BYTES
        self._sizes: OrderedDict[str, int] = OrderedDict()
        self._sizes_lock = threading.Lock()
        self._maps: OrderedDict[str, npt.NDArray[np.uint8]] = OrderedDict()
        self._budget = AHEAD if ahead is None else ahead
        self._ahead: dict[str, _Ahead] = {}
        self._seen = [0, 0]
        """Whole objects read and their bytes: what an unknown size is guessed from."""
        self._staged: dict[tuple[str, int, int], memoryview] = {}
        """A batch's byte ranges fetched together (:meth:`stage`), by (path, offset, length)."""
        self._down: BadSample | None = None
        """The batch's first transient failure: later fetches in the batch fail with it."""

    # -- the SampleReader interface -------------------------------------------------------

    def begin_batch(self) -> None:
        """A new batch: fetches are tried again, and what was fetched ahead is dropped."""
        self._down = None
        self._drop_ahead()
        self._staged = {}

    def stage(self, ranges: Ranges) -> None:
        """Fetch a batch's byte ranges at once (as :meth:`read_ranges`: several objects in
        flight, through the node cache each block once) for :meth:`read` to serve until the
        next :meth:`begin_batch`. At most :data:`PREFETCH_BYTES`; a failure is left for
        :meth:`read` to meet again, sample by sample, and report."""
        self._staged = {}
        if not len(ranges) or int(ranges.lengths.sum()) > PREFETCH_BYTES:
            return
        try:
            groups, plans, fetched = self._fetch_planned(ranges)
        except BadSample:
            return
        paths, files, offsets, lengths = ranges.paths, ranges.files, ranges.offsets, ranges.lengths
        # Each sample is a view of the run its bytes came in (no copy into one buffer, as
        # read_ranges makes: warm from the node cache, that copy was most of what a batch
        # cost beyond local files' reads).
        names = [paths[f] for f in files.tolist()]
        offset_of, length_of = offsets.tolist(), lengths.tolist()
        for rows, plan, runs in zip(groups, plans, fetched, strict=True):
            views = [memoryview(run).cast("B") for run in runs]
            run_starts = plan.run_starts.tolist()
            run_of = np.searchsorted(plan.run_starts, plan.starts, side="right") - 1
            for row, start, r in zip(
                rows.tolist(), plan.starts.tolist(), run_of.tolist(), strict=True
            ):
                at, length = start - run_starts[r], length_of[row]
                self._staged[(names[row], offset_of[row], length)] = views[r][at : at + length]

    def read(self, path: str, offset: int = -1, length: int = -1) -> memoryview:
        """The bytes of one sample (``offset``/``length`` -1: the whole object, or to its
        end).

        Raises:
            BadSample: ``unsafe_path``, ``missing``, ``unreadable``, ``too_large``,
                ``bad_range`` or ``transient``.
        """
        url = self._url(path)
        check_read(url, offset, length)
        staged = self._staged.get((path, offset, length))
        if staged is not None:
            return staged
        whole = offset <= 0 and length == -1
        if whole:
            ahead = self._ahead.pop(path, None)
            if ahead is not None:
                try:
                    return memoryview(ahead.future.result())
                except _NotAhead:
                    pass  # over its reservation, and the budget had no more: read it here
                finally:
                    self._budget.give(ahead.reserved)
            return memoryview(self._fetch_whole(url, self.max_sample_bytes))
        start = max(offset, 0)
        if length == -1:
            length = self._size(url) - start
            if length < 0:
                raise BadSample("unreadable", f"{url}: offset {start} is past the object's end")
        self._check_size(url, length)
        return memoryview(self._fetch(url, [(start, length)])[0])

    def read_ranges(self, ranges: Ranges) -> tuple[npt.NDArray[np.uint8], npt.NDArray[np.int64]]:
        """Many samples' byte ranges, coalesced per object and fetched several objects at
        once; as :meth:`SampleFiles.read_ranges` (``data[starts[i]:][:lengths[i]]``).

        Raises:
            BadSample: as :meth:`read`; which sample is at fault is not said.
        """
        groups, plans, fetched = self._fetch_planned(ranges)
        total = sum(p.total_bytes for p in plans)
        data = np.empty(total, np.uint8)
        starts = np.empty(len(ranges), np.int64)
        base = 0
        for rows, plan, chunks in zip(groups, plans, fetched, strict=True):
            at = base
            for chunk in chunks:
                data[at : at + len(chunk)] = np.frombuffer(chunk, np.uint8)
                at += len(chunk)
            starts[rows] = plan.starts + base
            base = at
        return data, starts

    def _fetch_planned(
        self, ranges: Ranges
    ) -> tuple[list[npt.NDArray[np.intp]], list[ReadPlan], list[list[bytes | memoryview]]]:
        """The ranges' rows of each object, its read plan and the bytes of each of its runs,
        fetched several objects at once (as :meth:`read_ranges`)."""
        urls = [self._url(p) for p in ranges.paths]
        check_ranges(ranges, urls, self.max_sample_bytes)
        groups = ranges.by_file()
        plans = ranges.plans(self._gap, None if self.cached else OBJECT_EXTRA_BYTES)
        runs = [
            list(zip(p.run_offsets.tolist(), p.run_lengths.tolist(), strict=True)) for p in plans
        ]
        if len(urls) == 1:
            fetched = [self._fetch(urls[0], runs[0])]
        else:
            # Objects whose blocks are on the node's disk are read here, after the others
            # are handed to the fetch threads: a handoff costs more than a read of the disk.
            on_disk = getattr(self._fetcher, "has_ranges", None)
            futures = [
                None
                if on_disk is not None and on_disk(u, r)
                else self._threads().submit(self._fetch, u, r)
                for u, r in zip(urls, runs, strict=True)
            ]
            fetched = [
                self._fetch(u, r) if f is None else f.result()
                for u, r, f in zip(urls, runs, futures, strict=True)
            ]
        return groups, plans, fetched

    def warm(self, ranges: Ranges) -> None:
        """Bring the blocks of these byte ranges into the node cache, several objects at
        once, and return nothing: for a caller about to make many small reads inside them.
        Objects whose blocks are all on the disk are left alone; failures are left for the
        reads to meet and report."""
        prefetch = getattr(self._fetcher, "prefetch", None)
        on_disk = getattr(self._fetcher, "has_ranges", None)
        if prefetch is None or not len(ranges):
            return
        paths, files, offsets, lengths = ranges.paths, ranges.files, ranges.offsets, ranges.lengths
        jobs = []
        for k in np.unique(files).tolist():
            mine = files == k
            try:
                url = self._url(paths[k])
            except BadSample:
                continue
            spans = list(zip(offsets[mine].tolist(), lengths[mine].tolist(), strict=True))
            if on_disk is None or not on_disk(url, spans):
                jobs.append(self._threads().submit(prefetch, url, spans))
        for job in jobs:
            try:
                job.result()
            except BadSample:
                continue

    def size(self, path: str) -> int:
        """The size in bytes of the object ``path`` names (a Parquet footer is read from its
        end); remembered like a whole-object read's.

        Raises:
            BadSample: ``unsafe_path``, ``missing`` or ``transient``.
        """
        return self._size(self._url(path))

    def map_whole(self, path: str) -> npt.NDArray[np.uint8]:
        """A whole object as a read-only array, cached (least recently used first out).

        Raises:
            BadSample: As :meth:`read`.
        """
        cached = self._maps.get(path)
        if cached is not None:
            self._maps.move_to_end(path)
            return cached
        array = np.frombuffer(bytes(self.read(path)), np.uint8)
        self._maps[path] = array
        if len(self._maps) > _MAX_MAPS:
            self._maps.popitem(last=False)
        return array

    @property
    def ahead_bytes(self) -> int:
        """Bytes this reader reserved for its fetches ahead (in flight or not yet read)."""
        return sum(a.reserved for a in list(self._ahead.values()))

    def prefetch(self, paths: Sequence[str]) -> None:
        """Start fetching these whole objects (a run of image files about to be decoded one
        by one), in order, while the budget ahead has room for them (see the module docs);
        :meth:`read` then takes them. Problems are left for :meth:`read` to report."""
        pool = self._threads()
        cached = getattr(self._fetcher, "has_whole", None)
        for path in paths:
            if path in self._ahead:
                continue
            try:
                url = self._url(path)
            except BadSample:
                continue
            if cached is not None and cached(url):
                continue  # on the node's disk: read() reads it in this thread, no handoff
            with self._sizes_lock:
                known = self._sizes.get(url)
            if known is not None and known > self.max_sample_bytes:
                continue  # read() says too_large
            want = max(self._guess() if known is None else known, 1)
            if not self._budget.take(want):
                break
            ahead = _Ahead(want)
            ahead.future = pool.submit(self._fetch_ahead, ahead, url)
            self._ahead[path] = ahead

    def close(self) -> None:
        """Stop fetching ahead and drop what was fetched. Idempotent. (A fetch already
        running is not waited for: one stuck in the retries of a store that is down would
        hold the worker's session close for the retry window; it ends on its own.)"""
        self._drop_ahead()
        self._maps.clear()

    # -- internals -------------------------------------------------------------------------

    def _url(self, path: str) -> str:
        return sample_url(self.root, path)

    def _check_size(self, url: str, count: int) -> None:
        if count > self.max_sample_bytes:
            raise too_large(url, count, self.max_sample_bytes)

    def _size(self, url: str) -> int:
        with self._sizes_lock:
            size = self._sizes.get(url)
        if size is None:
            if self._down is not None:
                raise self._down
            try:
                size = self._size_of(url)
            except BadSample as e:
                if e.kind == "transient":
                    self._down = e
                raise
            self._remember(url, size)
        return size

    def _guess(self) -> int:
        """What a whole object of unknown size reserves ahead (see the module docs)."""
        count, total = self._seen
        guess = max(2 * total // count, _MIN_GUESS_BYTES) if count else AHEAD_GUESS_BYTES
        return min(guess, self.max_sample_bytes)

    def _fetch_ahead(self, ahead: _Ahead, url: str) -> bytes | memoryview:
        """A whole object fetched ahead, bringing at most what ``ahead`` reserved: a larger
        one grows the reservation if the budget has room, else raises :class:`_NotAhead`."""
        try:
            return self._fetch_whole(url, ahead.reserved)
        except TooLarge as e:  # over the reservation, within max_sample_bytes
            if not self._budget.take(e.size - ahead.reserved):
                raise _NotAhead() from None
            ahead.reserved = e.size
            return self._fetch_whole(url, e.size)

    def _fetch_whole(self, url: str, limit: int) -> bytes | memoryview:
        """The whole object, at most ``limit`` bytes of it fetched.

        Raises:
            BadSample: ``too_large`` over ``max_sample_bytes``, or as :meth:`read`.
            TooLarge: over ``limit`` but within ``max_sample_bytes`` (a fetch ahead).
        """
        if self._whole is not None:
            return self._get_whole(self._whole, url, limit)
        size = self._size(url)
        self._check_size(url, size)
        if size > limit:
            raise TooLarge(url, size)
        return self._fetch(url, [(0, size)])[0] if size else b""

    def _get_whole(self, fetcher: WholeFetcher, url: str, limit: int) -> bytes | memoryview:
        """One GET of the whole object, no HEAD first; the size comes with the answer."""
        down = self._down
        if down is not None:
            raise BadSample(down.kind, str(down))
        try:
            data = fetcher.fetch_whole(url, limit)
        except TooLarge as e:
            self._remember(url, e.size)
            self._check_size(url, e.size)
            raise
        except BadSample as e:
            if e.kind == "transient":
                self._down = e
            raise
        self._remember(url, len(data), seen=True)
        return data

    def _remember(self, url: str, size: int, *, seen: bool = False) -> None:
        with self._sizes_lock:
            if seen:
                self._seen[0] += 1
                self._seen[1] += size
            self._sizes[url] = size
            if len(self._sizes) > _MAX_SIZES:
                self._sizes.popitem(last=False)

    def _fetch(self, url: str, ranges: list[tuple[int, int]]) -> list[bytes | memoryview]:
        down = self._down
        if down is not None:
            raise BadSample(down.kind, str(down))
        try:
            got = self._fetcher.fetch(url, ranges)
        except BadSample as e:
            if e.kind == "transient":
                self._down = e
            raise
        for (offset, length), chunk in zip(ranges, got, strict=True):
            if len(chunk) != length:
                raise BadSample(
                    "unreadable",
                    f"{url}: the object ended at byte {offset + len(chunk)}, inside the byte "
                    f"range [{offset}, {offset + length})",
                )
        return got

    def _threads(self) -> ThreadPoolExecutor:
        return fetch_pool()

    def _drop_ahead(self) -> None:
        dropped, self._ahead = self._ahead, {}
        for ahead in dropped.values():
            if ahead.future.cancel():
                self._budget.give(ahead.reserved)
            else:  # running or done: its bytes go when it ends
                ahead.future.add_done_callback(ahead.give_back(self._budget))


class _Ahead:
    """A whole object being fetched ahead, and the bytes it reserved of the budget."""

    future: Future[bytes | memoryview]

    def __init__(self, reserved: int) -> None:
        self.reserved = reserved

    def give_back(self, budget: AheadBudget) -> Callable[[object], None]:
        return lambda _: budget.give(self.reserved)


class _NotAhead(Exception):
    """A fetch ahead found its object larger than the budget had room for: not fetched."""
