"""The server raises the client's exception classes, so both sides share one vocabulary.

Domain code imports errors from here; ``api/status.py`` maps them to gRPC codes.
"""

from __future__ import annotations

from batchd import errors as _errors
from batchd.errors import *  # noqa: F403 (the same classes, by design)

__all__ = list(_errors.__all__)
