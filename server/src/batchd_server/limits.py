"""Bounds the server enforces on requests and the OS limits it works within, in one place.

A request past a bound is refused with ``InvalidArgument`` naming the bound, before
anything is allocated for it.
"""

from __future__ import annotations

from typing import Final

from batchd_server.errors import InvalidArgument

__all__ = [
    "INT64_MAX",
    "MAX_CACHED_BUFFER_BYTES",
    "MAX_CLIENT_FRAME_BYTES",
    "MAX_NAME_CHARS",
    "MAX_PREFETCH",
    "MAX_REQUEST_BYTES",
    "MAX_SAMPLE_BYTES",
    "MAX_SLOT_BYTES",
    "MAX_UNIX_PATH_BYTES",
    "check_name",
]

MAX_PREFETCH: Final = 64
"""Batches a session may have ready ahead of its client."""
MAX_SLOT_BYTES: Final = 4 << 30
"""One batch's bytes at most (a ring slot)."""
MAX_UNIX_PATH_BYTES: Final = 107
"""sockaddr_un.sun_path is 108 bytes on Linux, including the terminating NUL."""
MAX_REQUEST_BYTES: Final = 1 << 20
"""A gRPC message from a client at most (requests are small; batches only go out)."""
MAX_CLIENT_FRAME_BYTES: Final = 1 << 20
"""A doorbell frame from a client at most (hellos, starts with held leases, acks)."""
MAX_NAME_CHARS: Final = 256
"""A dataset, split or version name at most."""
INT64_MAX: Final = (1 << 63) - 1
"""The largest int64: what sample ids, byte offsets and epochs are stored and sent as."""
MAX_SAMPLE_BYTES: Final = 256 << 20
"""A sample's bytes at most, unless the operator says otherwise (``--max-sample-bytes``);
a larger one is a bad sample of kind ``too_large``."""
MAX_CACHED_BUFFER_BYTES: Final = 64 << 20
"""A reused read or decode buffer grows up to this; a larger one is made for its use alone."""


def check_name(what: str, value: str, *, required: bool = True) -> str:
    """``value`` if it can name a ``what`` (dataset, split, version): 1 to
    :data:`MAX_NAME_CHARS` characters, no control characters (NUL included).

    Raises:
        InvalidArgument: it cannot, saying why.
    """
    if not value:
        if required:
            raise InvalidArgument(f"the {what} name is empty; give one")
        return value
    if len(value) > MAX_NAME_CHARS:
        raise InvalidArgument(
            f"the {what} name is {len(value)} characters long; at most {MAX_NAME_CHARS}"
        )
    bad = next((c for c in value if ord(c) < 32 or ord(c) == 127), None)
    if bad is not None:
        raise InvalidArgument(
            f"the {what} name {value[:40]!r} holds the control character {bad!r}; names are "
            "printable text"
        )
    return value
