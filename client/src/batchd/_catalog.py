"""``batchd.Catalog``: what datasets a batchd server can serve."""

from __future__ import annotations

import os
import weakref
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

import grpc

from batchd._channel import ChannelSecurity, explain_unreachable, open_channel
from batchd._proto.batchd.v1 import loader_pb2, loader_pb2_grpc
from batchd._rpc_errors import error_from_rpc
from batchd._targets import resolve_target
from batchd._wire.lifetime import Closeable
from batchd.errors import FailedPrecondition, InvalidArgument, NotFound

__all__ = [
    "DEFAULT_TIMEOUT_S",
    "Catalog",
    "DatasetInfo",
    "SplitInfo",
]

DEFAULT_TIMEOUT_S = 30.0


@dataclass(frozen=True)
class SplitInfo:
    """One split of a dataset version."""

    name: str
    samples: int
    """Samples the split has in the catalog."""
    verified: int
    """Samples a session on this split would serve (the verified ones)."""


@dataclass(frozen=True)
class DatasetInfo:
    """One version of a dataset in the server's catalog."""

    name: str
    version: str
    root: str
    """Directory or URI prefix of the sample paths, as the server sees it."""
    description: str
    created_at: datetime
    """When the version was ingested (timezone-aware, UTC)."""
    classes: tuple[str, ...]
    """Class names indexed by label; empty when the dataset has none."""
    splits: tuple[SplitInfo, ...]
    """Ordered by name."""

    def split(self, name: str) -> SplitInfo:
        """The split called ``name``.

        Raises:
            NotFound: the dataset has no such split; the message lists the splits it has.
        """
        for split in self.splits:
            if split.name == name:
                return split
        have = ", ".join(s.name for s in self.splits) or "none (no samples yet)"
        raise NotFound(
            f"dataset {self.name!r} version {self.version!r} has no split {name!r}; splits: {have}"
        )

    @classmethod
    def _from_proto(cls, msg: loader_pb2.Dataset) -> DatasetInfo:
        return cls(
            name=msg.name,
            version=msg.version,
            root=msg.root,
            description=msg.description,
            created_at=msg.created_at.ToDatetime(tzinfo=UTC),
            classes=tuple(msg.classes),
            splits=tuple(
                SplitInfo(name=s.name, samples=s.samples, verified=s.verified) for s in msg.splits
            ),
        )


class Catalog(Closeable):
    """A read-only view of a batchd server's catalog.

    Args:
        target: The server's gRPC address, ``unix:///path/to.sock`` or ``host:port``; default
            ``$BATCHD_TARGET``.
        timeout_s: Deadline of each call, in seconds.
        auth_token: The server's bearer token; default ``$BATCHD_AUTH_TOKEN``.
        tls_ca: PEM file of the CA that signed the server's TLS certificate (TCP targets);
            default ``$BATCHD_TLS_CA``; None and unset: plaintext.

    Raises:
        InvalidArgument: no target, ``timeout_s`` is not positive, or a TLS file cannot be
            read.

    Every method raises the ``batchd.errors`` exception the server meant (``NotFound`` for an
    unknown dataset, ``Unavailable`` when the server cannot be reached, ...), never a
    ``grpc.RpcError``. Use it as a context manager, or call :meth:`close`.
    """

    def __init__(
        self,
        target: str | None = None,
        *,
        timeout_s: float = DEFAULT_TIMEOUT_S,
        auth_token: str | None = None,
        tls_ca: str | os.PathLike[str] | None = None,
    ) -> None:
        if not timeout_s > 0:
            raise InvalidArgument(f"timeout_s={timeout_s} must be > 0 seconds")
        self._target = resolve_target(target)
        self._timeout_s = float(timeout_s)
        self._security = ChannelSecurity.resolve(auth_token, tls_ca)
        self._channel = open_channel(self._target, self._security)
        self._stub = loader_pb2_grpc.LoaderStub(self._channel)
        self._closed = False
        self._finalizer = weakref.finalize(self, self._channel.close)

    @property
    def target(self) -> str:
        return self._target

    @property
    def timeout_s(self) -> float:
        return self._timeout_s

    def list_datasets(self) -> list[DatasetInfo]:
        """Every dataset version in the catalog, ordered by name, then by ingest order."""
        reply = self._call("ListDatasets", loader_pb2.ListDatasetsRequest())
        return [DatasetInfo._from_proto(d) for d in reply.datasets]

    def describe_dataset(self, name: str, version: str | None = None) -> DatasetInfo:
        """One dataset version; ``version=None`` means the newest.

        Raises:
            NotFound: no such dataset or version; the message lists what exists.
        """
        request = loader_pb2.DescribeDatasetRequest(name=name, version=version or "")
        reply = self._call("DescribeDataset", request)
        return DatasetInfo._from_proto(reply.dataset)

    def close(self) -> None:
        """Close the connection; further calls raise FailedPrecondition. Idempotent."""
        self._closed = True
        self._finalizer()

    def __repr__(self) -> str:
        state = "closed" if self._closed else "open"
        return f"Catalog(target={self._target!r}, timeout_s={self._timeout_s:g}) [{state}]"

    def _call(self, method: str, request: Any) -> Any:
        if self._closed:
            raise FailedPrecondition(f"this Catalog for {self._target!r} is closed; open a new one")
        try:
            return getattr(self._stub, method)(request, timeout=self._timeout_s)
        except grpc.RpcError as e:
            error = error_from_rpc(e, target=self._target, method=method, timeout_s=self._timeout_s)
            raise explain_unreachable(error, self._target, self._security) from e
