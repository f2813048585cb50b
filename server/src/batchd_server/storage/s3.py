"""S3-compatible object stores through obstore: URLs, the credential chain, retries, errors.

Why obstore: it is the Python face of the Rust ``object_store`` crate (Apache Arrow's, used
by DataFusion, Polars and delta-rs): one small wheel with no Python dependencies, byte-range
GETs that coalesce neighbours and run several requests at once (``get_ranges``), listings
and HEADs, retries with exponential backoff and jitter for 5xx (503 SlowDown included),
resets and timeouts, and the standard AWS configuration: ``AWS_ENDPOINT_URL``,
``AWS_ACCESS_KEY_ID`` / ``AWS_SECRET_ACCESS_KEY`` / ``AWS_SESSION_TOKEN``, ``AWS_REGION``,
the pod's web identity (``AWS_WEB_IDENTITY_TOKEN_FILE`` + ``AWS_ROLE_ARN``, as EKS sets
them), ECS and EKS Pod Identity container credentials, and the instance metadata service.
Its calls release the GIL, so a worker's threads keep several requests in flight.

What ``object_store`` does not read, this module adds (:func:`store_config`):

- **Profiles** (``AWS_PROFILE``, ``~/.aws/credentials`` and ``~/.aws/config``, or the files
  that ``AWS_SHARED_CREDENTIALS_FILE`` / ``AWS_CONFIG_FILE`` name): used when the
  environment holds no keys and no web identity. A profile's static keys, ``region`` and
  ``endpoint_url`` are read here; a profile without keys (SSO, ``role_arn``) goes through
  boto3 when it is installed (it is not a dependency).
- **Plain HTTP endpoints**: an ``http://`` endpoint (a MinIO or SeaweedFS on a private
  network) works (``object_store`` would refuse it unless ``AWS_ALLOW_HTTP`` is set), with a
  warning in the log once per process: its requests, signed or not, cross the network in
  clear.

Credentials stay inside the store objects: no message, log line or metric here carries
one. Errors quote only the first line of ``object_store``'s message, with every URL in it
replaced by the object's ``s3://`` URL or "the store": the endpoint is the operator's
business, and these messages reach tenants (bad samples, refused opens). The server's log
has the endpoint.

Bucket names are checked (:func:`split_url`) before any request: an invalid one is a clear
error, not a store's puzzling answer.

A store is made lazily, once per process and bucket (:func:`store_for`): worker processes
are spawned, and each makes its own on its first read.
"""

from __future__ import annotations

import configparser
import logging
import os
import re
import threading
from collections.abc import Iterator, Mapping
from datetime import timedelta
from typing import Any, Final

import obstore
from obstore.exceptions import PermissionDeniedError, PreconditionError, UnauthenticatedError
from obstore.store import S3Store

from batchd_server.pipelines.base import BadSample
from batchd_server.storage.base import ObjectChanged, TooLarge
from batchd_server.storage.options import DEFAULT_RETRY_S
from batchd_server.storage.s3_gets import Changed, Versions, get_ranges, get_version, tag_of

__all__ = [
    "CONNECT_TIMEOUT_S",
    "REQUEST_TIMEOUT_S",
    "SCHEME",
    "STREAM_PIECE_BYTES",
    "S3Fetcher",
    "StoreUnreachable",
    "is_object_url",
    "join_url",
    "split_url",
    "store_config",
    "store_for",
]

SCHEME: Final = "s3://"
CONNECT_TIMEOUT_S: Final = 5.0
"""A TCP connect that takes longer is a failed try (retried)."""
REQUEST_TIMEOUT_S: Final = 20.0
"""One request, body included, that takes longer is a failed try (retried)."""
STREAM_PIECE_BYTES: Final = 64 << 10
"""The smallest piece :meth:`S3Fetcher.stream` hands on (the client joins smaller ones into
one): small enough that the allocator reuses its memory, large enough that a 4 MiB block is
a few dozen Python steps."""
_BUCKET: Final = re.compile(r"[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]")
"""S3's rule for bucket names: 3 to 63 lowercase letters, digits, dots and hyphens,
starting and ending with a letter or digit (no two dots in a row, not an IP address)."""
_IP: Final = re.compile(r"\d+\.\d+\.\d+\.\d+")
_HTTP_URL: Final = re.compile(r"\bhttps?://\S+")
logger = logging.getLogger(__name__)
_PROFILE_KEYS: Final = (
    ("aws_access_key_id", "access_key_id"),
    ("aws_secret_access_key", "secret_access_key"),
    ("aws_session_token", "token"),
)


