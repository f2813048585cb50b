"""Ingest from an object-store root (``s3://``, ``gs://``, ``az://BUCKET/PREFIX``): listings
and HEADs, no downloads.

Every ingest command takes an object-store root as it takes a directory; this module is what
differs. One listing of the prefix (pages of 1000 keys) gives every object's size, and
stands in for the file system:

- a manifest's rows are verified against it (:class:`ObjectVerifier`, the sibling of
  ``manifest.Verifier``): a path that is not listed is written unverified, a byte range past
  its object's end is an error;
- an image folder's ``<split>/<class>/<image>`` keys are found in it
  (:func:`object_images`);
- tar shard patterns (globs and brace ranges) are matched against its keys
  (:func:`object_shards`), and each shard's headers are read through byte-range GETs in
  blocks of :data:`TAR_BLOCK_BYTES` (:class:`RangeReader`): only headers and label members
  are read, as from a local shard; payloads are skipped.

A store that cannot be listed is a :class:`~batchd_server.errors.DataError` naming the URL
and what to check. Nothing here logs or stores a credential: the catalog records the root
URL, and the store is configured from the server's environment.
"""

from __future__ import annotations

import io
import os
import re
from collections.abc import Iterator
from fnmatch import fnmatchcase
from typing import Final

from batchd_server.catalog.manifest import Row, RowVerifier
from batchd_server.catalog.tar_shards import Shard, expand_braces
from batchd_server.errors import DataError
from batchd_server.pipelines.base import BadSample
from batchd_server.storage.options import DEFAULT_RETRY_S
from batchd_server.storage.paths import path_problem
from batchd_server.storage.s3 import S3Fetcher, StoreUnreachable, join_url, list_objects, split_url
from batchd_server.storage.schemes import is_local_root
from batchd_server.storage.seekable import SeekableBytes

__all__ = [
    "TAR_BLOCK_BYTES",
    "ObjectListing",
    "ObjectVerifier",
    "RangeReader",
    "check_object_root",
    "iter_object_rows",
    "object_images",
    "object_shards",
]

TAR_BLOCK_BYTES: Final = 8 << 10
"""A tar header read fetches this much. A sample's label member and the next sample's header
usually come with it (one request per sample); more would mostly fetch payload bytes."""
_MAGIC: Final = re.compile(r"[*?\[]")


def check_object_root(root: str) -> str:
    """``root`` as the catalog stores it (no trailing slash), once it parses.

    Raises:
        DataError: not ``SCHEME://BUCKET[/PREFIX]`` of a store in ``storage/clouds.CLOUDS``.
    """
    try:
        split_url(root)
    except ValueError as e:
        raise DataError(f"root {root!r}: {e}") from None
    return root.rstrip("/")


class ObjectListing:
    """Every object under a prefix and its size, listed once on first use.

    Args:
        retry_s: How long a failing request is retried (``--object-store-retry-s``).
    """

    def __init__(self, root: str, *, retry_s: float = DEFAULT_RETRY_S) -> None:
        self.root = root
        self.retry_s = retry_s
        self._sizes: dict[str, int] | None = None

    @property
    def sizes(self) -> dict[str, int]:
        """Path relative to the root -> size in bytes.

        Raises:
            DataError: the store cannot be listed (the message names the URL).
        """
        if self._sizes is None:
            try:
                self._sizes = dict(list_objects(self.root, retry_s=self.retry_s))
            except StoreUnreachable as e:
                raise DataError(str(e)) from None
        return self._sizes


class ObjectVerifier(RowVerifier):
    """Verifies manifest rows against a listing, as ``manifest.Verifier`` does against the
    file system: a missing object makes its row unverified; a range past the end is an
    error."""

    noun = "object"

    def __init__(self, listing: ObjectListing, file: str) -> None:
        super().__init__(file)
        self.listing = listing

    def size_of(self, path: str, line: int) -> int | None:
        return self.listing.sizes.get(path)

    def place(self, path: str) -> str:
        return join_url(self.listing.root, path)


