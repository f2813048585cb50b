"""The Loader service: parse the request, call the catalog, build the reply."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

import grpc

from batchd._proto.batchd.v1 import loader_pb2, loader_pb2_grpc
from batchd_server.api import session_rpcs
from batchd_server.api.admission import client_identity
from batchd_server.api.status import map_errors
from batchd_server.catalog import queries
from batchd_server.catalog.queries import DatasetSummary
from batchd_server.errors import InvalidArgument, Unavailable
from batchd_server.limits import check_name
from batchd_server.sessions import SessionManager

if TYPE_CHECKING:  # only catalog/ imports SQLAlchemy
    from batchd_server.catalog.db import Engine

__all__ = ["LoaderServicer"]


def _dataset_message(summary: DatasetSummary) -> loader_pb2.Dataset:
    msg = loader_pb2.Dataset(
        name=summary.name,
        version=summary.version,
        root=summary.root,
        description=summary.description,
        classes=summary.classes,
        splits=[
            loader_pb2.Split(name=s.name, samples=s.samples, verified=s.verified)
            for s in summary.splits
        ],
    )
    # A naive created_at (SQLite keeps no zone) is UTC: the column's default is the
    # database's now(), which SQLite reports in UTC.
    msg.created_at.FromDatetime(summary.created_at)
    return msg


class LoaderServicer(loader_pb2_grpc.LoaderServicer):
    """Serves the catalog RPCs from ``engine`` and the session RPCs from ``sessions``.

    ``draining`` says whether the server is shutting down: then OpenSession is refused.
    """

    def __init__(
        self,
        engine: Engine,
        sessions: SessionManager,
        *,
        draining: Callable[[], bool] = lambda: False,
    ) -> None:
        self._engine = engine
        self._sessions = sessions
        self._draining = draining

    @map_errors
    def ListDatasets(
        self, request: loader_pb2.ListDatasetsRequest, context: grpc.ServicerContext
    ) -> loader_pb2.ListDatasetsResponse:
        summaries = queries.list_datasets(self._engine)
        return loader_pb2.ListDatasetsResponse(datasets=[_dataset_message(s) for s in summaries])

    @map_errors
    def DescribeDataset(
        self, request: loader_pb2.DescribeDatasetRequest, context: grpc.ServicerContext
    ) -> loader_pb2.DescribeDatasetResponse:
        if not request.name:
            raise InvalidArgument("DescribeDataset needs a dataset name; got an empty one")
        check_name("dataset", request.name)
        check_name("version", request.version, required=False)
        summary = queries.describe_dataset(self._engine, request.name, request.version or None)
        return loader_pb2.DescribeDatasetResponse(dataset=_dataset_message(summary))

    @map_errors
    def OpenSession(
        self, request: loader_pb2.OpenSessionRequest, context: grpc.ServicerContext
    ) -> loader_pb2.OpenSessionResponse:
        if self._draining():
            raise Unavailable(
                "this batchd server is shutting down and opens no new sessions; open it on "
                "another replica, or after the restart (a Loader resumes with "
                "load_state_dict(old.state_dict()))"
            )
        return session_rpcs.open_session(self._sessions, request, client_identity(context))

    @map_errors
    def StreamBatches(
        self,
        request_iterator: Iterator[loader_pb2.StreamBatchesRequest],
        context: grpc.ServicerContext,
    ) -> Iterator[loader_pb2.StreamBatchesResponse]:
        yield from session_rpcs.stream_batches(self._sessions, request_iterator, context)

    @map_errors
    def CloseSession(
        self, request: loader_pb2.CloseSessionRequest, context: grpc.ServicerContext
    ) -> loader_pb2.CloseSessionResponse:
        # Another client's session stays open and the reply is the same as for one that does
        # not exist (closing is idempotent: a session may have expired already), so that
        # nobody learns which sessions exist.
        if request.session_id:
            self._sessions.close(request.session_id, client=client_identity(context))
        return loader_pb2.CloseSessionResponse()
