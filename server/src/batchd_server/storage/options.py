"""The server's object-store settings: declared here (:data:`RETRY_SETTING` is the metadata
of a ``ServerConfig`` field, so the flag, variable and docs come from it as from any other)
and carried to the worker processes on every task's ``SessionSpec`` (a worker is spawned
before any session and knows nothing of the server's configuration); ``assembly.py`` makes
the :class:`StoreOptions` from the configuration. The node cache's settings belong here too.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Final

from batchd_server.settings import EVERY_COMMAND, setting, within

__all__ = ["DEFAULT_RETRY_S", "RETRY_SETTING", "StoreOptions"]

DEFAULT_RETRY_S: Final = 30.0
"""How long a failing request is retried unless the server says otherwise."""
RETRY_SETTING: Final = setting(
    "retry a failing object-store request (throttling, 5xx, resets, timeouts, the store "
    "down) with backoff for up to this many seconds; what still fails is a bad sample of "
    "kind 'transient'. Keep it below --task-timeout-s",
    flag="--object-store-retry-s",
    env="BATCHD_OBJECT_STORE_RETRY_S",
    parse=float,
    check=within(0, 3600),
    metavar="S",
    commands=(EVERY_COMMAND,),
)
"""``ServerConfig.object_store_retry_s``'s setting (every command: ingest lists the store)."""


@dataclass(frozen=True)
class StoreOptions:
    """The server's object-store settings, as the workers need them."""

    retry_s: float = DEFAULT_RETRY_S
    """How long a failing request is retried before its samples are ``transient``."""
    cache_dir: str | None = None
    """The node cache's directory (``--cache-dir``); None: no cache."""
    cache_size_bytes: int = 0
    """What the node cache's files may take (``--cache-size``)."""
