"""The session-open check of a dataset whose root is an object-store prefix.

A local root is checked by the session manager (a directory under a ``--data-root``); an
``s3://`` root cannot be a directory here, so it is checked by asking the store: one listing
of at most one key proves the endpoint answers, the bucket exists and the credentials may
list it. The answer is remembered for ``--object-store-list-cache-s`` (a few seconds), so
that a burst of opens (every rank of a job) costs one listing, not one each.

When the store does not answer:

- **without the node cache**, the open fails at once with the URL and what to check, rather
  than every batch later with a transient bad sample;
- **with the node cache** (``--cache-dir``), the open goes ahead: the catalog already knows
  every object and its byte ranges, and the cache may hold their bytes (a job restarted
  during a store outage trains from it; what it lacks is read as any read is, retried and
  then a ``transient`` bad sample). A store that answers and refuses the credentials
  still fails the open.

Either way :data:`STORE_STATUS` records it: the health report says which roots' store is
down (without making the server unready: it can still serve), and the metric
``batchd_object_store_up`` is 0 for the bucket.

``--data-root`` confines local roots (symlinks and ``..`` in a file system); what a server
may read from an object store is confined by its credentials, which the operator scopes to
the buckets it serves.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass

from batchd_server.errors import FailedPrecondition
from batchd_server.metrics.object_store import OBJECT_STORE_UP
from batchd_server.storage.open import OPEN_CHECK_RETRY_S
from batchd_server.storage.options import StoreOptions
from batchd_server.storage.s3 import StoreUnreachable, check_reachable, split_url

__all__ = ["STORE_STATUS", "StoreStatus", "check_object_root"]

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class _Seen:
    at: float
    """``time.monotonic()`` of the listing."""
    failure: StoreUnreachable | None


class StoreStatus:
    """The last listing of each ``s3://`` root, remembered for a while. Thread-safe."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._seen: dict[str, _Seen] = {}
        self._listing: dict[str, threading.Lock] = {}

    def listing(self, root: str, store: StoreOptions) -> StoreUnreachable | None:
        """Why the store did not answer a listing under ``root`` (None: it did), listed
        now unless listed less than ``store.list_cache_s`` ago. One listing per root at a
        time: opens that arrive during it take its answer. A failure is trusted only with
        the node cache (where it does not refuse the open): without it, an open after the
        store came back must not be refused for what an earlier listing saw."""
        with self._lock:
            gate = self._listing.setdefault(root, threading.Lock())
        with gate:
            with self._lock:
                seen = self._seen.get(root)
            fresh = seen is not None and time.monotonic() - seen.at < store.list_cache_s
            if seen is not None and fresh and (seen.failure is None or store.cache_dir):
                return seen.failure
            try:
                check_reachable(root, retry_s=min(store.retry_s, OPEN_CHECK_RETRY_S))
                failure = None
            except StoreUnreachable as e:
                failure = e
            self._record(root, failure)
            return failure

    def _record(self, root: str, failure: StoreUnreachable | None) -> None:
        with self._lock:
            before = self._seen.get(root)
            self._seen[root] = _Seen(time.monotonic(), failure)
            if len(self._seen) > 4096:  # roots of deleted datasets: the oldest go
                oldest = min(self._seen, key=lambda r: self._seen[r].at)
                del self._seen[oldest]
        bucket, _ = split_url(root)
        OBJECT_STORE_UP.labels(bucket).set(0 if failure is not None and not failure.denied else 1)
        if before is not None and before.failure is not None and failure is None:
            logger.info("the object store answers again under %s", root)

    def down(self) -> dict[str, str]:
        """The roots whose store did not answer its last listing, and why."""
        with self._lock:
            return {
                root: str(seen.failure)
                for root, seen in self._seen.items()
                if seen.failure is not None and not seen.failure.denied
            }

    def notes(self) -> list[str]:
        """The health report's note on the store (none while it answers), without the roots
        (the health service needs no token): the log has them."""
        down = self.down()
        if not down:
            return []
        return [
            f"the object store did not answer the last listing of {len(down)} dataset "
            "root(s) at session open: sessions on them read what the node cache holds (the "
            "server's log names the roots); check the store and the network to it"
        ]

    def forget(self) -> None:
        """Forget every listing (tests, and a store known to be back)."""
        with self._lock:
            self._seen.clear()


STORE_STATUS = StoreStatus()
"""The server's (its main process makes every session-open check)."""


def check_object_root(dataset: str, root: str, store: StoreOptions) -> None:
    """Refuse ``root`` unless the store answers a listing under it, or the node cache may
    serve it (see the module docs).

    Raises:
        FailedPrecondition: as the message says.
    """
    try:
        split_url(root)
    except ValueError as e:
        raise FailedPrecondition(f"dataset {dataset!r}: {e}") from None
    failure = STORE_STATUS.listing(root, store)
    if failure is None:
        return
    if store.cache_dir is not None and not failure.denied:
        logger.warning(
            "dataset %r: opening a session while the object store is down (%s): its reads "
            "come from the node cache, and what the cache lacks is retried, then a transient "
            "bad sample",
            dataset,
            failure,
        )
        return
    raise FailedPrecondition(f"dataset {dataset!r}: {failure}") from None
