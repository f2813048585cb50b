"""batchd.Field and batchd.Fields: every option on the wire, a dict of fields is Fields, and
bad fields are refused when built."""

from __future__ import annotations

import pytest

import batchd
from batchd import errors
from batchd._fields import any_pipeline
from batchd._proto.batchd.v1 import loader_pb2


def test_fields_go_on_the_wire_with_their_sources_pipelines_and_optional_flags() -> None:
    spec = batchd.Fields(
        image=batchd.Field(".jpg", batchd.Image(size=32)),
        caption=batchd.Field("txt", batchd.Tokens(max_len=77), optional=True),
        emb=batchd.Array((4,), "float32"),
    )
    wire = spec._to_proto()
    assert wire.WhichOneof("kind") == "fields"
    got = [
        (f.name, f.source, f.optional, f.pipeline.WhichOneof("kind")) for f in wire.fields.fields
    ]
    assert got == [
        ("image", "jpg", False, "image"),
        ("caption", "txt", True, "tokens"),
        ("emb", "emb", False, "array"),
    ]
    assert wire.fields.fields[0].pipeline.image.size == 32
    assert isinstance(wire, loader_pb2.Pipeline)


def test_a_dict_of_fields_is_fields() -> None:
    fields = {"image": batchd.Field("jpg", batchd.Image()), "caption": batchd.Tokens(max_len=8)}
    spec = any_pipeline(fields)
    assert spec == batchd.Fields(fields)


@pytest.mark.parametrize(
    "build",
    [
        lambda: batchd.Fields(),
        lambda: batchd.Fields(label=batchd.Image()),
        lambda: batchd.Fields(sample_id=batchd.Image()),
        lambda: batchd.Fields({"a b": batchd.Image()}),
        lambda: batchd.Field("", batchd.Image()),
        lambda: batchd.Field("jpg", "image"),
        lambda: batchd.Field("jpg", batchd.Fields(image=batchd.Image())),
    ],
)
def test_bad_fields_are_refused_when_built(build: object) -> None:
    with pytest.raises(errors.InvalidArgument):
        build()  # type: ignore[operator]
