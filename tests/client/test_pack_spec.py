"""``batchd.Pack`` checks itself when built, travels as the proto's ``Pack``, is refused
without a Tokens pipeline, and a saved state records it."""

from __future__ import annotations

import pytest

import batchd
from batchd._options import LoaderOptions
from batchd._proto.batchd.v1 import loader_pb2
from batchd.errors import InvalidArgument


@pytest.mark.parametrize(
    ("method", "wire"),
    [
        ("best_fit", loader_pb2.PACK_METHOD_BEST_FIT),
        ("first_fit", loader_pb2.PACK_METHOD_FIRST_FIT),
        ("concat", loader_pb2.PACK_METHOD_CONCAT),
    ],
)
def test_a_pack_travels_as_the_requests_pack(method: str, wire: int) -> None:
    options = LoaderOptions(
        dataset="web",
        batch_size=8,
        rank=0,
        world_size=1,
        pipeline=batchd.Tokens(max_len=64, dtype="uint16"),
        pack=batchd.Pack(seq_len=32, method=method),
    )
    request = options.to_request()
    assert request.HasField("pack")
    assert (request.pack.seq_len, request.pack.method) == (32, wire)
    assert options.pack_state() == {"seq_len": 32, "method": method}


def test_a_loader_without_pack_sends_none() -> None:
    options = LoaderOptions(
        dataset="web", batch_size=8, rank=0, world_size=1, pipeline=batchd.Tokens(max_len=4)
    )
    assert not options.to_request().HasField("pack")
    assert options.pack_state() is None


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"seq_len": 0}, "Pack seq_len=0"),
        ({"seq_len": 1 << 21}, "Pack seq_len"),
        ({"seq_len": True}, "Pack seq_len"),
        ({"seq_len": 8, "method": "best"}, "'best_fit', 'first_fit', 'concat'"),
    ],
)
def test_bad_pack_arguments_say_what_is_valid(kwargs: dict, message: str) -> None:
    with pytest.raises(InvalidArgument, match=message):
        batchd.Pack(**kwargs)


def test_pack_needs_a_tokens_pipeline_and_says_so() -> None:
    with pytest.raises(InvalidArgument, match=r"pipeline=batchd\.Tokens"):
        LoaderOptions(
            dataset="web",
            batch_size=8,
            rank=0,
            world_size=1,
            pipeline=batchd.Image(),
            pack=batchd.Pack(seq_len=32),
        )
    with pytest.raises(InvalidArgument, match=r"must be a batchd\.Pack"):
        LoaderOptions(
            dataset="web",
            batch_size=8,
            rank=0,
            world_size=1,
            pipeline=batchd.Tokens(max_len=4),
            pack=2048,  # type: ignore[arg-type]
        )
