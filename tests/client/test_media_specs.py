"""batchd.Video and batchd.Audio: checked when built, and every option reaches the server's
pipeline as given (spec -> wire -> the server's session options -> the built pipeline)."""

from __future__ import annotations

from typing import Any

import pytest

import batchd
from batchd._proto.batchd.v1 import loader_pb2
from batchd.errors import InvalidArgument
from batchd_server.api.session_rpcs import session_options
from batchd_server.pipelines import build_pipeline


def _served(spec: Any) -> Any:
    request = loader_pb2.OpenSessionRequest(dataset="d", batch_size=4, pipeline=spec._to_proto())
    options = session_options(request)
    return options.pipeline_kind, build_pipeline(options.pipeline_kind, options.pipeline_options)


def test_video_options_reach_the_server_pipeline() -> None:
    kind, built = _served(
        batchd.Video(frames=8, size=112, fps=4, clip="uniform", clips_per_video=3)
    )
    assert kind == "video"
    assert (built.frames, built.size, built.fps, built.clip, built.clips) == (
        8,
        112,
        4.0,
        "uniform",
        3,
    )
    assert [f.shape for f in built.fields()] == [(3, 8, 3, 112, 112), (3,), (3, 8)]
    _, default = _served(batchd.Video())
    assert (default.frames, default.size, default.fps, default.clip, default.clips) == (
        16,
        224,
        0.0,
        "random",
        1,
    )
    assert [f.shape for f in default.fields()] == [(16, 3, 224, 224), (), (16,)]


def test_audio_options_reach_the_server_pipeline() -> None:
    kind, built = _served(
        batchd.Audio(sample_rate=8000, seconds=2.5, mono=False, crop="start", dtype="int16")
    )
    assert kind == "audio"
    assert (built.sample_rate, built.seconds, built.mono, built.crop, built.dtype) == (
        8000,
        2.5,
        False,
        "start",
        "int16",
    )
    assert [f.shape for f in built.fields()] == [(2, 20000), (), (20000,)]
    _, whole = _served(batchd.Audio(max_seconds=3.0))
    assert (whole.seconds, whole.samples, whole.crop, whole.dtype) == (
        None,
        48000,
        "random",
        "float32",
    )


@pytest.mark.parametrize(
    ("make", "words"),
    [
        (lambda: batchd.Video(frames=0), "Video frames=0"),
        (lambda: batchd.Video(size=True), "Video size=True"),
        (lambda: batchd.Video(fps=0), "Video fps=0"),
        (lambda: batchd.Video(clip="middle"), "'random', 'uniform', 'center'"),
        (lambda: batchd.Video(clips_per_video=65), "clips_per_video=65"),
        (lambda: batchd.Audio(sample_rate=100), "sample_rate=100"),
        (lambda: batchd.Audio(seconds=float("nan")), "seconds=nan"),
        (lambda: batchd.Audio(crop="end"), "'random', 'start'"),
        (lambda: batchd.Audio(dtype="float64"), "'float32', 'int16'"),
        (lambda: batchd.Audio(max_seconds=0), "max_seconds=0"),
    ],
)
def test_a_bad_media_spec_fails_when_built(make: Any, words: str) -> None:
    with pytest.raises(InvalidArgument, match=words):
        make()
