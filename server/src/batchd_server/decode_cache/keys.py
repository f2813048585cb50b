"""What a cache entry's key is made of: everything that changes the cached output.

A key is a BLAKE2b digest of

* the sample's bytes, as its source's :class:`Identity` names them, with the byte range and
  the sample id. A local root's (:class:`FileIdentity`): the file under the root, its path
  and device independent identity (inode, size and modification time in ns), so a file
  rewritten in place gets a new mtime (and usually size) and its old entries are never found
  again. An object store's (:class:`CatalogIdentity`): the dataset row that the catalog says
  the sample belongs to (its id, name and version) and the object's key under the root;
  a catalog row is immutable (a changed sample belongs in a new dataset version), and a
  lookup must cost no request, or a hit would cost what a miss costs;
* the recipe of what is cached (the adapter's: pipeline kind, the options that shape the
  cached array, which stage of the pipeline it is);
* the versions of everything that computes it (:func:`versions`: this format, batchd's own,
  numpy, Pillow, simplejpeg, torch), so an upgraded decoder never serves its predecessor's
  pixels.

The entry's file name is 32 hex: 8 of the dataset root's tag (which tells the cache's owner
whose entry it is, see ``owner.py``) and 24 of the key. The full key is also inside the entry
(``entry.py``) and checked on every read.
"""

from __future__ import annotations

import functools
import hashlib
import os
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping
from importlib.metadata import PackageNotFoundError, version
from types import MappingProxyType
from typing import Final

from batchd_server import __version__
from batchd_server.catalog.types import DatasetRef
from batchd_server.storage.schemes import scheme_of

__all__ = [
    "FORMAT",
    "IDENTITIES",
    "CatalogIdentity",
    "FileIdentity",
    "Identity",
    "catalog_name",
    "identity_of",
    "root_tag",
    "versions",
]

FORMAT: Final = "batchd-decode-cache-1"
_VERSIONED: Final = ("numpy", "pillow", "simplejpeg", "torch")


@functools.cache
def versions() -> str:
    """This cache format and the versions of batchd and of the libraries that decode, in one
    string."""
    found = [f"batchd-server={__version__}"]
    for name in _VERSIONED:
        try:
            found.append(f"{name}={version(name)}")
        except PackageNotFoundError:
            found.append(f"{name}=none")
    return " ".join([FORMAT, *found])


@functools.cache
def root_tag(root: str) -> str:
    """8 hex naming a dataset root, the first part of its entries' names."""
    return hashlib.blake2b(root.encode(), digest_size=4).hexdigest()


def catalog_name(dataset: DatasetRef) -> str:
    """A dataset's catalog row in a key: ``id/name/version``."""
    return f"{dataset.id}/{dataset.name}/{dataset.version}"


class Identity(ABC):
    """What names the bytes of one source's samples in their entries' keys.

    Args:
        root: The dataset's root.
        dataset: The dataset row as the catalog names it (:func:`catalog_name`; "" when
            unknown).
    """

    probes: bool = False
    """Whether a batch's cached samples are looked for before its bytes are fetched ahead,
    so that only the misses are (``CachedSource.to_fetch``): a store's reads are worth
    staging; a local reader fetches nothing ahead."""

    def __init__(self, root: str, dataset: str) -> None:
        self.root = root
        self.dataset = dataset
        self.tag = root_tag(root)

    @abstractmethod
    def parts(self, path: str) -> tuple[object, ...] | None:
        """What identifies the bytes of ``path`` under the root; None when they cannot be
        identified (then the sample is not cached, and the uncached path says what is
        wrong with it)."""

    def key(
        self, recipe: str, path: str, offset: int, length: int, sample_id: int
    ) -> tuple[str, bytes] | None:
        """``(file name, full key)`` of one sample's entry; None as :meth:`parts`."""
        parts = self.parts(path)
        if parts is None:
            return None
        fields = (versions(), recipe, self.root, path, offset, length, sample_id, *parts)
        text = "\0".join(map(str, fields))
        key = hashlib.blake2b(text.encode(), digest_size=32).digest()
        return self.tag + key[:12].hex(), key


class FileIdentity(Identity):
    """A local file: its inode, size and modification time, read now."""

    def parts(self, path: str) -> tuple[object, ...] | None:
        try:
            st = os.stat(os.path.join(self.root, path))
        except (OSError, ValueError):
            return None
        return (st.st_ino, st.st_size, st.st_mtime_ns)


class CatalogIdentity(Identity):
    """An object under a store's prefix: the catalog's dataset row (the key's path, range
    and sample id are the sample's immutable row in it)."""

    probes = True

    def parts(self, path: str) -> tuple[object, ...] | None:
        return ("catalog", self.dataset)


IDENTITIES: Final[Mapping[str, Callable[[str, str], Identity]]] = MappingProxyType(
    {"": FileIdentity}
)
"""A root's scheme -> how its samples' bytes are identified; any other scheme (a store's)
is identified by the catalog (:class:`CatalogIdentity`)."""


def identity_of(root: str, dataset: str = "") -> Identity:
    """How the samples under ``root`` of catalog dataset ``dataset`` are identified."""
    return IDENTITIES.get(scheme_of(root), CatalogIdentity)(root, dataset)
