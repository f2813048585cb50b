"""Shared memory: the only package that creates or unlinks segments.

``segments`` says what a segment is and maps one in another process (``attach``);
``registry`` is the ``ShmRegistry`` that creates, budgets and releases a server's segments;
``instance`` holds the instance lock and sweeps what dead servers left; ``arrays`` shares
numpy arrays read-only (``pack_arrays`` / ``attach_arrays``); ``space`` reads how much the
filesystem holds.
"""

from __future__ import annotations

from batchd_server.shm.arrays import attach_arrays, pack_arrays
from batchd_server.shm.registry import ShmRegistry
from batchd_server.shm.segments import KINDS, PREFIX, SHM_DIR, Attachment, Segment, attach
from batchd_server.shm.space import format_bytes

__all__ = [
    "KINDS",
    "PREFIX",
    "SHM_DIR",
    "Attachment",
    "Segment",
    "ShmRegistry",
    "attach",
    "attach_arrays",
    "format_bytes",
    "pack_arrays",
]