class StoreUnreachable(Exception):
    """The store could not be listed or asked about an object: the message names the URL
    and says what to check (endpoint, credentials, bucket)."""

    denied: bool = False
    """The store answered, and refused the credentials (it is up)."""


def is_object_url(root: str) -> bool:
    """Whether ``root`` names an object-store prefix (``s3://bucket/prefix``)."""
    return root.startswith(SCHEME)


def split_url(url: str) -> tuple[str, str]:
    """``s3://bucket/some/key`` -> ``("bucket", "some/key")``.

    Raises:
        ValueError: not an ``s3://`` URL with a bucket, or the bucket's name is not one S3
            allows.
    """
    if not is_object_url(url):
        raise ValueError(f"{url!r} is not an s3:// URL")
    bucket, _, key = url[len(SCHEME) :].partition("/")
    if not bucket:
        raise ValueError(f"{url!r} names no bucket; write s3://BUCKET/PREFIX")
    if not _BUCKET.fullmatch(bucket) or ".." in bucket or _IP.fullmatch(bucket):
        raise ValueError(
            f"{url!r}: {bucket[:80]!r} is not a valid bucket name (3 to 63 lowercase letters, "
            "digits, dots and hyphens, starting and ending with a letter or digit, not an IP "
            "address); check the URL"
        )
    return bucket, key


def join_url(root: str, path: str) -> str:
    """The URL of ``path`` (relative, as the catalog records it) under the prefix ``root``."""
    return f"{root.rstrip('/')}/{path}"


# --------------------------------------------------------------------------- configuration


def _profile_sections(name: str, env: Mapping[str, str]) -> tuple[dict[str, str], dict[str, str]]:
    """The ``[name]`` section of the shared credentials file and ``[profile name]`` (or
    ``[default]``) of the config file; empty where absent."""
    home = os.path.expanduser("~")
    creds_file = env.get("AWS_SHARED_CREDENTIALS_FILE") or f"{home}/.aws/credentials"
    config_file = env.get("AWS_CONFIG_FILE") or f"{home}/.aws/config"
    found = []
    for file, section in (
        (creds_file, name),
        (config_file, name if name == "default" else f"profile {name}"),
    ):
        parser = configparser.RawConfigParser()
        try:
            parser.read(file, encoding="utf-8")
        except (configparser.Error, UnicodeDecodeError):
            parser = configparser.RawConfigParser()
        found.append(dict(parser[section]) if parser.has_section(section) else {})
    return found[0], found[1]


def store_config(environ: Mapping[str, str] | None = None) -> tuple[dict[str, Any], Any]:
    """What the environment leaves out of ``object_store``'s own chain (see the module
    docs): extra ``S3Store`` settings, and a credential provider (or None).

    The environment itself is read by ``object_store`` (``S3Store`` reads ``AWS_*`` on
    construction); only a profile's settings and ``allow_http`` are returned here.
    """
    env = os.environ if environ is None else environ
    extra: dict[str, Any] = {}
    provider = None
    chain_has_keys = any(
        env.get(k)
        for k in (
            "AWS_ACCESS_KEY_ID",
            "AWS_WEB_IDENTITY_TOKEN_FILE",
            "AWS_CONTAINER_CREDENTIALS_RELATIVE_URI",
            "AWS_CONTAINER_CREDENTIALS_FULL_URI",
        )
    )
    creds, config = _profile_sections(env.get("AWS_PROFILE") or "default", env)
    if not env.get("AWS_REGION") and not env.get("AWS_DEFAULT_REGION") and config.get("region"):
        extra["region"] = config["region"]
    endpoint = env.get("AWS_ENDPOINT_URL_S3") or env.get("AWS_ENDPOINT_URL")
    if not endpoint and config.get("endpoint_url"):
        endpoint = extra["endpoint"] = config["endpoint_url"]
    if not chain_has_keys:
        merged = config | creds
        static = {ours: merged[theirs] for theirs, ours in _PROFILE_KEYS if merged.get(theirs)}
        if "access_key_id" in static and "secret_access_key" in static:
            extra.update(static)
        elif env.get("AWS_PROFILE"):
            provider = _boto3_provider(env["AWS_PROFILE"])
    if endpoint and endpoint.startswith("http://"):
        extra["allow_http"] = True
    return extra, provider


