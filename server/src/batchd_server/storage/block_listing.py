"""What one block directory of the node cache holds, and what its files take (NOTE [ Cache
files ] in ``blocks.py``): the listing a recount and the cache manager's eviction read."""

from __future__ import annotations

import os
import stat
from dataclasses import dataclass, field
from typing import Final

__all__ = [
    "RECORD_BYTES",
    "RECORD_SUFFIX",
    "TMP_PREFIX",
    "Listing",
    "list_directory",
    "tmp_bytes",
]

RECORD_BYTES: Final = 4096
"""What an object's record is counted as taking: the file system block a small file takes
(its bytes are a few dozen). A million objects' records are 4 GiB of the cache's size."""
RECORD_SUFFIX: Final = ".json"
TMP_PREFIX: Final = ".tmp-"
"""A file being written: ``.tmp-<pid>-<random>-<bytes reserved for it>``."""
STALE_TMP_S: Final = 600.0
"""A file being written that is older than this was left by a crashed writer."""


@dataclass
class Listing:
    """One block directory's files."""

    bytes: int = 0
    """What its files take, by the ledger's measure: a block file its size, a record
    :data:`RECORD_BYTES`, a file being written what was reserved for it."""
    blocks: dict[tuple[str, int], tuple[int, float]] = field(default_factory=dict)
    """(object hash, block index) -> the file's bytes and modification time."""
    records: dict[str, float] = field(default_factory=dict)
    """Object hash -> its record's modification time."""
    stale: list[str] = field(default_factory=list)
    """Paths of files a crashed writer left (not counted)."""


def tmp_bytes(name: str) -> int | None:
    """The bytes reserved for a file being written, from its name; None: not such a name."""
    if not name.startswith(TMP_PREFIX):
        return None
    tail = name.rsplit("-", 1)[-1]
    return int(tail) if tail.isdigit() else None


def list_directory(directory: str, now: float) -> Listing:
    """The files of one block directory. Only regular files count (a directory or a FIFO
    put in a block's place takes nothing here; a reader that meets it removes it), and a
    file with two names (a block being linked) counts once."""
    found = Listing()
    inodes: set[int] = set()
    try:
        with os.scandir(directory) as it:
            entries = list(it)
    except FileNotFoundError:
        return found
    for entry in entries:
        try:
            st = entry.stat(follow_symlinks=False)
        except FileNotFoundError:
            continue
        if not stat.S_ISREG(st.st_mode) or st.st_ino in inodes:
            continue
        inodes.add(st.st_ino)
        name = entry.name
        reserved = tmp_bytes(name)
        if name.startswith(TMP_PREFIX):
            if now - st.st_mtime > STALE_TMP_S or reserved is None:
                found.stale.append(entry.path)
            else:
                found.bytes += reserved
            continue
        head, _, tail = name.partition(".")
        if len(head) != 40:
            continue
        if "." + tail == RECORD_SUFFIX:
            found.records[head] = st.st_mtime
            found.bytes += RECORD_BYTES
        elif tail.isdigit():
            found.blocks[(head, int(tail))] = (st.st_size, st.st_mtime)
            found.bytes += st.st_size
    return found
