"""The server's object-store settings, as the worker processes need them.

They travel on every task's ``SessionSpec`` (a worker is spawned before any session and
knows nothing of the server's configuration); :meth:`StoreOptions.of` reads them from it.
The node cache's settings belong here too.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Final

if TYPE_CHECKING:
    from batchd_server.config import ServerConfig

__all__ = ["DEFAULT_RETRY_S", "StoreOptions"]

DEFAULT_RETRY_S: Final = 30.0
"""How long a failing request is retried unless the server says otherwise."""


@dataclass(frozen=True)
class StoreOptions:
    """The server's object-store settings, as the workers need them."""

    retry_s: float = DEFAULT_RETRY_S
    """How long a failing request is retried before its samples are ``transient``."""

    @classmethod
    def of(cls, config: ServerConfig) -> StoreOptions:
        return cls(retry_s=config.object_store_retry_s)
