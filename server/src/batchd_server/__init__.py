"""batchd-server: the batchd service (catalog, ingest, and the batch path)."""

from __future__ import annotations

__version__ = "0.1.0"

__all__ = ["__version__"]
