"""Object stores through obstore: the fetcher, listings, and what their errors say.

Why obstore: it is the Python face of the Rust ``object_store`` crate (Apache Arrow's, used
by DataFusion, Polars and delta-rs): one small wheel with no Python dependencies that speaks
S3, Google Cloud Storage and Azure Blob Storage, byte-range GETs, listings and HEADs,
retries with exponential backoff and jitter for 5xx (503 SlowDown included), resets and
timeouts, and each cloud's standard credential chain. Its calls release the GIL, so a
worker's threads keep several requests in flight.

Which store a URL names, how its client is made and what its bucket names may be is
``clouds.py`` (one row per scheme: ``s3://``, ``gs://``, ``az://``); nothing here asks
which store it is.

Credentials stay inside the store objects: no message, log line or metric here carries
one. Errors quote only the first line of ``object_store``'s message, with every URL in it
replaced by the object's own URL or "the store": the endpoint is the operator's
business, and these messages reach tenants (bad samples, refused opens). The server's log
has the endpoint.
"""

from __future__ import annotations

import logging
import os
import re
from collections.abc import Iterator
from typing import Any, Final

import obstore
from obstore.exceptions import PermissionDeniedError, PreconditionError, UnauthenticatedError

from batchd_server.pipelines.base import BadSample
from batchd_server.storage.base import ObjectChanged, TooLarge
from batchd_server.storage.clouds import (
    BadStoreSettings,
    cloud_of,
    is_object_url,
    split_url,
    store_of,
)
from batchd_server.storage.options import DEFAULT_RETRY_S
from batchd_server.storage.s3_gets import Changed, Versions, get_ranges, get_version, tag_of

__all__ = [
    "STREAM_PIECE_BYTES",
    "S3Fetcher",
    "StoreUnreachable",
    "check_reachable",
    "is_object_url",
    "join_url",
    "list_objects",
    "split_url",
]

STREAM_PIECE_BYTES: Final = 64 << 10
"""The smallest piece :meth:`S3Fetcher.stream` hands on (the client joins smaller ones into
one): small enough that the allocator reuses its memory, large enough that a 4 MiB block is
a few dozen Python steps."""
_HTTP_URL: Final = re.compile(r"\bhttps?://\S+")
logger = logging.getLogger(__name__)


class StoreUnreachable(Exception):
    """The store could not be listed or asked about an object: the message names the URL
    and says what to check (endpoint, credentials, bucket)."""

    denied: bool = False
    """The store answered, and refused the credentials (it is up)."""


def join_url(root: str, path: str) -> str:
    """The URL of ``path`` (relative, as the catalog records it) under the prefix ``root``."""
    return f"{root.rstrip('/')}/{path}"


def first_line(error: BaseException, url: str | None = None) -> str:
    """``object_store``'s message without its multi-line debug dump, and without the
    endpoint: each HTTP(S) URL in it becomes ``url`` (the object's ``s3://`` URL), or "the
    store"."""
    line = str(error).split("\n", 1)[0].strip() or type(error).__name__
    return _HTTP_URL.sub(url or "the store", line)


def _is_not_found(error: BaseException) -> bool:
    return isinstance(error, FileNotFoundError)


_DENIED_STATUS: Final = re.compile(r"\b(401 Unauthorized|403 Forbidden)\b")


def _is_denied(error: BaseException) -> bool:
    # object_store maps a 401/403 of a GET or HEAD to these classes, but a listing's only to
    # a generic error whose first line has the status.
    if isinstance(error, PermissionDeniedError | UnauthenticatedError):
        return True
    return _DENIED_STATUS.search(first_line(error)) is not None


def classify(url: str, error: Exception) -> BadSample:
    """A store error as a bad sample: ``missing`` for a 404, ``transient`` otherwise (the
    retries are spent, or the store refused the credentials: the object may well be fine)."""
    if _is_not_found(error):
        return BadSample("missing", f"{url}: no such object in the store")
    if isinstance(error, PreconditionError):
        return BadSample(
            "unreadable",
            f"{url}: the object changed in place while it was read; objects a session reads "
            "should not be rewritten: write a new key, and ingest a new version",
        )
    if _is_denied(error):
        return BadSample(
            "transient",
            f"{url}: the store refused access ({first_line(error, url)}); the object may well be "
            f"fine: check the server's credentials ({cloud_of(url).credentials_hint}) and "
            "their permissions",
        )
    if "416" in first_line(error) or "Range Not Satisfiable" in str(error):
        return BadSample("unreadable", f"{url}: a byte range lies past the end of the object")
    return BadSample(
        "transient",
        f"{url}: {first_line(error, url)}; the store kept failing through the retries, the object "
        "itself may well be fine: check the store and the network to it",
    )


