"""What a process read through the node cache (hits, misses, bytes, the latency of each
request to the store), counted in :data:`STATS`; a worker sends its counts back with each
result and the server adds them to its metrics (``metrics.node_cache.record_cache``)."""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Final

__all__ = ["STATS", "CacheStats", "NodeCacheCounts"]

_MAX_LATENCIES: Final = 256
"""Request latencies a process keeps between two :meth:`CacheStats.take`; more are dropped
(the counts stay exact)."""


@dataclass
class NodeCacheCounts:
    """What a process read through the cache since the counts were last taken."""

    hits: int = 0
    """Blocks found on disk, intact."""
    misses: int = 0
    """Blocks fetched from the store by a reader (a worker)."""
    hit_bytes: int = 0
    fetched_bytes: int = 0
    """Bytes received from the store, prefetches included."""
    prefetched_bytes: int = 0
    """Of ``fetched_bytes``, those fetched ahead of a session by the cache manager."""
    corrupt: int = 0
    """Block files found bad (corrupt, truncated, unreadable, not a regular file), removed
    and fetched again."""
    unkept: int = 0
    """Missed blocks the cache had no room to keep: only the ranges asked of them were
    fetched (no whole block per record of a working set larger than the cache)."""
    get_seconds: list[float] = field(default_factory=list)
    """The latency of each request to the store (at most ``_MAX_LATENCIES`` of them)."""

    def __bool__(self) -> bool:
        return bool(
            self.hits
            or self.misses
            or self.fetched_bytes
            or self.get_seconds
            or self.corrupt
            or self.unkept
        )


class CacheStats:
    """A process's :class:`NodeCacheCounts`, safe to add to from many threads."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._counts = NodeCacheCounts()

    def add(self, **counts: int) -> None:
        with self._lock:
            for name, value in counts.items():
                setattr(self._counts, name, getattr(self._counts, name) + value)

    def latency(self, seconds: float) -> None:
        with self._lock:
            if len(self._counts.get_seconds) < _MAX_LATENCIES:
                self._counts.get_seconds.append(seconds)

    def take(self) -> NodeCacheCounts:
        """The counts so far; they start again from zero."""
        with self._lock:
            counts, self._counts = self._counts, NodeCacheCounts()
        return counts


STATS: Final = CacheStats()
"""This process's counts (see the module docs)."""
