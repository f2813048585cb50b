"""Shared memory's server settings: the budget every segment is reserved from, one client's
quota of it, the directory segments live in and the free space health asks for."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Final

from batchd_server.settings import at_least, path, size
from batchd_server.shm.space import usable_bytes

__all__ = ["DEFAULT_MIN_FREE_SHM_BYTES", "ShmLimits", "ShmSettings"]

DEFAULT_MIN_FREE_SHM_BYTES: Final = 56 << 20
"""One image session at the usual settings: 6 slots (prefetch 4 + 2) of 64 x 3 x 224 x 224
bytes plus labels and ids, 55.2 MiB, rounded up. Health says NOT_SERVING below it."""
_SERVE_AND_CHECK: Final = ("serve", "healthcheck")
"""The commands that read the shm directory: the server, and ``healthcheck`` without one."""
_GiB: Final = 1 << 30
_MiB: Final = 1 << 20


@dataclass(frozen=True, kw_only=True)
class ShmLimits:
    """The shm limits a server runs with, once its shm directory's size is known."""

    budget_bytes: int
    """What all segments together may reserve (``ShmRegistry.budget_bytes``)."""
    client_quota_bytes: int
    """What one client's rings may hold together."""


@dataclass(frozen=True, kw_only=True)
class ShmSettings:
    """Shared memory's settings."""

    shm_budget_bytes: int = size(
        flag="--shm-budget",
        default=_GiB,
        check=at_least(_MiB, size=True),
        help="shared memory all sessions' rings and catalog arrays may reserve together, e.g. "
        "2GiB; never more than the shm directory holds less 8MiB (56MiB of Docker's "
        "default 64MB /dev/shm)",
    )

    client_shm_quota_bytes: int | None = size(
        flag="--client-shm-quota",
        default=None,
        check=at_least(_MiB, size=True),
        help="ring memory one client's sessions may hold together (the catalog arrays, shared "
        "by every session on a split, count against the shm budget only)",
        default_text="half of --shm-budget, at most what the shm directory holds",
    )

    shm_dir: Path = path(
        flag="--shm-dir",
        default=Path("/dev/shm"),
        help="where shared-memory segments live (Linux's shm_open directory)",
        metavar="DIR",
        commands=_SERVE_AND_CHECK,
    )

    min_free_shm_bytes: int = size(
        flag="--min-free-shm",
        default=DEFAULT_MIN_FREE_SHM_BYTES,
        check=at_least(0),
        help="health is NOT_SERVING while the shared-memory directory has less than this "
        "free; the default holds one image session of 64 224x224 images",
        commands=_SERVE_AND_CHECK,
    )

    @property
    def client_shm_quota(self) -> int:
        """``client_shm_quota_bytes``, or half of ``shm_budget_bytes`` when unset (before the
        shm directory is known: :meth:`shm_limits` gives what the server uses)."""
        if self.client_shm_quota_bytes is not None:
            return self.client_shm_quota_bytes
        return self.shm_budget_bytes // 2

    def shm_limits(self, shm_size_bytes: int | None) -> ShmLimits:
        """The shm budget and the client quota a server uses on a shm directory of
        ``shm_size_bytes`` (None: unknown): ``shm_budget_bytes`` as a ceiling over what the
        directory holds less a margin (``shm.space.usable_bytes``), and the quota as set, or
        :attr:`client_shm_quota` as a ceiling over that budget. So in Docker's default 64 MB
        ``/dev/shm`` a session too big for it is refused for the filesystem's size, not for a
        quota of 512 MiB it could never use."""
        budget = self.shm_budget_bytes
        if shm_size_bytes is not None:
            budget = min(budget, usable_bytes(shm_size_bytes))
        quota = self.client_shm_quota_bytes
        if quota is None:
            quota = min(self.client_shm_quota, budget)
        return ShmLimits(budget_bytes=budget, client_quota_bytes=quota)
