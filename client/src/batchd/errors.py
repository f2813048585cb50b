"""Exceptions raised by batchd, on both sides of the wire.

The server raises these from its domain code; one place in the server maps each class to a
gRPC status code, and the client maps the code back to the same class. Training code
therefore sees ``batchd.errors.NotFound`` and never a ``grpc.RpcError``.
"""

from __future__ import annotations

__all__ = [
    "AlreadyExists",
    "BatchdError",
    "DataError",
    "DataLoss",
    "FailedPrecondition",
    "InvalidArgument",
    "NotFound",
    "ResourceExhausted",
    "SnapshotMismatch",
    "Unauthenticated",
    "Unavailable",
]


class BatchdError(Exception):
    """Base class of every error batchd raises on purpose."""


class InvalidArgument(BatchdError, ValueError):
    """A request or input is malformed; the message names the value and the valid range."""


class DataError(InvalidArgument):
    """Input data (a manifest row, a dataset tree) is malformed; the message names where."""


class DataLoss(BatchdError):
    """Samples could not be read or decoded and the session's ``on_error`` policy (or its
    ``max_error_fraction``) does not allow going on; the message names the samples."""


class NotFound(BatchdError, LookupError):
    """A dataset, split or session does not exist."""


class AlreadyExists(BatchdError):
    """Something that must be unique exists already."""


class FailedPrecondition(BatchdError):
    """The system is not in a state where the request can run (for example, no schema yet)."""


class SnapshotMismatch(FailedPrecondition):
    """The catalog rows a snapshot pinned have changed (deleted or no longer verified)."""


class ResourceExhausted(BatchdError):
    """A limit was reached (shared memory, sessions, budget); the message says which to raise."""


class Unavailable(BatchdError):
    """The server or the catalog cannot be reached right now; retrying may help."""


class Unauthenticated(BatchdError):
    """The server wants an auth token and the call carried none, or a wrong one; pass the
    server's token as ``auth_token=`` or ``$BATCHD_AUTH_TOKEN``."""
