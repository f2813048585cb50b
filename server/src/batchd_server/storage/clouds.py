"""The object stores batchd reads, one row each, keyed by URL scheme: ``s3://`` (Amazon S3
and S3-compatible stores), ``gs://`` (Google Cloud Storage), ``az://`` (Azure Blob
Storage). Each row is a :class:`~batchd_server.storage.cloud.Cloud` (``aws.py``,
``gcs.py``, ``azure.py``); a new store is one more.

Here: what every store shares. A URL is split and its bucket checked before any request
(:func:`split_url`); a client is made lazily, once per process, bucket and configuration
(:func:`store_of`): worker processes are spawned, and each makes its own on its first read.
Every client retries with the same backoff and timeouts. An endpoint reached over plain
HTTP is warned about once per process (its requests cross the network in clear).
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Mapping
from datetime import timedelta
from types import MappingProxyType
from typing import Any, Final

from batchd_server.storage.aws import S3
from batchd_server.storage.azure import Azure
from batchd_server.storage.cloud import Cloud
from batchd_server.storage.gcs import GCS
from batchd_server.storage.options import DEFAULT_RETRY_S

__all__ = [
    "CLOUDS",
    "CONNECT_TIMEOUT_S",
    "REQUEST_TIMEOUT_S",
    "BadStoreSettings",
    "cloud_of",
    "is_object_url",
    "split_url",
    "store_of",
]

CONNECT_TIMEOUT_S: Final = 5.0
"""A TCP connect that takes longer is a failed try (retried)."""
REQUEST_TIMEOUT_S: Final = 20.0
"""One request, body included, that takes longer is a failed try (retried)."""

CLOUDS: Final[Mapping[str, Cloud]] = MappingProxyType(
    {cloud.scheme: cloud for cloud in (S3(), GCS(), Azure())}
)
"""A URL scheme (``s3`` of ``s3://bucket/key``) -> its store's rules."""

logger = logging.getLogger(__name__)


class BadStoreSettings(ValueError):
    """The environment's settings for a store do not make a client (a malformed key, an
    unknown option); the message says which store and what to check, never a value."""


def _scheme(url: str) -> str:
    scheme, sep, _ = url.partition("://")
    return scheme.lower() if sep else ""


def is_object_url(url: str) -> bool:
    """Whether ``url`` names an object-store prefix or object of a store in :data:`CLOUDS`."""
    return _scheme(url) in CLOUDS


def cloud_of(url: str) -> Cloud:
    """The store ``url`` names.

    Raises:
        ValueError: its scheme is none of :data:`CLOUDS`.
    """
    cloud = CLOUDS.get(_scheme(url))
    if cloud is None:
        known = ", ".join(f"{s}://" for s in CLOUDS)
        raise ValueError(f"{url!r} is not an object-store URL ({known})")
    return cloud


def split_url(url: str) -> tuple[str, str]:
    """``s3://bucket/some/key`` -> ``("bucket", "some/key")`` (likewise ``gs://``, ``az://``).

    Raises:
        ValueError: not an object-store URL with a bucket, or the bucket's name is not one
            its store allows.
    """
    cloud = cloud_of(url)
    bucket, _, key = url.partition("://")[2].partition("/")
    noun = cloud.bucket_noun
    if not bucket:
        raise ValueError(f"{url!r} names no {noun}; write {cloud.scheme}://{noun.upper()}/PREFIX")
    problem = cloud.bucket_problem(bucket)
    if problem is not None:
        raise ValueError(
            f"{url!r}: {bucket[:80]!r} is not a valid {noun} name ({problem}); check the URL"
        )
    return bucket, key


_warned_http: set[tuple[int, str]] = set()


def _warn_plain_http(endpoint: str | None) -> None:
    """Log once per process and endpoint that a store is reached over plain HTTP."""
    if not endpoint or not endpoint.startswith("http://"):
        return
    key = (os.getpid(), endpoint)
    if key not in _warned_http:
        _warned_http.add(key)
        logger.warning(
            "the object store's endpoint %s is plain HTTP: requests and the bytes they carry "
            "cross the network unencrypted (signatures stop tampering, not reading); use "
            "https:// unless the network is private",
            endpoint,
        )


_stores: dict[tuple[object, ...], Any] = {}
_stores_lock = threading.Lock()


def store_of(url: str, *, retry_s: float = DEFAULT_RETRY_S) -> tuple[Any, str]:
    """This process's client of ``url``'s bucket (made on first use), and the key.

    Args:
        retry_s: How long a failing request is retried (with backoff) before it fails.

    Raises:
        ValueError: as :func:`split_url`.
        BadStoreSettings: the environment's settings make no client.
    """
    cloud = cloud_of(url)
    bucket, key = split_url(url)
    # The store's environment is part of the cache key: a process that changes it (a
    # test, a rotated key file) gets a client made from what it says now.
    env = os.environ
    config = tuple(sorted((k, v) for k, v in env.items() if k.startswith(cloud.env_prefixes)))
    cache_key = (os.getpid(), cloud.scheme, bucket, retry_s, config)
    with _stores_lock:
        store = _stores.get(cache_key)
        if store is None:
            options: dict[str, Any] = {
                "retry_config": {
                    "max_retries": 1000,  # bounded by retry_timeout
                    "retry_timeout": timedelta(seconds=retry_s),
                    "backoff": {
                        "init_backoff": timedelta(milliseconds=100),
                        "max_backoff": timedelta(seconds=4),
                        "base": 2,
                    },
                },
                "client_options": {
                    "connect_timeout": timedelta(seconds=CONNECT_TIMEOUT_S),
                    "timeout": timedelta(seconds=REQUEST_TIMEOUT_S),
                },
            }
            try:
                store = cloud.make(bucket, env, options)
            except Exception as e:
                why = str(e).split("\n", 1)[0].strip() or type(e).__name__
                raise BadStoreSettings(
                    f"the server's settings for {cloud.scheme}:// stores make no client ({why}); "
                    f"check them ({cloud.credentials_hint})"
                ) from None
            _warn_plain_http(cloud.endpoint(env))
            _stores[cache_key] = store
        return store, key
