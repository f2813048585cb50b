"""What a cache entry's key is made of: everything that changes the cached output.

A key is a BLAKE2b digest of

* the sample's bytes, identified by the file under the dataset root (its path, device
  independent identity: inode, size and modification time in ns), the byte range in it and
  the sample id: a file rewritten in place gets a new mtime (and usually size), so its old
  entries are never found again;
* the recipe of what is cached (the adapter's: pipeline kind, the options that shape the
  cached array, which stage of the pipeline it is);
* the versions of everything that computes it (:func:`versions`: this format, numpy, Pillow,
  simplejpeg, torch), so an upgraded decoder never serves its predecessor's pixels.

The entry's file name is 32 hex: 8 of the dataset root's tag (which tells the cache's owner
whose entry it is, see ``owner.py``) and 24 of the key. The full key is also inside the entry
(``entry.py``) and checked on every read.
"""

from __future__ import annotations

import functools
import hashlib
import os
from importlib.metadata import PackageNotFoundError, version
from typing import Final

__all__ = ["FORMAT", "root_tag", "sample_key", "versions"]

FORMAT: Final = "batchd-decode-cache-1"
_VERSIONED: Final = ("numpy", "pillow", "simplejpeg", "torch")


@functools.cache
def versions() -> str:
    """This cache format and the versions of the libraries that decode, in one string."""
    found = []
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


def sample_key(
    recipe: str, root: str, path: str, offset: int, length: int, sample_id: int
) -> tuple[str, bytes] | None:
    """``(file name, full key)`` of one sample's entry; None when the file cannot be
    identified (missing, unreadable: the uncached path then reports what is wrong)."""
    try:
        st = os.stat(os.path.join(root, path))
    except (OSError, ValueError):
        return None
    text = "\0".join(
        map(
            str,
            (
                versions(),
                recipe,
                root,
                path,
                offset,
                length,
                sample_id,
                st.st_ino,
                st.st_size,
                st.st_mtime_ns,
            ),
        )
    )
    key = hashlib.blake2b(text.encode(), digest_size=32).digest()
    return root_tag(root) + key[:12].hex(), key
