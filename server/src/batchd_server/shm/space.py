"""How much the shared-memory filesystem holds, and what to tell an operator when it is too small.

``/dev/shm`` is a tmpfs whose size the container runtime chose: Docker gives 64 MB unless
``shm_size`` says otherwise, and a Kubernetes pod gets its node's default unless an
``emptyDir`` with ``medium: Memory`` is mounted there. The server's budget (``--shm-budget``)
is only a ceiling the operator set; what the filesystem can hold is the other one, and
messages must name the one that actually binds (``ShmRegistry.create``, the health check, the
``healthcheck`` command all read it from here).
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Final

__all__ = [
    "SHM_MARGIN_BYTES",
    "ShmSpace",
    "format_bytes",
    "remedy",
    "shm_space",
    "suggested_gib",
    "usable_bytes",
]

_GIB: Final = 1 << 30
SHM_MARGIN_BYTES: Final = 8 << 20
"""What the server leaves of the shm filesystem to others by default: its doorbell socket and
lock files, and the segments of other processes in the same container (a framework's own
shared-memory tensors, NCCL)."""
_HEADROOM: Final = 1.25
"""Suggested sizes leave a quarter more than the need: other segments, rounding, growth."""


def format_bytes(n: int) -> str:
    """``n`` bytes for people: ``"512 B"``, ``"64.0 KiB"``, ``"402.0 MiB"``, ``"1.5 GiB"``."""
    if abs(n) < 1024:
        return f"{n} B"
    value = float(n)
    for unit in ("KiB", "MiB", "GiB", "TiB"):
        value /= 1024
        if abs(value) < 1024 or unit == "TiB":
            break
    return f"{value:.1f} {unit}"


@dataclass(frozen=True)
class ShmSpace:
    """One ``statvfs`` of the shared-memory directory, in bytes."""

    path: Path
    size_bytes: int
    """The filesystem's whole size (a tmpfs's ``size=``)."""
    free_bytes: int
    """What an unprivileged process may still allocate there."""

    @property
    def used_bytes(self) -> int:
        return max(0, self.size_bytes - self.free_bytes)


def shm_space(path: Path) -> ShmSpace:
    """Size and free space of the filesystem holding ``path``.

    Raises:
        OSError: ``path`` does not exist or cannot be inspected.
    """
    st = os.statvfs(path)
    return ShmSpace(path, st.f_blocks * st.f_frsize, st.f_bavail * st.f_frsize)


def usable_bytes(size_bytes: int) -> int:
    """What the server's shm budget may take by default of a filesystem of ``size_bytes``: all
    but :data:`SHM_MARGIN_BYTES`, and at least half of a tiny one."""
    return max(size_bytes - SHM_MARGIN_BYTES, size_bytes // 2)


def suggested_gib(used_bytes: int, needed_bytes: int) -> int:
    """Whole GiB of shared memory to configure so that ``needed_bytes`` fits beside what is used."""
    return max(1, math.ceil((used_bytes + needed_bytes) * _HEADROOM / _GIB))


def remedy(space: ShmSpace, needed_bytes: int) -> str:
    """The settings that give the server more shared memory, sized for ``needed_bytes`` more."""
    gib = suggested_gib(space.used_bytes, needed_bytes)
    return (
        f"set shm_size: {gib}gb in docker-compose.yml (docker run --shm-size={gib}g) or, on "
        f"Kubernetes, an emptyDir with medium: Memory and sizeLimit: {gib}Gi mounted at "
        f"{space.path}"
    )
