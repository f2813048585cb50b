"""The gRPC metadata keys both sides read and write."""

from __future__ import annotations

from typing import Final

__all__ = ["CLIENT_ID_KEY", "ERROR_CLASS_KEY"]

CLIENT_ID_KEY: Final = "batchd-client"
"""Call metadata: who is calling (``<hostname>/<pid>``), for the server's per-client limits."""
ERROR_CLASS_KEY: Final = "batchd-error-class"
"""Trailing metadata of a failed call: the ``batchd.errors`` class name the server raised."""
