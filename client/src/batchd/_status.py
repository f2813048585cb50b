"""The one table between gRPC status codes and ``batchd.errors``, used by both sides.

The server (``batchd_server.api.status``) maps an exception to the code of its nearest class
in :data:`ERROR_CLASS_BY_CODE` and sends the exact class name in the trailing metadata key
:data:`ERROR_CLASS_KEY`; the client turns a ``grpc.RpcError`` back into that class, so
training code never sees a ``grpc.RpcError``. Keeping the table here, in the distribution
both sides install, means the two directions cannot drift apart.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Final

import grpc

from batchd import errors
from batchd.errors import BatchdError, DataLoss

__all__ = [
    "ERROR_CLASS_BY_CODE",
    "ERROR_CLASS_KEY",
    "UPGRADE_BOTH",
    "disagreement",
    "error_from_rpc",
    "error_named",
    "status_code_for",
]

ERROR_CLASS_KEY = "batchd-error-class"
"""Trailing-metadata key carrying the ``batchd.errors`` class name of a failed call."""

# One class per code and one code per class; subclasses (DataError, SnapshotMismatch) share
# their parent's code and travel by name in ERROR_CLASS_KEY.
ERROR_CLASS_BY_CODE: Mapping[grpc.StatusCode, type[BatchdError]] = {
    grpc.StatusCode.INVALID_ARGUMENT: errors.InvalidArgument,
    grpc.StatusCode.NOT_FOUND: errors.NotFound,
    grpc.StatusCode.ALREADY_EXISTS: errors.AlreadyExists,
    grpc.StatusCode.FAILED_PRECONDITION: errors.FailedPrecondition,
    grpc.StatusCode.RESOURCE_EXHAUSTED: errors.ResourceExhausted,
    grpc.StatusCode.UNAVAILABLE: errors.Unavailable,
    grpc.StatusCode.DATA_LOSS: errors.DataLoss,
    grpc.StatusCode.UNAUTHENTICATED: errors.Unauthenticated,
}
_CODE_BY_ERROR_CLASS = {cls: code for code, cls in ERROR_CLASS_BY_CODE.items()}


def status_code_for(error: BaseException) -> tuple[grpc.StatusCode, str] | None:
    """The status code for ``error`` and the name of its nearest ``batchd.errors`` class.

    Returns None for anything that is not a :class:`~batchd.errors.BatchdError` with a code
    in the table (the server answers those with INTERNAL).
    """
    code = next(
        (_CODE_BY_ERROR_CLASS[c] for c in type(error).__mro__ if c in _CODE_BY_ERROR_CLASS), None
    )
    if code is None:
        return None
    name = next(c.__name__ for c in type(error).__mro__ if c.__module__ == errors.__name__)
    return code, name


def _class_named(name: str | None, base: type[BatchdError]) -> type[BatchdError]:
    """``batchd.errors.<name>`` if it is a subclass of ``base``, else ``base``."""
    if name is None or name not in errors.__all__:
        return base
    cls = getattr(errors, name)
    return cls if isinstance(cls, type) and issubclass(cls, base) else base


def error_named(name: str, message: str) -> BatchdError:
    """The ``batchd.errors`` exception the server named (``BatchdError`` for unknown names)."""
    return _class_named(name, BatchdError)(message)


def error_from_rpc(
    error: grpc.RpcError, *, target: str, method: str, timeout_s: float
) -> BatchdError:
    """The ``batchd.errors`` exception for a failed call to ``method`` on ``target``.

    Errors the server raised on purpose keep its message word for word. Failures of the
    transport itself (nothing listening, deadline passed) get a message naming the target.
    """
    code = error.code() if isinstance(error, grpc.Call) else grpc.StatusCode.UNKNOWN
    details = (error.details() if isinstance(error, grpc.Call) else None) or str(error)
    trailing = error.trailing_metadata() if isinstance(error, grpc.Call) else None
    sent_class = next((v for k, v in trailing or () if k == ERROR_CLASS_KEY), None)

    if sent_class is not None and code in ERROR_CLASS_BY_CODE:
        return _class_named(sent_class, ERROR_CLASS_BY_CODE[code])(details)
    if code == grpc.StatusCode.UNAVAILABLE:
        return errors.Unavailable(
            f"cannot reach the batchd server at {target!r} ({details}); check that "
            "`batchd-server serve` is listening there, or pass another target "
            "(Catalog(target=...) or BATCHD_TARGET)"
        )
    if code == grpc.StatusCode.DEADLINE_EXCEEDED:
        return errors.Unavailable(
            f"{method} on {target!r} got no answer within {timeout_s:g} s; the server may be "
            "overloaded or its catalog slow. Pass a larger timeout_s to retry with more time"
        )
    if code == grpc.StatusCode.UNAUTHENTICATED:
        return errors.Unauthenticated(
            f"the batchd server at {target!r} refused {method}: {details}"
            if "auth_token" in details
            else f"the batchd server at {target!r} refused {method} ({details}); pass its "
            "token as auth_token= or set BATCHD_AUTH_TOKEN"
        )
    if code == grpc.StatusCode.UNIMPLEMENTED:
        return BatchdError(
            f"the server at {target!r} does not implement {method}: it is older than this "
            f"client ({details}); upgrade batchd-server to the client's version"
        )
    if code in ERROR_CLASS_BY_CODE:
        return ERROR_CLASS_BY_CODE[code](details)
    return BatchdError(f"{method} on {target!r} failed with {code.name}: {details}")


UPGRADE_BOTH: Final = "upgrade both to the same batchd version"
"""The remedy when client and server speak different versions of the protocol."""


def disagreement(problem: str, *, on: str = "the wire format") -> DataLoss:
    """The DataLoss for a peer that broke the protocol: ``problem``, then the remedy."""
    return DataLoss(f"{problem}; client and server disagree on {on} ({UPGRADE_BOTH})")
