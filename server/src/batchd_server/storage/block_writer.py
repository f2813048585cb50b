"""One node-cache block file written piece by piece as a fetch receives it (NOTE [ Cache
files ] in ``blocks.py``)."""

from __future__ import annotations

import contextlib
import os
from typing import Any, Protocol

from batchd_server.storage.block_format import DIGEST_BYTES, HEADER_BYTES, chunk_hasher

__all__ = ["BlockWriter", "write_at"]


class _Key(Protocol):
    """A block's key (``blocks.BlockKey``)."""

    @property
    def object(self) -> str: ...
    @property
    def index(self) -> int: ...


class _Store(Protocol):
    """What a writer asks of its store (``blocks.BlockStore``), typed here so that the two
    modules do not import each other."""

    @property
    def chunk_bytes(self) -> int: ...
    def _head(
        self, key: Any, length: int, digests: list[int], version: int = 0
    ) -> tuple[bytes, bytes]: ...
    def _link(self, tmp: str, key: Any, nbytes: int, *, replace: bool) -> bool: ...
    def _give_back(self, nbytes: int, tmp: str | None, slot: int) -> None: ...
    def _refused(self, error: OSError, doing: str) -> None: ...


class BlockWriter:
    """One block file written piece by piece (:meth:`BlockStore.writer`): the content goes to
    its place in a file being written (``.tmp-*`` in the block's directory) as it comes,
    each chunk's digest grows with it, and :meth:`finish` writes the header and the chunk
    table and links the file into place: no buffer of the block is needed. Not thread-safe
    (one fetch writes it)."""

    def __init__(
        self,
        store: _Store,
        key: _Key,
        length: int,
        nbytes: int,
        tmp: str,
        fd: int,
        version: int = 0,
    ) -> None:
        self._store, self.key, self.length, self.version = store, key, length, version
        self._nbytes, self._tmp, self._fd = nbytes, tmp, fd
        self._base = HEADER_BYTES + DIGEST_BYTES * -(-length // store.chunk_bytes)
        self._at = 0
        self._digests: list[int] = []
        self._hash = chunk_hasher()  # of the chunk being written, so far

    def add(self, piece: memoryview) -> None:
        """The next bytes of the content.

        Raises:
            OSError: the disk refused them (the writer is then of no use: :meth:`abort` it).
        """
        assert self._at + len(piece) <= self.length, "more bytes than the block holds"
        write_at(self._fd, piece, self._base + self._at)
        chunk = self._store.chunk_bytes
        while len(piece):
            take = min(len(piece), chunk - self._at % chunk)
            self._hash.update(piece[:take])
            self._at += take
            piece = piece[take:]
            if self._at % chunk == 0 or self._at == self.length:
                self._digests.append(self._hash.intdigest())
                self._hash.reset()

    def finish(self, *, replace: bool = False) -> bool:
        """Write the header and the table and link the block into place (``replace`` as in
        :meth:`BlockStore.write`); whether it is now cached. The content must be whole."""
        assert self._at == self.length, f"{self._at} of the block's {self.length} bytes written"
        try:
            head = self._store._head(self.key, self.length, self._digests, self.version)
            write_at(self._fd, b"".join(head), 0)
            os.close(self._fd)
            self._fd = -1
            self._store._link(self._tmp, self.key, self._nbytes, replace=replace)
            self._nbytes = 0  # the file's now, or given back where another's file stays
            return True
        except OSError as e:
            self._store._refused(e, "keep a block")
            self.abort()
            return False

    def abort(self) -> None:
        """Drop what was written and give its room back. Idempotent."""
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1
        if self._nbytes:
            self._store._give_back(self._nbytes, self._tmp, int(self.key.object[:2], 16))
            self._nbytes = 0
        with contextlib.suppress(OSError):
            os.unlink(self._tmp)


def write_at(fd: int, data: bytes | memoryview, at: int) -> None:
    """Write ``data`` at ``at``, in as many calls as the kernel needs."""
    view = memoryview(data).cast("B")
    while len(view):
        done = os.pwrite(fd, view, at)
        view, at = view[done:], at + done