_warned_http: set[tuple[int, str]] = set()


def _warn_plain_http() -> None:
    """Log once per process and endpoint that the store is reached over plain HTTP."""
    endpoint = os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL")
    _, config = _profile_sections(os.environ.get("AWS_PROFILE") or "default", os.environ)
    endpoint = endpoint or config.get("endpoint_url")
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


def _boto3_provider(profile: str) -> Any:
    """A profile without static keys (SSO, an assumed role), through boto3 if it is here."""
    try:
        import boto3
        from obstore.auth.boto3 import Boto3CredentialProvider
    except ImportError:
        return None  # object_store's own chain then decides (and says what is missing)
    try:
        return Boto3CredentialProvider(boto3.Session(profile_name=profile))
    except Exception:  # no such profile: object_store's chain then says what is missing
        return None


_stores: dict[tuple[object, ...], S3Store] = {}
_stores_lock = threading.Lock()


def store_for(bucket: str, *, retry_s: float = DEFAULT_RETRY_S) -> S3Store:
    """This process's store for ``bucket``, made on first use.

    Args:
        retry_s: How long a failing request is retried (with backoff) before it fails.
    """
    # The AWS environment is part of the key: a process that changes it (a test, a
    # rotated key file) gets a store made from what it says now.
    aws = tuple(sorted((k, v) for k, v in os.environ.items() if k.startswith("AWS_")))
    key = (os.getpid(), bucket, retry_s, aws)
    with _stores_lock:
        store = _stores.get(key)
        if store is None:
            extra, provider = store_config()
            if extra.get("allow_http"):
                _warn_plain_http()
            retry = {
                "max_retries": 1000,  # bounded by retry_timeout
                "retry_timeout": timedelta(seconds=retry_s),
                "backoff": {
                    "init_backoff": timedelta(milliseconds=100),
                    "max_backoff": timedelta(seconds=4),
                    "base": 2,
                },
            }
            client = {
                "connect_timeout": timedelta(seconds=CONNECT_TIMEOUT_S),
                "timeout": timedelta(seconds=REQUEST_TIMEOUT_S),
            }
            store = _stores[key] = S3Store(
                bucket,
                retry_config=retry,  # type: ignore[arg-type]
                client_options=client,  # type: ignore[arg-type]
                credential_provider=provider,
                **extra,
            )
        return store


def first_line(error: BaseException, url: str | None = None) -> str:
    """``object_store``'s message without its multi-line debug dump, and without the
    endpoint: each HTTP(S) URL in it becomes ``url`` (the object's ``s3://`` URL), or "the
    store"."""
    line = str(error).split("\n", 1)[0].strip() or type(error).__name__
    return _HTTP_URL.sub(url or "the store", line)


def _is_not_found(error: BaseException) -> bool:
    return isinstance(error, FileNotFoundError)


def _is_denied(error: BaseException) -> bool:
    return isinstance(error, PermissionDeniedError | UnauthenticatedError)


def classify(url: str, error: Exception) -> BadSample:
    """A store error as a bad sample: ``missing`` for a 404, ``transient`` otherwise (the
    retries are spent, or the store refused the credentials: the object may well be fine)."""
    if _is_not_found(error):
        return BadSample("missing", f"{url}: no such object in the store")
    if isinstance(error, PreconditionError):
        return BadSample(
            "unreadable",
            f"{url}: the object changed in place while it was read; objects a session reads "
            "should not be rewritten: write a new key, and ingest a new version",
        )
    if _is_denied(error):
        return BadSample(
            "transient",
            f"{url}: the store refused access ({first_line(error, url)}); the object may well be "
            "fine: check the server's credentials (AWS_* environment, profile or web "
            "identity) and their permissions",
        )
    if "416" in first_line(error) or "Range Not Satisfiable" in str(error):
        return BadSample("unreadable", f"{url}: a byte range lies past the end of the object")
    return BadSample(
        "transient",
        f"{url}: {first_line(error, url)}; the store kept failing through the retries, the object "
        "itself may well be fine: check the store and the network to it",
    )


