"""The gRPC layer: the only part of batchd_server that imports grpc.

``servicer.py`` parses requests, calls domain code and builds replies; ``status.py`` turns
domain errors into status codes; ``server.py`` binds and starts the server.
"""

from __future__ import annotations

from batchd_server.api.server import RunningServer, build_server
from batchd_server.api.servicer import LoaderServicer

__all__ = ["LoaderServicer", "RunningServer", "build_server"]
