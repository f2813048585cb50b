"""Byte ranges of one object, each its own GET, all of one version (ETag).

``obstore.get_ranges`` merges ranges less than 1 MiB apart into one request, which would
undo the bound on gap bytes that ``storage/ranges.plan_reads`` keeps, and it can send no
precondition. So each range the reader planned is one GET here (several in flight at once,
on this process's event loop), with ``If-Match`` once the object's ETag is known.

**Versions.** An object rewritten in place under the same key while a session reads it
would otherwise be served truncated, or its ranges from two versions mixed. So the ETag (or
version id) of an object is recorded at its first read by a fetcher (:class:`Versions`: a
fetcher belongs to one reader, a reader to one session and source), and every later range
GET asks for that version (``If-Match``). When the store answers that the object changed
(412), or the ranges of one call came back from different versions, the call's ranges are
fetched again, all of the new version, which is then recorded, and a warning is logged: a
sample is never made of two versions' bytes. When the object changes again during that
refetch, the read fails as an ``unreadable`` sample saying so.
"""

from __future__ import annotations

import asyncio
import logging
import os
import threading
from collections import OrderedDict
from collections.abc import Coroutine, Sequence
from typing import Any, Final, TypeVar

import obstore
from obstore.exceptions import PreconditionError
from obstore.store import ObjectStore

from batchd_server.pipelines.base import BadSample

__all__ = ["MAX_IN_FLIGHT", "Changed", "Versions", "get_ranges", "get_version", "tag_of"]

logger = logging.getLogger(__name__)

MAX_IN_FLIGHT: Final = 16
"""Range GETs of one call in flight at once (``get_ranges`` keeps 10)."""
_MAX_VERSIONS: Final = 1 << 16

T = TypeVar("T")


class Changed(Exception):
    """The object is not (all) of the version asked for."""


class Versions:
    """The version (ETag, else version id) of each object a fetcher read, as first seen.
    Thread-safe; bounded (the least recently recorded go first)."""

    def __init__(self) -> None:
        self._tags: OrderedDict[str, str] = OrderedDict()
        self._lock = threading.Lock()

    def get(self, url: str) -> str | None:
        with self._lock:
            return self._tags.get(url)

    def record(self, url: str, tag: str | None) -> None:
        if tag is None:
            return
        with self._lock:
            self._tags[url] = tag
            if len(self._tags) > _MAX_VERSIONS:
                self._tags.popitem(last=False)


def tag_of(meta: Any) -> str | None:
    """An object's version as its metadata says: its ETag, else its version id."""
    return meta.get("e_tag") or meta.get("version")


class _Loop:
    """This process's event loop for range GETs, on a daemon thread, made on first use."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._pid = -1

    def run(self, job: Coroutine[Any, Any, T]) -> T:
        with self._lock:
            if self._loop is None or self._pid != os.getpid():
                loop = asyncio.new_event_loop()
                threading.Thread(
                    target=loop.run_forever, name="batchd-s3-gets", daemon=True
                ).start()
                self._loop, self._pid = loop, os.getpid()
            loop = self._loop
        return asyncio.run_coroutine_threadsafe(job, loop).result()


_LOOP: Final = _Loop()


def _options(start: int, length: int, tag: str | None) -> Any:
    options: dict[str, Any] = {"range": (start, start + length)}
    if tag is not None:
        options["if_match"] = tag
    return options


def _get_one(
    store: ObjectStore, key: str, start: int, length: int, tag: str | None
) -> tuple[str | None, memoryview]:
    try:
        result = obstore.get(store, key, options=_options(start, length, tag))
        return tag_of(result.meta), memoryview(result.bytes())
    except PreconditionError:
        raise Changed() from None


async def _get_many(
    store: ObjectStore, key: str, ranges: Sequence[tuple[int, int]], tag: str | None
) -> list[tuple[str | None, memoryview]]:
    gate = asyncio.Semaphore(MAX_IN_FLIGHT)

    async def one(start: int, length: int) -> tuple[str | None, memoryview]:
        async with gate:
            result = await obstore.get_async(store, key, options=_options(start, length, tag))
            return tag_of(result.meta), memoryview(await result.bytes_async())

    try:
        return list(await asyncio.gather(*(one(s, n) for s, n in ranges)))
    except PreconditionError:
        raise Changed() from None


def get_version(
    store: ObjectStore, key: str, ranges: Sequence[tuple[int, int]], tag: str | None
) -> tuple[str | None, list[memoryview]]:
    """The ranges, all of version ``tag`` (any one version when None), and that version.

    Raises:
        Changed: the object is not of ``tag``, or the ranges came from several versions.
    """
    if len(ranges) == 1:
        got = [_get_one(store, key, ranges[0][0], ranges[0][1], tag)]
    else:
        got = _LOOP.run(_get_many(store, key, ranges, tag))
    tags = {t for t, _ in got}
    # A store that ignores If-Match (fake-gcs-server; some S3-compatible gateways) answers
    # with another version's bytes instead of a 412: its ETag tells.
    if len(tags) > 1 or (tag is not None and tags and tags != {tag}):
        raise Changed()
    return (tags.pop() if tags else tag), [data for _, data in got]


def get_ranges(
    store: ObjectStore, key: str, url: str, ranges: Sequence[tuple[int, int]], versions: Versions
) -> list[memoryview]:
    """The bytes of each (non-empty) range, each its own GET, all of the object's version
    as ``versions`` first recorded it (see the module docs).

    Raises:
        BadSample: ``unreadable`` when the object changed again while it was fetched anew.
        Exception: the store's own errors, for the caller to classify.
    """
    known = versions.get(url)
    try:
        tag, data = get_version(store, key, ranges, known)
    except Changed:
        try:
            tag, data = get_version(store, key, ranges, None)
        except Changed:
            raise BadSample(
                "unreadable",
                f"{url}: the object changed while it was read (rewritten in place); its "
                "samples are read again at the next epoch. Objects a session reads should "
                "not be rewritten: write a new key, and ingest a new version of the dataset",
            ) from None
        logger.warning(
            "%s changed in place while sessions read it (its ETag was %s, is now %s): its "
            "ranges are read whole from the new version; re-ingest the dataset if its byte "
            "ranges moved",
            url,
            known or "not seen",
            tag,
        )
    versions.record(url, tag)
    return data
