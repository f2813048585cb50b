"""``/metrics``: the registry served over HTTP from a thread of the server.

Every subject's metrics are registered before the first scrape (the imports below), so a
scrape lists every family even before the code that records one has run."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from prometheus_client import start_http_server

from batchd_server.metrics import (  # noqa: F401  (registers each subject's metrics)
    admission,
    decode_cache,
    delivery,
    mixing,
    node_cache,
    scaling,
    stall,
    workers,
)
from batchd_server.metrics.registry import REGISTRY

if TYPE_CHECKING:
    from wsgiref.simple_server import WSGIServer

__all__ = ["MetricsEndpoint", "serve"]


@dataclass
class MetricsEndpoint:
    """A running ``/metrics`` HTTP server; :meth:`close` stops it."""

    host: str
    port: int
    _httpd: WSGIServer

    @property
    def address(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{host}:{self.port}"

    def close(self) -> None:
        self._httpd.shutdown()
        self._httpd.server_close()


def serve(host: str, port: int) -> MetricsEndpoint:
    """Serve ``/metrics`` on ``host:port`` (port 0: a free one) from a daemon thread.

    Raises:
        OSError: the address cannot be bound.
    """
    httpd, _thread = start_http_server(port, addr=host, registry=REGISTRY)
    return MetricsEndpoint(host, int(httpd.server_address[1]), httpd)
