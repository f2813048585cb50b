"""Domain errors to gRPC status codes, in one place.

Servicer methods raise :class:`~batchd_server.errors.BatchdError` subclasses and never touch
status codes. :func:`map_errors` catches what they raise and ends the call with
``context.abort``, which raises, so no handler can set a code and carry on. The table itself
lives in ``batchd._wire.status``, shared with the client that maps the codes back.
"""

from __future__ import annotations

import functools
import inspect
import logging
from collections.abc import Callable, Iterator
from typing import Any, NoReturn, TypeVar

import grpc

from batchd._wire.metadata import ERROR_CLASS_KEY
from batchd._wire.status import status_name_for

__all__ = ["abort_with", "map_errors"]

logger = logging.getLogger(__name__)

F = TypeVar("F", bound=Callable[..., Any])


def abort_with(context: grpc.ServicerContext, error: Exception, rpc: str) -> NoReturn:
    """End the call with the status code that ``error`` maps to.

    BatchdError subclasses keep their message and send their class name in the trailing
    metadata; anything else is a bug, answered with INTERNAL and logged with its traceback.
    """
    if context.code() is not None:
        # The handler aborted the call itself (context.abort raises a bare Exception);
        # keep the status it chose.
        raise error
    mapped = status_name_for(error)
    if mapped is None:
        logger.error("%s failed with an unexpected error", rpc, exc_info=error)
        context.abort(
            grpc.StatusCode.INTERNAL,
            f"{rpc} failed inside the server ({type(error).__name__}); "
            "the server's log has the traceback",
        )
    else:
        code_name, class_name = mapped
        code = grpc.StatusCode[code_name]
        logger.debug("%s: %s: %s", rpc, code_name, error)
        context.set_trailing_metadata(((ERROR_CLASS_KEY, class_name),))
        context.abort(code, str(error))
    raise AssertionError("context.abort returned instead of raising")  # pragma: no cover


def map_errors(method: F) -> F:
    """Decorate a servicer method ``(self, request, context)`` so its errors become statuses.

    Works for unary methods and for response-streaming (generator) methods alike.
    """
    rpc = method.__name__

    if inspect.isgeneratorfunction(method):

        @functools.wraps(method)
        def stream(self: Any, request: Any, context: grpc.ServicerContext) -> Iterator[Any]:
            try:
                yield from method(self, request, context)
            except Exception as e:
                abort_with(context, e, rpc)

        return stream  # type: ignore[return-value]

    @functools.wraps(method)
    def unary(self: Any, request: Any, context: grpc.ServicerContext) -> Any:
        try:
            return method(self, request, context)
        except Exception as e:
            abort_with(context, e, rpc)

    return unary  # type: ignore[return-value]
