"""Shared memory: the only package that creates or unlinks segments.

``ShmRegistry`` creates, budgets, releases and sweeps a server's segments; ``attach`` maps
one in another process; ``pack_arrays`` / ``attach_arrays`` share numpy arrays read-only.
"""

from __future__ import annotations

from batchd_server.shm.arrays import attach_arrays, pack_arrays
from batchd_server.shm.segments import (
    KINDS,
    PREFIX,
    SHM_DIR,
    Attachment,
    Segment,
    ShmRegistry,
    attach,
    format_bytes,
)

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
