"""The catalog RPCs end to end: a real server on a unix socket or TCP, the real client.

Catalog rows are written with SQLAlchemy Core directly, so these tests do not depend on
ingest. Every server is stopped in its fixture's teardown.
"""

from __future__ import annotations

import socket
import threading
from collections.abc import Callable, Iterator
from concurrent import futures
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import grpc
import pytest
from sqlalchemy.engine import Engine

import batchd
from batchd import errors
from batchd._rpc_errors import error_from_rpc
from batchd_server.api import RunningServer, build_server
from batchd_server.api.status import map_errors
from batchd_server.catalog import queries
from batchd_server.catalog.schema import datasets, samples
from batchd_server.config import ServerConfig

CATS_V1_AT = datetime(2024, 1, 1, 0, 0, tzinfo=UTC)
TOKENS_AT = datetime(2024, 3, 1, 8, 15, 30, tzinfo=UTC)
CATS_V2_AT = datetime(2024, 6, 1, 12, 30, tzinfo=UTC)

CATS_V1 = batchd.DatasetInfo(
    name="cats",
    version="v1",
    root="/data/cats-v1",
    description="first cut",
    created_at=CATS_V1_AT,
    classes=("cat", "dog"),
    splits=(batchd.SplitInfo(name="train", samples=2, verified=2),),
)
CATS_V2 = batchd.DatasetInfo(
    name="cats",
    version="v2",
    root="/data/cats-v2",
    description="",
    created_at=CATS_V2_AT,
    classes=("cat", "dog", "fox"),
    splits=(
        batchd.SplitInfo(name="train", samples=3, verified=2),
        batchd.SplitInfo(name="val", samples=2, verified=2),
    ),
)
TOKENS = batchd.DatasetInfo(
    name="tokens",
    version="2024-03",
    root="s3://bucket/tokens",
    description="no samples yet",
    created_at=TOKENS_AT,
    classes=(),
    splits=(),
)


def _insert_dataset(conn: Any, info: batchd.DatasetInfo, verified: dict[str, list[bool]]) -> None:
    attrs = {"classes": list(info.classes)} if info.classes else None
    dataset_id = conn.execute(
        datasets.insert()
        .values(
            name=info.name,
            version=info.version,
            root=info.root,
            description=info.description,
            attrs=attrs,
            created_at=info.created_at,
        )
        .returning(datasets.c.id)
    ).scalar_one()
    rows = [
        {
            "dataset_id": dataset_id,
            "key": f"{split}/{i}",
            "path": f"{split}/{i}.jpg",
            "label": i % max(len(info.classes), 1),
            "split": split,
            "is_verified": ok,
        }
        for split, flags in verified.items()
        for i, ok in enumerate(flags)
    ]
    if rows:
        conn.execute(samples.insert(), rows)


@pytest.fixture
def catalog(engine: Engine) -> list[batchd.DatasetInfo]:
    """Three dataset versions in the catalog (inserted out of name order); returns them as
    ListDatasets should."""
    with engine.begin() as conn:
        _insert_dataset(conn, CATS_V1, {"train": [True, True]})
        _insert_dataset(conn, TOKENS, {})
        _insert_dataset(conn, CATS_V2, {"val": [True, True], "train": [True, False, True]})
    return [CATS_V1, CATS_V2, TOKENS]


def _database_url(engine: Engine) -> str:
    return engine.url.render_as_string(hide_password=False)


@pytest.fixture
def socket_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A directory with a short path: a unix socket path may have at most 107 bytes, which a
    parametrized test's tmp_path can exceed."""
    return tmp_path_factory.mktemp("uds")


@pytest.fixture
def start_server(socket_dir: Path) -> Iterator[Callable[..., RunningServer]]:
    """Starts servers; every one of them is stopped at teardown and its socket is gone."""
    started: list[RunningServer] = []

    def start(database_url: str, listen: str) -> RunningServer:
        srv = build_server(ServerConfig(database_url=database_url), listen, max_workers=4)
        started.append(srv)
        return srv

    yield start
    for srv in reversed(started):
        srv.stop(grace_s=None)
    assert not list(socket_dir.glob("*.sock")), "a stopped server left its socket file"


@pytest.fixture
def sqlite_config_url(tmp_path: Path) -> str:
    """A catalog for tests that never query it (binding, addresses)."""
    return f"sqlite:///{tmp_path / 'catalog.db'}"


