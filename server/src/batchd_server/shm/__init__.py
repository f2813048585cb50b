"""Shared memory: the only package that creates or unlinks segments.

``ShmRegistry`` creates, budgets, releases and sweeps a server's segments; ``attach`` maps
one in another process; ``pack_arrays`` / ``attach_arrays`` share numpy arrays read-only.
"""

from __future__ import annotations

from batchd_server.shm import segments as _segments
from batchd_server.shm.arrays import attach_arrays as attach_arrays
from batchd_server.shm.arrays import pack_arrays as pack_arrays
from batchd_server.shm.segments import *  # noqa: F403 (the package's face is the module's)

__all__ = sorted([*_segments.__all__, "attach_arrays", "pack_arrays"])
