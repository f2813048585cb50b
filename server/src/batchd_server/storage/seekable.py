"""A read-only file whose bytes live elsewhere: :class:`SeekableBytes`.

Ingest reads a tar shard on an object store through ``tarfile`` and a worker reads a Parquet
footer through pyarrow; both want a seekable file object over bytes that only a reader can
fetch. The position, ``seek`` and ``tell`` are kept here once; a subclass says how bytes at
the position are read (``readinto``, and ``read`` where it can answer without a copy).
"""

from __future__ import annotations

import io

__all__ = ["SeekableBytes"]


class SeekableBytes(io.RawIOBase):
    """A readable, seekable raw file of ``size`` bytes named ``where`` (for errors); ``_at``
    is the position a subclass reads from and moves."""

    def __init__(self, where: str, size: int) -> None:
        super().__init__()
        self.where = where
        self._size = size
        self._at = 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._at

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._at, io.SEEK_END: self._size}[whence]
        if base + offset < 0:
            raise OSError(f"{self.where}: seek to a negative offset")
        self._at = base + offset
        return self._at