def unreachable(url: str, error: Exception) -> StoreUnreachable:
    """An error of a listing or HEAD at ingest or session open, as a clear message (without
    the endpoint, which the server's log has: it goes to tenants)."""
    cloud = cloud_of(url)
    denied = _is_denied(error)
    if denied:
        why = (
            f"the store refused the credentials; check them ({cloud.credentials_hint}) and "
            "their permissions"
        )
    else:
        why = (
            "check that the store is up and reachable from the server "
            f"({cloud.endpoint_hint}), that the {cloud.bucket_noun} exists, and the credentials"
        )
    endpoint = cloud.endpoint(os.environ)
    logger.warning(
        "cannot reach %s (endpoint %s): %s", url, endpoint or "the cloud's", first_line(error, url)
    )
    failure = StoreUnreachable(f"cannot reach {url}: {first_line(error, url)}; {why}")
    failure.denied = denied
    return failure


def _client(url: str, retry_s: float) -> tuple[Any, str]:
    """:func:`~batchd_server.storage.clouds.store_of`, its settings' failure a bad sample."""
    try:
        return store_of(url, retry_s=retry_s)
    except BadStoreSettings as e:
        raise BadSample("transient", f"{url}: {e}") from None


def _lister(root: str, retry_s: float) -> tuple[Any, str]:
    """:func:`~batchd_server.storage.clouds.store_of`, its settings' failure unreachable."""
    try:
        return store_of(root, retry_s=retry_s)
    except BadStoreSettings as e:
        raise StoreUnreachable(f"cannot reach {root}: {e}") from None