@pytest.fixture(params=["unix", "tcp"])
def server(
    request: pytest.FixtureRequest,
    engine: Engine,
    socket_dir: Path,
    start_server: Callable[..., RunningServer],
) -> RunningServer:
    """A server over the ``engine`` catalog, once on a unix socket and once on TCP."""
    listen = f"unix://{socket_dir / 'loader.sock'}" if request.param == "unix" else "127.0.0.1:0"
    return start_server(_database_url(engine), listen)


def test_client_lists_every_dataset_version_with_split_counts(
    server: RunningServer, catalog: list[batchd.DatasetInfo]
) -> None:
    """list_datasets returns every version, ordered by name then ingest order, with split
    counts, verified counts, classes and UTC creation times."""
    with batchd.Catalog(server.address) as cat:
        assert cat.list_datasets() == catalog


def test_describe_dataset_returns_the_newest_version_unless_one_is_named(
    server: RunningServer, catalog: list[batchd.DatasetInfo]
) -> None:
    """describe_dataset(name) is the newest version; describe_dataset(name, v) is v."""
    with batchd.Catalog(server.address) as cat:
        newest = cat.describe_dataset("cats")
        assert newest == CATS_V2
        assert newest.created_at.tzinfo is not None
        assert newest.split("train").verified == 2
        assert cat.describe_dataset("cats", "v1") == CATS_V1
        assert cat.describe_dataset("tokens") == TOKENS


def test_unknown_dataset_raises_not_found_with_the_servers_message(
    server: RunningServer, engine: Engine, catalog: list[batchd.DatasetInfo]
) -> None:
    """An unknown dataset or version is batchd.errors.NotFound carrying the server's words."""
    with batchd.Catalog(server.address) as cat:
        for name, version in [("dogs", None), ("cats", "v9")]:
            with pytest.raises(errors.NotFound) as on_client:
                cat.describe_dataset(name, version)
            with pytest.raises(errors.NotFound) as on_server:
                queries.describe_dataset(engine, name, version)
            assert str(on_client.value) == str(on_server.value)
            assert "cats" in str(on_client.value)


def test_empty_dataset_name_is_an_invalid_argument(
    server: RunningServer, catalog: list[batchd.DatasetInfo]
) -> None:
    """DescribeDataset without a name is refused with InvalidArgument, not NOT_FOUND."""
    with batchd.Catalog(server.address) as cat, pytest.raises(errors.InvalidArgument, match="name"):
        cat.describe_dataset("")


def test_tcp_port_zero_is_resolved_in_the_bound_address(
    start_server: Callable[..., RunningServer], sqlite_config_url: str
) -> None:
    """Listening on host:0 reports the port the kernel picked, and clients reach it there."""
    srv = start_server(sqlite_config_url, "127.0.0.1:0")
    assert srv.port is not None and srv.port > 0
    assert srv.address == f"127.0.0.1:{srv.port}"
    with batchd.Catalog(srv.address) as cat:
        assert cat.list_datasets() == []


def test_unreachable_target_raises_unavailable_naming_the_target(tmp_path: Path) -> None:
    """Nothing listening (no socket file; a TCP port nobody accepts on) is Unavailable."""
    missing = f"unix://{tmp_path / 'nobody.sock'}"
    with batchd.Catalog(missing) as cat, pytest.raises(errors.Unavailable) as info:
        cat.list_datasets()
    assert missing in str(info.value)

    with socket.socket() as held:  # bound, never listening: connections are refused
        held.bind(("127.0.0.1", 0))
        closed = f"127.0.0.1:{held.getsockname()[1]}"
        with batchd.Catalog(closed) as cat, pytest.raises(errors.Unavailable) as info:
            cat.describe_dataset("cats")
    assert closed in str(info.value)


def test_tcp_port_held_by_another_server_is_refused(
    start_server: Callable[..., RunningServer], sqlite_config_url: str
) -> None:
    """A second server on a taken TCP port fails clearly instead of sharing the port."""
    first = start_server(sqlite_config_url, "127.0.0.1:0")
    with pytest.raises(errors.FailedPrecondition) as info:
        start_server(sqlite_config_url, first.address)
    assert first.address in str(info.value)
    assert "already in use" in str(info.value)
    with batchd.Catalog(first.address) as cat:
        assert cat.list_datasets() == []