def object_images(
    listing: ObjectListing, split: str | None, suffixes: frozenset[str]
) -> list[tuple[str, str, str, int]]:
    """(split, class, path, size) of the images of an image-folder layout under the prefix,
    sorted by split, class and name as the local walk sorts them.

    The layout is ``<split>/<class>/<image>`` (or ``<class>/<image>`` with ``split``); keys
    at other depths, under a hidden directory, or without an image suffix are ignored.
    """
    depth = 2 if split is not None else 3
    found = []
    for path, size in listing.sizes.items():
        parts = path.split("/")
        if len(parts) != depth or any(p.startswith(".") or not p for p in parts[:-1]):
            continue
        if os.path.splitext(parts[-1])[1].lower() not in suffixes:
            continue
        s, c = (split, parts[0]) if split is not None else (parts[0], parts[1])
        assert s is not None
        found.append((s, c, path, size))
    found.sort(key=lambda f: (f[0], f[1], f[2].rsplit("/", 1)[-1]))
    return found


def object_shards(listing: ObjectListing, patterns: list[str]) -> list[Shard]:
    """The objects that ``patterns`` name, in order, each once: brace ranges and lists
    expand, then ``*``, ``?`` and ``[...]`` match within one path component (as a shell
    glob does). A pattern is relative to the root, or a full URL under it.

    Raises:
        DataError: a pattern matches no object, or is a URL outside the root.
    """
    sizes = listing.sizes
    root = listing.root.rstrip("/") + "/"
    chosen: dict[str, None] = {}
    for pattern in patterns:
        matched: list[str] = []
        for expanded in expand_braces(pattern):
            if not is_local_root(expanded):
                if not expanded.startswith(root):
                    raise DataError(f"shard {expanded} is not under --root {listing.root}")
                expanded = expanded[len(root) :]
            problem = path_problem(expanded)
            if problem is not None:
                raise DataError(f"shard pattern {pattern!r}: {problem}")
            if _MAGIC.search(expanded):
                parts = expanded.split("/")
                matched += sorted(
                    key
                    for key in sizes
                    if len(k := key.split("/")) == len(parts)
                    and all(fnmatchcase(a, b) for a, b in zip(k, parts, strict=True))
                )
            elif expanded in sizes:
                matched.append(expanded)
        if not matched:
            raise DataError(
                f"shard pattern {pattern!r} matches no object under --root {listing.root} "
                "(relative patterns are relative to it)"
            )
        chosen.update(dict.fromkeys(matched))
    fetcher = S3Fetcher(retry_s=listing.retry_s)
    urls = {key: join_url(listing.root, key) for key in chosen}
    return [
        Shard(key, urls[key], _Open(fetcher, urls[key], sizes[key]), sizes[key]) for key in chosen
    ]


class _Open:
    """Opens one object as a buffered, seekable reader (a ``Shard.open``)."""

    def __init__(self, fetcher: S3Fetcher, url: str, size: int) -> None:
        self.fetcher, self.url, self.size = fetcher, url, size

    def __call__(self) -> io.BufferedReader:
        return io.BufferedReader(RangeReader(self.fetcher, self.url, self.size), TAR_BLOCK_BYTES)


class RangeReader(SeekableBytes):
    """A seekable read-only file over one object: each read is a byte-range GET.

    Wrap it in ``io.BufferedReader`` so that small reads (tar headers) share a request.
    A read that fails (after the client's retries) raises DataError naming the URL.
    """

    def __init__(self, fetcher: S3Fetcher, url: str, size: int) -> None:
        super().__init__(url, size)
        self._fetcher = fetcher
        self.url = url

    def readinto(self, buffer: memoryview) -> int:  # type: ignore[override]
        count = min(len(buffer), max(self._size - self._at, 0))
        if count == 0:
            return 0
        try:
            (data,) = self._fetcher.fetch(self.url, [(self._at, count)])
        except BadSample as e:
            raise DataError(f"reading shard {e}") from None
        buffer[: len(data)] = data
        self._at += len(data)
        return len(data)


def iter_object_rows(images: list[tuple[str, str, str, int]]) -> Iterator[Row]:
    """Image-folder rows (label still the class name, as ``ingest.load.load`` expects)."""
    for line, (s, c, path, size) in enumerate(images, 1):
        yield (line, path, path, None, None, c, s, None, 1.0, None, True, size)