class S3Fetcher:
    """The object store as a :class:`~batchd_server.storage.base.RangeFetcher`.

    Thread-safe: several threads of a worker fetch at once. Each call is retried by
    ``object_store`` for up to ``retry_s`` seconds (see ``clouds.store_of``).
    """

    def __init__(self, *, retry_s: float = DEFAULT_RETRY_S) -> None:
        self.retry_s = retry_s
        self.versions = Versions()
        """Each object's version as this fetcher first read it (``storage/s3_gets.py``)."""

    def fetch(self, url: str, ranges: Any) -> list[bytes | memoryview]:
        """Each range a GET of its own, several in flight, all of the object's version as
        first read (``storage/s3_gets.py``); an empty range costs no request.

        Raises:
            BadSample: as :func:`classify`, or ``unreadable`` when the object changed again
                while it was fetched anew.
        """
        out: list[bytes | memoryview] = [b""] * len(ranges)
        asked = [(i, int(o), int(n)) for i, (o, n) in enumerate(ranges) if int(n) > 0]
        if not asked:
            return out
        store, key = _client(url, self.retry_s)
        try:
            got = get_ranges(store, key, url, [(o, n) for _, o, n in asked], self.versions)
        except BadSample:
            raise
        except Exception as e:
            raise classify(url, e) from None
        for (i, _, _), data in zip(asked, got, strict=True):
            out[i] = data  # the client's buffers, not copies of them
        return out

    def stream(self, url: str, offset: int, length: int) -> Iterator[memoryview]:
        """The bytes ``[offset, offset + length)`` of the object in one GET, as they arrive,
        in pieces of at least :data:`STREAM_PIECE_BYTES` (the last may be shorter), which the
        node cache writes to its block files as they come. (A whole range in one buffer is a
        fresh allocation per block, and touching its pages for the first time costs more CPU
        than receiving the bytes.) Fewer bytes than asked come when the object is shorter;
        the caller checks.

        Raises:
            BadSample: as :meth:`fetch`, before or while the bytes come.
        """
        store, key = _client(url, self.retry_s)
        options: Any = {"range": (offset, offset + length)}
        known = self.versions.get(url)
        if known is not None:
            options["if_match"] = known
        try:
            result = obstore.get(store, key, options=options)
            tag = tag_of(result.meta)
            if known is not None and tag is not None and tag != known:
                # The store ignored If-Match (see ``s3_gets.get_version``).
                raise PreconditionError(f"the object's ETag is {tag}, not {known}")
            self.versions.record(url, tag)
            for piece in result.stream(min_chunk_size=STREAM_PIECE_BYTES):
                yield memoryview(piece)
        except Exception as e:
            raise classify(url, e) from None

    def fetch_version(self, url: str, ranges: Any, version: str | None) -> list[bytes | memoryview]:
        """As :meth:`fetch`, every range of ``version`` (the node cache's fills: NOTE [ Object
        versions ] in ``blocks.py``); no refetch of another version here.

        Raises:
            ObjectChanged: the object is not of ``version``, or its ranges came from several.
            BadSample: as :func:`classify`.
        """
        store, key = _client(url, self.retry_s)
        asked = [(int(o), int(n)) for o, n in ranges]
        try:
            return list(get_version(store, key, asked, version)[1])
        except Changed:
            raise ObjectChanged(url) from None
        except Exception as e:
            raise classify(url, e) from None

    def stream_version(
        self, url: str, offset: int, length: int, version: str | None
    ) -> Iterator[memoryview]:
        """As :meth:`stream`, of ``version`` (``If-Match``; any version when None).

        Raises:
            ObjectChanged: the object is not of ``version``.
            BadSample: as :meth:`fetch`.
        """
        store, key = _client(url, self.retry_s)
        options: Any = {"range": (offset, offset + length)}
        if version is not None:
            options["if_match"] = version
        try:
            result = obstore.get(store, key, options=options)
            tag = tag_of(result.meta)
            if version is not None and tag is not None and tag != version:
                # The store ignored If-Match (see ``s3_gets.get_version``).
                raise PreconditionError(f"the object's ETag is {tag}, not {version}")
            for piece in result.stream(min_chunk_size=STREAM_PIECE_BYTES):
                yield memoryview(piece)
        except PreconditionError:
            raise ObjectChanged(url) from None
        except Exception as e:
            raise classify(url, e) from None

    def head(self, url: str) -> tuple[int, str | None]:
        """The object's size and version (a HEAD).

        Raises:
            BadSample: as :meth:`fetch`.
        """
        store, key = _client(url, self.retry_s)
        try:
            meta = obstore.head(store, key)
            return int(meta["size"]), tag_of(meta)
        except Exception as e:
            raise classify(url, e) from None

    def fetch_whole(self, url: str, max_bytes: int) -> memoryview:
        """The whole object, in one GET: its size comes with the answer's headers, so no HEAD
        goes first, and an object over ``max_bytes`` is refused before its body is read.

        Raises:
            TooLarge: the object has more than ``max_bytes``.
            BadSample: as :meth:`fetch`.
        """
        return self.fetch_whole_version(url, max_bytes)[1]

    def fetch_whole_version(self, url: str, max_bytes: int) -> tuple[str | None, memoryview]:
        """As :meth:`fetch_whole`, and the version it read."""
        store, key = _client(url, self.retry_s)
        try:
            result = obstore.get(store, key)
            size = int(result.meta["size"])
            if size > max_bytes:
                raise TooLarge(url, size)  # the body is dropped unread with the result
            data = memoryview(result.bytes())  # the client's buffer, not a copy of it
            tag = tag_of(result.meta)
            self.versions.record(url, tag)
        except TooLarge:
            raise
        except Exception as e:
            raise classify(url, e) from None
        if len(data) != size:
            raise BadSample(
                "unreadable",
                f"{url}: the store answered {len(data)} bytes of an object of {size}; the "
                "object may have changed while it was read",
            )
        return tag, data

    def size(self, url: str) -> int:
        """The object's size in bytes (a HEAD).

        Raises:
            BadSample: as :meth:`fetch`.
        """
        store, key = _client(url, self.retry_s)
        try:
            return int(obstore.head(store, key)["size"])
        except Exception as e:
            raise classify(url, e) from None


def list_objects(root: str, *, retry_s: float = DEFAULT_RETRY_S) -> Iterator[tuple[str, int]]:
    """(path relative to ``root``, size) of every object under the prefix ``root``.

    Raises:
        StoreUnreachable: the listing failed (after the retries).
    """
    store, prefix = _lister(root, retry_s)
    prefix = prefix.strip("/")
    cut = len(prefix) + 1 if prefix else 0
    try:
        for page in obstore.list(store, prefix=prefix or None, chunk_size=1000):
            for meta in page:
                path = meta["path"]
                if cut and not path.startswith(prefix + "/"):
                    continue
                yield path[cut:], int(meta["size"])
    except Exception as e:
        raise unreachable(root, e) from None


def check_reachable(root: str, *, retry_s: float = DEFAULT_RETRY_S) -> None:
    """Lists at most one object under ``root``: proves the endpoint answers, the bucket
    exists and the credentials may list it.

    Raises:
        StoreUnreachable: it does not.
    """
    store, prefix = _lister(root, retry_s)
    try:
        stream = obstore.list(store, prefix=prefix.strip("/") or None, chunk_size=1)
        next(iter(stream), None)
    except Exception as e:
        raise unreachable(root, e) from None
