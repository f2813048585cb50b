"""The sessions' server settings: how many a server and a client may hold, how long one
lives without a stream, and which dataset roots they may read."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from batchd_server.settings import Check, at_least, count, path, seconds, within

__all__ = ["SessionSettings"]


def _relative_root(roots: tuple[Path, ...]) -> str | None:
    bad = next((root for root in roots if not root.is_absolute()), None)
    return None if bad is None else f"holds {str(bad)!r}, which is not an absolute path"


@dataclass(frozen=True, kw_only=True)
class SessionSettings:
    """The sessions' settings."""

    max_sessions: int = count(
        "open sessions at most; more is RESOURCE_EXHAUSTED",
        default=256,
        flag="--max-sessions",
        check=at_least(1),
    )

    client_max_sessions: int = count(
        "open sessions one client may hold",
        default=64,
        flag="--client-max-sessions",
        check=at_least(1),
    )

    lease_timeout_s: float = seconds(
        "seconds a session may go without an open stream before it is closed and its ring freed",
        default=30.0,
        flag="--lease-timeout-s",
        check=within(0, 86400, low_open=True),
    )

    data_roots: tuple[Path, ...] = path(
        "serve only datasets whose root lies under one of these directories; a catalog "
        "row pointing elsewhere is refused",
        default=(),
        flag="--data-root",
        env="BATCHD_DATA_ROOTS",
        check=Check("absolute paths", _relative_root),
        metavar="DIR",
        default_text="any root the catalog names",
        many=os.pathsep,
    )
