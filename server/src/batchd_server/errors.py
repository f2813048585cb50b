"""The server raises the client's exception classes, so both sides share one vocabulary.

Domain code imports errors from here; ``api/status.py`` maps them to gRPC codes.
"""

from __future__ import annotations

from batchd.errors import (
    AlreadyExists,
    BatchdError,
    DataError,
    DataLoss,
    FailedPrecondition,
    InvalidArgument,
    NotFound,
    ResourceExhausted,
    SnapshotMismatch,
    Unavailable,
)

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
    "Unavailable",
]
