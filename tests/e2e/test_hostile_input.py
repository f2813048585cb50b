"""Requests a hostile or broken client may send: names with NUL or of any length, messages
far beyond what a client needs, shapes whose size overflows, and catalog rows whose root
lies outside the server's allowlist."""

from __future__ import annotations

import json
from pathlib import Path

import grpc
import pytest
from sqlalchemy.engine import Engine

import batchd
from batchd import errors
from batchd._proto.batchd.v1 import loader_pb2, loader_pb2_grpc
from batchd_server.catalog.ingest import ingest_manifest

from serving import RECORD_FLOATS, record_dataset, serve


def _array(shape: tuple[int, ...] = (RECORD_FLOATS,)) -> batchd.Array:
    return batchd.Array(shape, "float32", raw=True)


def test_names_with_nul_or_too_long_are_invalid_arguments(engine: Engine, tmp_path: Path) -> None:
    """A NUL in a dataset, split or version name, or a 10,000-character name, is
    InvalidArgument naming the problem, not an internal error from the database."""
    record_dataset(engine, tmp_path / "r", n=10)
    url = engine.url.render_as_string(hide_password=False)
    with serve(url, tmp_path, workers=1) as srv:
        cases = [
            {"dataset": "rec\x00ords"},
            {"dataset": "records", "split": "tr\x00ain"},
            {"dataset": "records", "version": "1\x00"},
            {"dataset": "x" * 10_000},
        ]
        for case in cases:
            with pytest.raises(errors.InvalidArgument, match=r"control character|at most"):
                batchd.Loader(srv.address, batch_size=2, pipeline=_array(), **case)  # type: ignore[arg-type]
        with (
            pytest.raises(errors.InvalidArgument, match="control character"),
            batchd.Catalog(srv.address) as catalog,
        ):
            catalog.describe_dataset("a\x00b")


def test_a_request_over_one_mib_is_refused_before_it_is_read(
    engine: Engine, tmp_path: Path
) -> None:
    """A 2 MiB OpenSession is RESOURCE_EXHAUSTED from gRPC itself; the server stays up."""
    record_dataset(engine, tmp_path / "r", n=10)
    url = engine.url.render_as_string(hide_password=False)
    with serve(url, tmp_path, workers=1) as srv, grpc.insecure_channel(srv.address) as channel:
        stub = loader_pb2_grpc.LoaderStub(channel)
        huge = loader_pb2.OpenSessionRequest(dataset="records", snapshot="s" * (2 << 20))
        with pytest.raises(grpc.RpcError) as caught:
            stub.OpenSession(huge, timeout=30)
        assert caught.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert stub.ListDatasets(loader_pb2.ListDatasetsRequest(), timeout=30).datasets


def test_a_shape_whose_size_overflows_is_refused_before_anything_is_allocated(
    engine: Engine, tmp_path: Path
) -> None:
    """Dimensions whose product passes 2**63 are InvalidArgument; no segment is created."""
    record_dataset(engine, tmp_path / "r", n=10)
    url = engine.url.render_as_string(hide_password=False)
    with serve(url, tmp_path, workers=1) as srv:
        reserved = srv.registry.reserved_bytes()
        for shape in [(1 << 40, 1 << 40), (1 << 62, 4), (1 << 31,) * 3]:
            with pytest.raises(errors.InvalidArgument):
                batchd.Loader(srv.address, dataset="records", batch_size=2, pipeline=_array(shape))
        assert srv.registry.reserved_bytes() == reserved
        assert len(srv.sessions) == 0


def test_a_dataset_rooted_outside_the_data_roots_is_refused(engine: Engine, tmp_path: Path) -> None:
    """--data-root allowlist: a catalog row whose root lies elsewhere (directly or through a
    symlink) is FailedPrecondition naming --data-root; one inside is served."""
    allowed = tmp_path / "allowed"
    record_dataset(engine, allowed / "records", n=20)
    outside = tmp_path / "elsewhere"
    outside.mkdir()
    (outside / "shard-000.bin").write_bytes((allowed / "records" / "shard-000.bin").read_bytes())
    (allowed / "sneaky").symlink_to(outside)
    manifest = tmp_path / "m.jsonl"
    rows = [{"path": "shard-000.bin", "byte_offset": 0, "byte_length": 128, "split": "train"}]
    manifest.write_text("".join(json.dumps(r) + "\n" for r in rows))
    ingest_manifest(engine, dataset="outside", root=outside, manifest=manifest, verify=False)
    ingest_manifest(
        engine, dataset="linked", root=allowed / "sneaky", manifest=manifest, verify=False
    )
    url = engine.url.render_as_string(hide_password=False)
    with serve(url, tmp_path, workers=1, data_roots=(allowed,)) as srv:
        for name in ("outside", "linked"):
            with pytest.raises(errors.FailedPrecondition, match="--data-root"):
                batchd.Loader(srv.address, dataset=name, batch_size=1, pipeline=_array())
        with batchd.Loader(
            srv.address, dataset="records", batch_size=5, pipeline=_array(), device="cpu"
        ) as loader:
            assert sum(len(b["sample_id"]) for b in loader) == 20
