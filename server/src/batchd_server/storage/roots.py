"""The session-open check of a dataset whose root is an object-store prefix.

A local root is checked by the session manager (a directory under a ``--data-root``); an
``s3://`` root cannot be a directory here, so it is checked by asking the store: one listing
of at most one key proves the endpoint answers, the bucket exists and the credentials may
list it. An unreachable store fails the open at once, with the URL and what to check, rather
than every batch later with a transient bad sample.

``--data-root`` confines local roots (symlinks and ``..`` in a file system); what a server
may read from an object store is confined by its credentials, which the operator scopes to
the buckets it serves.
"""

from __future__ import annotations

from batchd_server.errors import FailedPrecondition
from batchd_server.storage.open import OPEN_CHECK_RETRY_S
from batchd_server.storage.options import StoreOptions
from batchd_server.storage.s3 import StoreUnreachable, check_reachable

__all__ = ["check_object_root"]


def check_object_root(dataset: str, root: str, store: StoreOptions) -> None:
    """Refuse ``root`` unless the store answers a listing under it.

    Raises:
        FailedPrecondition: as the message says.
    """
    try:
        check_reachable(root, retry_s=min(store.retry_s, OPEN_CHECK_RETRY_S))
    except (StoreUnreachable, ValueError) as e:
        raise FailedPrecondition(f"dataset {dataset!r}: {e}") from None