def unreachable(url: str, error: Exception) -> StoreUnreachable:
    """An error of a listing or HEAD at ingest or session open, as a clear message (without
    the endpoint, which the server's log has: it goes to tenants)."""
    denied = _is_denied(error)
    if denied:
        why = "the store refused the credentials; check AWS_ACCESS_KEY_ID and its permissions"
    else:
        why = (
            "check that the store is up and reachable from the server (AWS_ENDPOINT_URL), "
            "that the bucket exists, and the credentials"
        )
    endpoint = os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL")
    logger.warning(
        "cannot reach %s (endpoint %s): %s", url, endpoint or "AWS's", first_line(error, url)
    )
    failure = StoreUnreachable(f"cannot reach {url}: {first_line(error, url)}; {why}")
    failure.denied = denied
    return failure


class S3Fetcher:
    """The object store as a :class:`~batchd_server.storage.base.RangeFetcher`.

    Thread-safe: several threads of a worker fetch at once. Each call is retried by
    ``object_store`` for up to ``retry_s`` seconds (see :func:`store_for`).
    """

    def __init__(self, *, retry_s: float = DEFAULT_RETRY_S) -> None:
        self.retry_s = retry_s
        self.versions = Versions()
        """Each object's version as this fetcher first read it (``storage/s3_gets.py``)."""

    def fetch(self, url: str, ranges: Any) -> list[bytes | memoryview]:
        """Each range a GET of its own, several in flight, all of the object's version as
        first read (``storage/s3_gets.py``); an empty range costs no request.

        Raises:
            BadSample: as :func:`classify`, or ``unreadable`` when the object changed again
                while it was fetched anew.
        """
        bucket, key = split_url(url)
        out: list[bytes | memoryview] = [b""] * len(ranges)
        asked = [(i, int(o), int(n)) for i, (o, n) in enumerate(ranges) if int(n) > 0]
        if not asked:
            return out
        store = store_for(bucket, retry_s=self.retry_s)
        try:
            got = get_ranges(store, key, url, [(o, n) for _, o, n in asked], self.versions)
        except BadSample:
            raise
        except Exception as e:
            raise classify(url, e) from None
        for (i, _, _), data in zip(asked, got, strict=True):
            out[i] = data  # the client's buffers, not copies of them
        return out

    def stream(self, url: str, offset: int, length: int) -> Iterator[memoryview]:
        """The bytes ``[offset, offset + length)`` of the object in one GET, as they arrive,
        in pieces of at least :data:`STREAM_PIECE_BYTES` (the last may be shorter), which the
        node cache writes to its block files as they come. (A whole range in one buffer is a
        fresh allocation per block, and touching its pages for the first time costs more CPU
        than receiving the bytes.) Fewer bytes than asked come when the object is shorter;
        the caller checks.

        Raises:
            BadSample: as :meth:`fetch`, before or while the bytes come.
        """
        bucket, key = split_url(url)
        store = store_for(bucket, retry_s=self.retry_s)
        options: Any = {"range": (offset, offset + length)}
        known = self.versions.get(url)
        if known is not None:
            options["if_match"] = known
        try:
            result = obstore.get(store, key, options=options)
            self.versions.record(url, tag_of(result.meta))
            for piece in result.stream(min_chunk_size=STREAM_PIECE_BYTES):
                yield memoryview(piece)
        except Exception as e:
            raise classify(url, e) from None

    def fetch_version(self, url: str, ranges: Any, version: str | None) -> list[bytes | memoryview]:
        """As :meth:`fetch`, every range of ``version`` (the node cache's fills: NOTE [ Object
        versions ] in ``blocks.py``); no refetch of another version here.

        Raises:
            ObjectChanged: the object is not of ``version``, or its ranges came from several.
            BadSample: as :func:`classify`.
        """
        bucket, key = split_url(url)
        asked = [(int(o), int(n)) for o, n in ranges]
        try:
            return list(
                get_version(store_for(bucket, retry_s=self.retry_s), key, asked, version)[1]
            )
        except Changed:
            raise ObjectChanged(url) from None
        except Exception as e:
            raise classify(url, e) from None

    def stream_version(
        self, url: str, offset: int, length: int, version: str | None
    ) -> Iterator[memoryview]:
        """As :meth:`stream`, of ``version`` (``If-Match``; any version when None).

        Raises:
            ObjectChanged: the object is not of ``version``.
            BadSample: as :meth:`fetch`.
        """
        bucket, key = split_url(url)
        store = store_for(bucket, retry_s=self.retry_s)
        options: Any = {"range": (offset, offset + length)}
        if version is not None:
            options["if_match"] = version
        try:
            result = obstore.get(store, key, options=options)
            for piece in result.stream(min_chunk_size=STREAM_PIECE_BYTES):
                yield memoryview(piece)
        except PreconditionError:
            raise ObjectChanged(url) from None
        except Exception as e:
            raise classify(url, e) from None

    def head(self, url: str) -> tuple[int, str | None]:
        """The object's size and version (a HEAD).

        Raises:
            BadSample: as :meth:`fetch`.
        """
        bucket, key = split_url(url)
        try:
            meta = obstore.head(store_for(bucket, retry_s=self.retry_s), key)
            return int(meta["size"]), tag_of(meta)
        except Exception as e:
            raise classify(url, e) from None

    def fetch_whole(self, url: str, max_bytes: int) -> memoryview:
        """The whole object, in one GET: its size comes with the answer's headers, so no HEAD
        goes first, and an object over ``max_bytes`` is refused before its body is read.

        Raises:
            TooLarge: the object has more than ``max_bytes``.
            BadSample: as :meth:`fetch`.
        """
        return self.fetch_whole_version(url, max_bytes)[1]

    def fetch_whole_version(self, url: str, max_bytes: int) -> tuple[str | None, memoryview]:
        """As :meth:`fetch_whole`, and the version it read."""
        bucket, key = split_url(url)
        try:
            result = obstore.get(store_for(bucket, retry_s=self.retry_s), key)
            size = int(result.meta["size"])
            if size > max_bytes:
                raise TooLarge(url, size)  # the body is dropped unread with the result
            data = memoryview(result.bytes())  # the client's buffer, not a copy of it
            tag = tag_of(result.meta)
            self.versions.record(url, tag)
        except TooLarge:
            raise
        except Exception as e:
            raise classify(url, e) from None
        if len(data) != size:
            raise BadSample(
                "unreadable",
                f"{url}: the store answered {len(data)} bytes of an object of {size}; the "
                "object may have changed while it was read",
            )
        return tag, data

    def size(self, url: str) -> int:
        """The object's size in bytes (a HEAD).

        Raises:
            BadSample: as :meth:`fetch`.
        """
        bucket, key = split_url(url)
        try:
            return int(obstore.head(store_for(bucket, retry_s=self.retry_s), key)["size"])
        except Exception as e:
            raise classify(url, e) from None


