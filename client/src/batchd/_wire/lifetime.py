"""``with obj:`` for every object of batchd that holds something to close."""

from __future__ import annotations

from types import TracebackType
from typing import Self

__all__ = ["Closeable"]


class Closeable:
    """A context manager whose exit is :meth:`close`; subclasses define ``close``."""

    def close(self) -> None:
        raise NotImplementedError

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()
