"""batchd: a data loader that runs as a service for PyTorch training.

This is the client distribution. It needs only grpcio, protobuf and numpy; it uses torch
when torch is installed.
"""

from __future__ import annotations

from batchd import errors
from batchd._catalog import Catalog, DatasetInfo, SplitInfo
from batchd._version import __version__

__all__ = [
    "Catalog",
    "DatasetInfo",
    "SplitInfo",
    "__version__",
    "errors",
]
