"""gRPC's side of the status table: a failed call becomes a ``batchd.errors`` exception.

The table itself (code names to classes) is :mod:`batchd._wire.status`, shared with the
server; this module adds what only a gRPC client needs: reading a ``grpc.RpcError``.
"""

from __future__ import annotations

from typing import Final

import grpc

from batchd import errors
from batchd._wire.metadata import ERROR_CLASS_KEY
from batchd._wire.status import ERROR_CLASS_BY_CODE, class_named
from batchd.errors import BatchdError

__all__ = ["error_from_rpc"]

_TABLE: Final = {grpc.StatusCode[name]: cls for name, cls in ERROR_CLASS_BY_CODE.items()}


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

    if sent_class is not None and code in _TABLE:
        return class_named(sent_class, _TABLE[code])(details)
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
    if code in _TABLE:
        return _TABLE[code](details)
    return BatchdError(f"{method} on {target!r} failed with {code.name}: {details}")