def test_unix_socket_held_by_a_live_server_is_refused(
    start_server: Callable[..., RunningServer], sqlite_config_url: str, socket_dir: Path
) -> None:
    """A second server on a live server's socket path fails and the first keeps its socket
    (gRPC alone would unlink it and take over)."""
    listen = f"unix://{socket_dir / 'loader.sock'}"
    first = start_server(sqlite_config_url, listen)
    with pytest.raises(errors.FailedPrecondition, match="another server is already listening"):
        start_server(sqlite_config_url, listen)
    with batchd.Catalog(first.address) as cat:
        assert cat.list_datasets() == []


def test_socket_file_left_by_a_dead_server_is_reused(
    start_server: Callable[..., RunningServer], sqlite_config_url: str, socket_dir: Path
) -> None:
    """A socket file nobody accepts on (its server died) does not block a new server."""
    path = socket_dir / "loader.sock"
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as dead:
        dead.bind(str(path))
    assert path.is_socket()
    srv = start_server(sqlite_config_url, f"unix://{path}")
    with batchd.Catalog(srv.address) as cat:
        assert cat.list_datasets() == []


def test_socket_path_that_is_a_regular_file_is_refused(
    start_server: Callable[..., RunningServer], sqlite_config_url: str, tmp_path: Path
) -> None:
    """An existing non-socket file at the socket path is never deleted to make room."""
    path = tmp_path / "grpc.sock.txt"
    path.write_text("keep me")
    with pytest.raises(errors.FailedPrecondition, match="is not a socket"):
        start_server(sqlite_config_url, f"unix://{path}")
    assert path.read_text() == "keep me"


@pytest.mark.parametrize(
    "listen", ["", "localhost", "localhost:http", "127.0.0.1:70000", "unix:", "unix://rel.sock"]
)
def test_malformed_listen_address_is_an_invalid_argument(
    listen: str, start_server: Callable[..., RunningServer], sqlite_config_url: str
) -> None:
    """A listen address that is neither unix:... nor host:port is refused before binding."""
    with pytest.raises(errors.InvalidArgument, match="listen address"):
        start_server(sqlite_config_url, listen)


