"""batchd: a data loader that runs as a service for PyTorch training.

This is the client distribution. It needs only grpcio, protobuf and numpy; it uses torch
when torch is installed. ``import batchd`` is cheap: the Loader, the catalog client (and
with them grpc) and the framework wrappers (and with them torch) are imported on first use,
so a process that only needs the wire contract (``batchd._wire``, a decode worker of the
server) never loads them.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from batchd import errors
from batchd._version import __version__

if TYPE_CHECKING:
    from batchd._catalog import Catalog, DatasetInfo, SplitInfo
    from batchd._dataset import DataLoader, IterableDataset
    from batchd._fields import Field, Fields
    from batchd._loader import Loader
    from batchd._media import Audio, Video
    from batchd._packing import Pack
    from batchd._pipelines import Array, Chat, Custom, Image, Text, Tokens
    from batchd._sources import Mix, Source

__all__ = [
    "Array",
    "Audio",
    "Catalog",
    "Chat",
    "Custom",
    "DataLoader",
    "DatasetInfo",
    "Field",
    "Fields",
    "Image",
    "IterableDataset",
    "Loader",
    "Mix",
    "Pack",
    "Source",
    "SplitInfo",
    "Text",
    "Tokens",
    "Video",
    "__version__",
    "errors",
]

_LAZY: dict[str, str] = {
    "Array": "batchd._pipelines",
    "Audio": "batchd._media",
    "Catalog": "batchd._catalog",
    "Chat": "batchd._pipelines",
    "Custom": "batchd._pipelines",
    "DataLoader": "batchd._dataset",
    "DatasetInfo": "batchd._catalog",
    "Field": "batchd._fields",
    "Fields": "batchd._fields",
    "Image": "batchd._pipelines",
    "IterableDataset": "batchd._dataset",
    "Loader": "batchd._loader",
    "Mix": "batchd._sources",
    "Pack": "batchd._packing",
    "Source": "batchd._sources",
    "SplitInfo": "batchd._catalog",
    "Text": "batchd._pipelines",
    "Tokens": "batchd._pipelines",
    "Video": "batchd._media",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'batchd' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # the next lookup is a plain attribute
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
