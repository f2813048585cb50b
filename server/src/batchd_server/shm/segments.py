"""What a shared-memory segment is, what it is called, and how another process maps one.

A segment is a file in ``/dev/shm`` (which is what ``shm_open`` makes on Linux), named
``batchd-<instance>-<kind>-<32 random hex>``: the prefix lets a sweep find every segment of
a dead server (``instance.py``), and the instance says whose it is. Only ``ShmRegistry``
(``registry.py``) creates ``Segment``s; workers and same-host clients map them with
``attach``, which neither creates nor unlinks anything.

NOTE [ Closing mappings with live views ]
``mmap.close()`` raises ``BufferError`` while buffer exports of the mapping exist: memoryviews,
``np.frombuffer`` and ``torch.frombuffer`` results and their views. ``ShmRegistry.release``
and ``Attachment.close`` therefore close the mapping when they can and otherwise drop their
reference to it: every view holds the mapping, and the last one to die unmaps it. Views stay
valid until then. Make views with ``ndarray()`` (or ``np.frombuffer``), never with
``np.ndarray(buffer=buf)``: that one takes no export, so a close unmaps under it and the next
access is a segmentation fault.

What each call does besides: ``ShmRegistry.release`` also unlinks the segment's file at once
(only in the process that created it) and gives its bytes back to the shm budget, so a new
segment may take them while old views still read the old pages; the kernel frees those pages
when the last mapping in any process goes. ``Attachment.close`` unlinks nothing: the segment
is its creator's. After either call this object's ``buf`` raises ``FailedPrecondition``;
views made before it keep working.
"""

from __future__ import annotations

import contextlib
import math
import mmap
import os
import re
import stat
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Final

import numpy as np
import numpy.typing as npt

from batchd._wire.lifetime import Closeable
from batchd_server.errors import FailedPrecondition, InvalidArgument, NotFound
from batchd_server.shm.space import format_bytes

__all__ = [
    "KINDS",
    "PREFIX",
    "SHM_DIR",
    "Attachment",
    "MappedSegment",
    "Segment",
    "attach",
    "segment_instance",
    "segment_name",
]

SHM_DIR: Final = Path("/dev/shm")
PREFIX: Final = "batchd"
KINDS: Final = ("catalog", "ring")
"""What a segment holds: a session's ring of batch slots, or catalog arrays for the workers."""

_NAME_RE: Final = re.compile(rf"{PREFIX}-([0-9a-f]{{12}})-([a-z]+)-[0-9a-f]{{32}}")


def segment_name(instance: str, kind: str, token: str) -> str:
    """The name of instance ``instance``'s segment of ``kind`` with random ``token`` (32 hex)."""
    return f"{PREFIX}-{instance}-{kind}-{token}"


def segment_instance(name: str) -> str | None:
    """The instance id in a segment's name; None if ``name`` is no batchd segment's."""
    match = _NAME_RE.fullmatch(name)
    return None if match is None else match[1]


class MappedSegment:
    """A named mapping of a segment; the base of ``Segment`` and ``Attachment``."""

    def __init__(self, name: str, buf: mmap.mmap) -> None:
        self.name = name
        self.nbytes = len(buf)
        self._buf: mmap.mmap | None = buf

    @property
    def buf(self) -> mmap.mmap:
        """The whole segment. Raises ``FailedPrecondition`` once released or closed."""
        if self._buf is None:
            raise FailedPrecondition(
                f"shared-memory segment {self.name} is no longer mapped here (it was released "
                "or closed); keep it open while you use it"
            )
        return self._buf

    def ndarray(
        self, dtype: npt.DTypeLike, shape: int | Sequence[int], offset: int = 0
    ) -> npt.NDArray[Any]:
        """A numpy view of ``shape`` and ``dtype`` at byte ``offset``; read-only if the mapping is.

        Raises:
            InvalidArgument: The array would not fit inside the segment.
        """
        dt = np.dtype(dtype)
        dims = (int(shape),) if isinstance(shape, int | np.integer) else tuple(map(int, shape))
        end = offset + dt.itemsize * math.prod(dims)
        if offset < 0 or min(dims, default=0) < 0 or end > self.nbytes:
            raise InvalidArgument(
                f"a {dt} array of shape {dims} at byte offset {offset} needs bytes "
                f"[{offset}, {end}); segment {self.name} has {self.nbytes}"
            )
        # frombuffer, unlike np.ndarray(buffer=...), holds a buffer export for the view's life,
        # which is what keeps close() from unmapping under it: NOTE [ Closing mappings with live
        # views ].
        return np.frombuffer(self.buf, dt, math.prod(dims), offset).reshape(dims)

    def unmap(self) -> None:
        """Drop this mapping; idempotent. See NOTE [ Closing mappings with live views ]."""
        buf, self._buf = self._buf, None
        if buf is not None:
            with contextlib.suppress(BufferError):  # views alive: the last one unmaps
                buf.close()

    def __repr__(self) -> str:
        state = "mapped" if self._buf is not None else "unmapped"
        return f"<{type(self).__name__} {self.name} {format_bytes(self.nbytes)} {state}>"


class Segment(MappedSegment):
    """A segment this process created with ``ShmRegistry.create``: reserved, mapped read-write."""

    def __init__(self, *, name: str, path: Path, kind: str, buf: mmap.mmap) -> None:
        super().__init__(name, buf)
        self.path = path
        self.kind = kind


class Attachment(MappedSegment, Closeable):
    """A mapping of a segment that another process created (see ``attach``)."""

    def close(self) -> None:
        """Unmap; idempotent. Safe while views exist (NOTE [ Closing mappings with live views ])."""
        self.unmap()


def attach(name: str, *, writable: bool, shm_dir: Path = SHM_DIR) -> Attachment:
    """Map the segment ``name`` that a server created (workers and same-host clients use this).

    Args:
        name: ``Segment.name``, as the server handed it out.
        writable: Map read-write; otherwise the mapping is read-only and writes through it (or
            through numpy views of it) raise.
        shm_dir: Where segments live.

    Raises:
        InvalidArgument: ``name`` is not a batchd segment name.
        NotFound: No such segment (its session closed, or its server exited).
        FailedPrecondition: This process may not open it (segments are mode 0600).
    """
    if not isinstance(name, str) or segment_instance(name) is None:
        raise InvalidArgument(
            f"{name!r} is not a batchd shared-memory segment name; expected "
            f"{PREFIX}-<12 hex>-<kind>-<32 hex>, as the server returned it"
        )
    path = shm_dir / name
    mode = "read-write" if writable else "read-only"
    flags = (os.O_RDWR if writable else os.O_RDONLY) | os.O_CLOEXEC | os.O_NOFOLLOW
    try:
        fd = os.open(path, flags)
    except FileNotFoundError as e:
        raise NotFound(
            f"shared-memory segment {path} does not exist: its session was closed or the server "
            "that created it has exited"
        ) from e
    except PermissionError as e:
        raise FailedPrecondition(
            f"no permission to open {path} {mode}: batchd segments are mode 0600, so attach as "
            "the user the server runs as"
        ) from e
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_size == 0:
            raise FailedPrecondition(f"{path} is not a batchd segment (empty or not a file)")
        access = mmap.ACCESS_WRITE if writable else mmap.ACCESS_READ
        return Attachment(name, mmap.mmap(fd, st.st_size, access=access))
    finally:
        os.close(fd)  # the mapping does not need it