def test_catalog_target_comes_from_the_environment_or_is_required(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Without target=, BATCHD_TARGET is used; with neither, InvalidArgument says so."""
    monkeypatch.delenv("BATCHD_TARGET", raising=False)
    with pytest.raises(errors.InvalidArgument, match="BATCHD_TARGET"):
        batchd.Catalog()
    monkeypatch.setenv("BATCHD_TARGET", "unix:///run/batchd/grpc.sock")
    with batchd.Catalog() as cat:
        assert cat.target == "unix:///run/batchd/grpc.sock"
    with pytest.raises(errors.InvalidArgument, match="timeout_s"):
        batchd.Catalog("localhost:1", timeout_s=0)


def test_closed_catalog_refuses_calls(tmp_path: Path) -> None:
    """A call after close() is FailedPrecondition, not a grpc ValueError."""
    cat = batchd.Catalog(f"unix://{tmp_path / 'x.sock'}")
    cat.close()
    cat.close()
    with pytest.raises(errors.FailedPrecondition, match="closed"):
        cat.list_datasets()


def test_missing_split_lookup_lists_the_splits() -> None:
    """DatasetInfo.split names the splits that exist when asked for one that does not."""
    with pytest.raises(errors.NotFound, match="splits: train, val"):
        CATS_V2.split("test")


# --- The status mapping, through a real gRPC server -----------------------------------------

MAPPED = [
    errors.InvalidArgument,
    errors.DataError,
    errors.NotFound,
    errors.AlreadyExists,
    errors.FailedPrecondition,
    errors.SnapshotMismatch,
    errors.ResourceExhausted,
    errors.Unavailable,
]


class _Raiser:
    """Handlers that fail the way the request (an error class name) says."""

    def __init__(self) -> None:
        self.release = threading.Event()

    @map_errors
    def Raise(self, request: bytes, context: grpc.ServicerContext) -> bytes:
        name = request.decode()
        if name == "ValueError":
            raise ValueError("secret internals")
        if name == "abort":
            context.abort(grpc.StatusCode.PERMISSION_DENIED, "handler chose this")
        if name == "block":
            self.release.wait(timeout=60)
            return b""
        raise getattr(errors, name)(f"message of {name}")

    @map_errors
    def RaiseLater(self, request: bytes, context: grpc.ServicerContext) -> Iterator[bytes]:
        yield b"first"
        raise getattr(errors, request.decode())("from a stream")


@pytest.fixture
def raiser() -> Iterator[tuple[_Raiser, grpc.Channel, str]]:
    impl = _Raiser()
    handlers = {
        "Raise": grpc.unary_unary_rpc_method_handler(impl.Raise),
        "RaiseLater": grpc.unary_stream_rpc_method_handler(impl.RaiseLater),
    }
    server = grpc.server(futures.ThreadPoolExecutor(2), options=[("grpc.so_reuseport", 0)])
    server.add_generic_rpc_handlers([grpc.method_handlers_generic_handler("test.Raiser", handlers)])
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    target = f"127.0.0.1:{port}"
    channel = grpc.insecure_channel(target)
    try:
        yield impl, channel, target
    finally:
        impl.release.set()
        channel.close()
        server.stop(None).wait()


def _call(channel: grpc.Channel, target: str, name: str, timeout_s: float = 10.0) -> Any:
    try:
        return channel.unary_unary("/test.Raiser/Raise")(name.encode(), timeout=timeout_s)
    except grpc.RpcError as e:
        raise error_from_rpc(e, target=target, method="Raise", timeout_s=timeout_s) from e


@pytest.mark.parametrize("cls", MAPPED, ids=lambda c: c.__name__)
def test_every_batchd_error_reaches_the_client_as_the_same_class(
    cls: type[errors.BatchdError], raiser: tuple[_Raiser, grpc.Channel, str]
) -> None:
    """The server's exception class and message arrive unchanged, subclasses included."""
    _, channel, target = raiser
    with pytest.raises(errors.BatchdError) as info:
        _call(channel, target, cls.__name__)
    assert type(info.value) is cls
    assert str(info.value) == f"message of {cls.__name__}"


def test_unexpected_server_error_is_internal_and_logged_without_details(
    raiser: tuple[_Raiser, grpc.Channel, str], caplog: pytest.LogCaptureFixture
) -> None:
    """A bug in a handler reaches the client as a plain BatchdError naming INTERNAL and the
    exception type; its message and traceback stay in the server's log."""
    _, channel, target = raiser
    with pytest.raises(errors.BatchdError) as info:
        _call(channel, target, "ValueError")
    assert type(info.value) is errors.BatchdError
    assert "INTERNAL" in str(info.value) and "ValueError" in str(info.value)
    assert "secret internals" not in str(info.value)
    assert any(r.exc_info and "secret internals" in str(r.exc_info[1]) for r in caplog.records)


def test_handler_that_aborts_itself_keeps_its_status(
    raiser: tuple[_Raiser, grpc.Channel, str],
) -> None:
    """map_errors does not overwrite a status the handler set with context.abort."""
    _, channel, target = raiser
    with pytest.raises(errors.BatchdError, match=r"PERMISSION_DENIED.*handler chose this"):
        _call(channel, target, "abort")


def test_streaming_handler_errors_are_mapped_too(
    raiser: tuple[_Raiser, grpc.Channel, str],
) -> None:
    """An error raised mid-stream ends the stream with the error's code and class."""
    _, channel, target = raiser
    stream = channel.unary_stream("/test.Raiser/RaiseLater")(b"SnapshotMismatch", timeout=10)
    assert next(stream) == b"first"
    with pytest.raises(grpc.RpcError) as info:
        next(stream)
    mapped = error_from_rpc(info.value, target=target, method="RaiseLater", timeout_s=10)
    assert type(mapped) is errors.SnapshotMismatch
    assert str(mapped) == "from a stream"


def test_deadline_exceeded_is_unavailable_and_says_to_raise_the_timeout(
    raiser: tuple[_Raiser, grpc.Channel, str],
) -> None:
    """A call with no answer within its deadline is Unavailable naming timeout_s."""
    impl, channel, target = raiser
    try:
        with pytest.raises(errors.Unavailable, match=r"within 0\.05 s.*timeout_s"):
            _call(channel, target, "block", timeout_s=0.05)
    finally:
        impl.release.set()