def list_objects(root: str, *, retry_s: float = DEFAULT_RETRY_S) -> Iterator[tuple[str, int]]:
    """(path relative to ``root``, size) of every object under the prefix ``root``.

    Raises:
        StoreUnreachable: the listing failed (after the retries).
    """
    bucket, prefix = split_url(root)
    prefix = prefix.strip("/")
    store = store_for(bucket, retry_s=retry_s)
    cut = len(prefix) + 1 if prefix else 0
    try:
        for page in obstore.list(store, prefix=prefix or None, chunk_size=1000):
            for meta in page:
                path = meta["path"]
                if cut and not path.startswith(prefix + "/"):
                    continue
                yield path[cut:], int(meta["size"])
    except Exception as e:
        raise unreachable(root, e) from None


def check_reachable(root: str, *, retry_s: float = DEFAULT_RETRY_S) -> None:
    """Lists at most one object under ``root``: proves the endpoint answers, the bucket
    exists and the credentials may list it.

    Raises:
        StoreUnreachable: it does not.
    """
    bucket, prefix = split_url(root)
    store = store_for(bucket, retry_s=retry_s)
    try:
        stream = obstore.list(store, prefix=prefix.strip("/") or None, chunk_size=1)
        next(iter(stream), None)
    except Exception as e:
        raise unreachable(root, e) from None
