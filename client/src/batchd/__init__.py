"""batchd: a data loader that runs as a service for PyTorch training.

This is the client distribution. It needs only grpcio, protobuf and numpy; it uses torch
when torch is installed (and imports it only when a Loader or IterableDataset needs it).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from batchd import errors
from batchd._catalog import Catalog, DatasetInfo, SplitInfo
from batchd._loader import Loader
from batchd._mix import Mix, Source
from batchd._specs import Array, Custom, Image, Tokens
from batchd._version import __version__

if TYPE_CHECKING:
    from batchd._dataset import DataLoader, IterableDataset

__all__ = [
    "Array",
    "Catalog",
    "Custom",
    "DataLoader",
    "DatasetInfo",
    "Image",
    "IterableDataset",
    "Loader",
    "Mix",
    "Source",
    "SplitInfo",
    "Tokens",
    "__version__",
    "errors",
]


def __getattr__(name: str) -> Any:
    # IterableDataset and DataLoader subclass torch's: importing them imports torch, which
    # `import batchd` must not do (slow, and optional).
    if name in ("DataLoader", "IterableDataset"):
        from batchd import _dataset

        return getattr(_dataset, name)
    raise AttributeError(f"module 'batchd' has no attribute {name!r}")
