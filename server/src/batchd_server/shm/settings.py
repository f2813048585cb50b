"""Shared memory's server settings: the budget every segment is reserved from, one client's
quota of it, the directory segments live in and the free space health asks for."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Final

from batchd_server.settings import at_least, path, setting_of, size
from batchd_server.shm.space import format_bytes, usable_bytes

__all__ = ["DEFAULT_MIN_FREE_SHM_BYTES", "MIN_SESSION_BYTES", "ShmLimits", "ShmSettings"]

DEFAULT_MIN_FREE_SHM_BYTES: Final = 56 << 20
"""One image session at the usual settings: 6 slots (prefetch 4 + 2) of 64 x 3 x 224 x 224
bytes plus labels and ids, 55.2 MiB, rounded up. Health says NOT_SERVING below it."""
_SERVE_AND_CHECK: Final = ("serve", "healthcheck")
"""The commands that read the shm directory: the server, and ``healthcheck`` without one."""
_GiB: Final = 1 << 30
_MiB: Final = 1 << 20
MIN_SESSION_BYTES: Final = _MiB
"""The least any session takes of the budget: a ring's header and at least three slots, and
its split's catalog arrays, come to about a MiB at the smallest (also the least
``--shm-budget``)."""


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

    def session_bytes(self) -> int:
        """What the budget must keep for one session beside what is set aside for the decode
        cache: one image session at the usual settings (``--min-free-shm``, which health asks
        of the shm directory for the same reason), at least :data:`MIN_SESSION_BYTES`."""
        return max(MIN_SESSION_BYTES, self.min_free_shm_bytes)

    def set_aside_problem(
        self, budget_bytes: int, aside_bytes: int, *, purpose: str, flag: str
    ) -> str | None:
        """Why a budget of ``budget_bytes`` (the one the server uses: ``shm_limits``) cannot
        give ``aside_bytes`` to ``purpose`` (set by ``flag``) and still hold one session, or
        None when it can. Asking the operator now beats refusing every session later."""
        need = self.session_bytes()
        left = budget_bytes - aside_bytes
        if left >= need:
            return None
        budget = setting_of(ShmSettings, "shm_budget_bytes")
        free = setting_of(ShmSettings, "min_free_shm_bytes")
        why = (
            f"{purpose} ({flag}) takes {format_bytes(aside_bytes)} of the server's shared-memory "
            f"budget of {format_bytes(budget_bytes)}"
        )
        if budget_bytes < self.shm_budget_bytes:
            why += (
                f" ({budget.flag} is {format_bytes(self.shm_budget_bytes)}, but {self.shm_dir} "
                "holds less)"
            )
        raise_it = (
            f"raise {budget.flag} ({budget.env}) to at least {format_bytes(aside_bytes + need)}, "
            "giving the server that much shared memory"
        )
        if budget_bytes > need:
            raise_it = f"lower {flag} to at most {format_bytes(budget_bytes - need)}, or {raise_it}"
        return (
            f"{why}, which leaves {format_bytes(max(0, left))} for the sessions' rings and "
            f"catalogs, and one session needs {format_bytes(need)} ({free.flag}: one image "
            f"session at the usual settings; lower it if your sessions are smaller): "
            f"{raise_it}"
        )
