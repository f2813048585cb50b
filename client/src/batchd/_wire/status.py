"""The one table between status codes and ``batchd.errors``, used by both sides.

Codes are named as gRPC names them (``"INVALID_ARGUMENT"``), so this table needs no grpc:
the server's gRPC layer (``batchd_server.api.status``) and its doorbell, and the client's
(``batchd._rpc_errors``), each turn a name into their own code object. The server answers an
exception with the code of its nearest class here and sends the exact class name in the
trailing metadata key :data:`ERROR_CLASS_KEY` (or a doorbell frame); the client turns that
back into the same class, so training code never sees a ``grpc.RpcError``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Final

from batchd import errors
from batchd.errors import BatchdError, DataLoss

__all__ = [
    "ERROR_CLASS_BY_CODE",
    "UPGRADE_BOTH",
    "class_named",
    "disagreement",
    "error_named",
    "status_name_for",
]

# One class per code and one code per class; subclasses (DataError, SnapshotMismatch) share
# their parent's code and travel by name.
ERROR_CLASS_BY_CODE: Final[Mapping[str, type[BatchdError]]] = {
    "INVALID_ARGUMENT": errors.InvalidArgument,
    "NOT_FOUND": errors.NotFound,
    "ALREADY_EXISTS": errors.AlreadyExists,
    "FAILED_PRECONDITION": errors.FailedPrecondition,
    "RESOURCE_EXHAUSTED": errors.ResourceExhausted,
    "UNAVAILABLE": errors.Unavailable,
    "DATA_LOSS": errors.DataLoss,
    "UNAUTHENTICATED": errors.Unauthenticated,
}
_CODE_BY_ERROR_CLASS: Final = {cls: code for code, cls in ERROR_CLASS_BY_CODE.items()}


def status_name_for(error: BaseException) -> tuple[str, str] | None:
    """The status code's name for ``error`` and the name of its nearest ``batchd.errors``
    class; None for anything that is not a :class:`~batchd.errors.BatchdError` with a code
    in the table (the server answers those with INTERNAL)."""
    code = next(
        (_CODE_BY_ERROR_CLASS[c] for c in type(error).__mro__ if c in _CODE_BY_ERROR_CLASS), None
    )
    if code is None:
        return None
    name = next(c.__name__ for c in type(error).__mro__ if c.__module__ == errors.__name__)
    return code, name


def class_named(name: str | None, base: type[BatchdError]) -> type[BatchdError]:
    """``batchd.errors.<name>`` if it is a subclass of ``base``, else ``base``."""
    if name is None or name not in errors.__all__:
        return base
    cls = getattr(errors, name)
    return cls if isinstance(cls, type) and issubclass(cls, base) else base


def error_named(name: str, message: str) -> BatchdError:
    """The ``batchd.errors`` exception the server named (``BatchdError`` for unknown names)."""
    return class_named(name, BatchdError)(message)


UPGRADE_BOTH: Final = "upgrade both to the same batchd version"
"""The remedy when client and server speak different versions of the protocol."""


def disagreement(problem: str, *, on: str = "the wire format") -> DataLoss:
    """The DataLoss for a peer that broke the protocol: ``problem``, then the remedy."""
    return DataLoss(f"{problem}; client and server disagree on {on} ({UPGRADE_BOTH})")
