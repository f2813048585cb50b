"""Bounds the server enforces on requests and the OS limits it works within, in one place.

A request past a bound is refused with ``InvalidArgument`` naming the bound, before
anything is allocated for it.
"""

from __future__ import annotations

from typing import Final

__all__ = ["MAX_PREFETCH", "MAX_SLOT_BYTES", "MAX_UNIX_PATH_BYTES"]

MAX_PREFETCH: Final = 64
"""Batches a session may have ready ahead of its client."""
MAX_SLOT_BYTES: Final = 4 << 30
"""One batch's bytes at most (a ring slot)."""
MAX_UNIX_PATH_BYTES: Final = 107
"""sockaddr_un.sun_path is 108 bytes on Linux, including the terminating NUL."""
