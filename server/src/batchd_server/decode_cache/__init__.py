"""The decode cache: decoded samples kept in shared memory (and on a local disk), so that
later epochs skip reading and decoding them, with rows equal byte for byte to a fresh decode.

``keys`` says what identifies an entry, ``entry`` how one is laid out and checked,
``adapters`` what each pipeline caches and how a hit becomes its row (NOTE [ Exact from the
cache ]), ``worker`` the lookups a decode worker makes, and ``owner`` the main process's
part: the tiers' bounds and eviction (NOTE [ Admission and eviction ]). The files
themselves are written and removed by ``shm/entries.py`` (NOTE [ Entry files ]). The
operator's guide is ``docs/server/decode-cache.md``.
"""

from __future__ import annotations

from batchd_server.decode_cache.owner import DecodeCacheOwner
from batchd_server.decode_cache.worker import CacheCounts, DecodeCacheSpec

__all__ = ["CacheCounts", "DecodeCacheOwner", "DecodeCacheSpec"]
