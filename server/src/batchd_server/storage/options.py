"""The server's object-store settings as the workers need them, carried on every task's
``SessionSpec`` (a worker is spawned before any session and knows nothing of the server's
configuration); ``assembly.py`` makes the :class:`StoreOptions` from the configuration,
whose settings are declared in ``storage/settings.py``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Final

__all__ = ["DEFAULT_LIST_CACHE_S", "DEFAULT_RETRY_S", "StoreOptions"]

DEFAULT_RETRY_S: Final = 30.0
"""How long a failing request is retried unless the server says otherwise."""
DEFAULT_LIST_CACHE_S: Final = 5.0
"""How long a session-open listing of a root is trusted unless the server says otherwise."""


@dataclass(frozen=True)
class StoreOptions:
    """The server's object-store settings, as the workers need them."""

    retry_s: float = DEFAULT_RETRY_S
    """How long a failing request is retried before its samples are ``transient``."""
    cache_dir: str | None = None
    """The node cache's directory (``--cache-dir``); None: no cache."""
    cache_size_bytes: int = 0
    """What the node cache's files may take (``--cache-size``)."""
    list_cache_s: float = DEFAULT_LIST_CACHE_S
    """How long a root's listing at session open is trusted (``--object-store-list-cache-s``;
    the main process's only)."""
