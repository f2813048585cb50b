"""The sessions' server settings: how many a server and a client may hold, how long one
lives without a stream, and which dataset roots they may read."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from batchd_server.settings import Check, count, path, seconds, within

__all__ = ["SessionSettings"]


def _relative_root(roots: tuple[Path, ...]) -> str | None:
    bad = next((root for root in roots if not root.is_absolute()), None)
    return None if bad is None else f"holds {str(bad)!r}, which is not an absolute path"


@dataclass(frozen=True, kw_only=True)
class SessionSettings:
    """The sessions' settings."""

    max_sessions: int = count(
        flag="--max-sessions",
        default=256,
        help="open sessions at most; more is RESOURCE_EXHAUSTED",
    )

    client_max_sessions: int = count(
        flag="--client-max-sessions",
        default=64,
        help="open sessions one client may hold",
    )

    lease_timeout_s: float = seconds(
        flag="--lease-timeout-s",
        default=30.0,
        check=within(0, 86400, low_open=True),
        help="seconds a session may go without an open stream before it is closed and its "
        "ring freed",
    )

    data_roots: tuple[Path, ...] = path(
        flag="--data-root",
        env="BATCHD_DATA_ROOTS",
        default=(),
        check=Check("absolute paths", _relative_root),
        help="serve only datasets whose root lies under one of these directories; a catalog "
        "row pointing elsewhere is refused",
        metavar="DIR",
        default_text="any root the catalog names",
        many=os.pathsep,
    )
