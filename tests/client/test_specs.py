"""The client's argument checks: pipeline specs and Loader options, before any connection."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch

import batchd
from batchd.errors import InvalidArgument


def test_image_spec_defaults_to_224_and_travels_whole() -> None:
    """Image() is 224 px; every option reaches the wire's ImagePipeline."""
    assert batchd.Image().size == 224
    spec = batchd.Image(size=160, resize=176, random_crop=True, flip=True, scale=[0.2, 0.9])
    msg = spec._to_proto().image
    assert (msg.size, msg.resize, msg.random_crop, msg.flip, msg.decoder) == (
        160,
        176,
        True,
        True,
        "auto",
    )
    assert msg.scale_min == pytest.approx(0.2) and msg.ratio_max == pytest.approx(4 / 3)
    assert spec.scale == (0.2, 0.9)
    assert batchd.Image()._to_proto().image.resize == 0


@pytest.mark.parametrize(
    ("kwargs", "words"),
    [
        ({"size": 0}, "size=0"),
        ({"size": True}, "size=True"),
        ({"size": 224, "resize": 200}, "resize=200"),
        ({"decoder": "cv2"}, "'pillow'"),
        ({"scale": (0.0, 1.0)}, "scale"),
        ({"scale": (0.5, 0.2)}, "scale"),
        ({"ratio": (1.0,)}, "ratio"),
    ],
)
def test_image_spec_rejects_bad_values_naming_them(kwargs: dict[str, Any], words: str) -> None:
    """A bad Image option is an InvalidArgument that names the option and the value."""
    with pytest.raises(InvalidArgument, match=words):
        batchd.Image(**kwargs)


def test_array_spec_normalises_shape_and_dtype() -> None:
    """Array accepts an int shape and NumPy dtypes, stores a tuple and the dtype's name."""
    spec = batchd.Array(32, np.float32, raw=True)
    assert (spec.shape, spec.dtype, spec.raw) == ((32,), "float32", True)
    msg = spec._to_proto().array
    assert (list(msg.shape), msg.dtype, msg.raw) == ([32], "float32", True)
    assert batchd.Array((), "int64").shape == ()


@pytest.mark.parametrize(
    ("shape", "dtype", "words"),
    [
        ((0, 3), "float32", "dimension=0"),
        ("abc", "float32", "shape"),
        ((3,), "object", "numeric"),
        ((3,), "U10", "numeric"),
        ((3,), ">f4", "big-endian"),
        ((3,), "notadtype", "not a NumPy dtype"),
    ],
)
def test_array_spec_rejects_bad_shapes_and_dtypes(shape: Any, dtype: str, words: str) -> None:
    """Zero dimensions, non-numeric and big-endian dtypes are refused with the reason."""
    with pytest.raises(InvalidArgument, match=words):
        batchd.Array(shape, dtype)


def test_tokens_spec_checks_pad_id_against_its_dtype() -> None:
    """pad_id must fit the token dtype; only int32 and uint16 token files exist."""
    assert batchd.Tokens(128, "uint16", pad_id=65535)._to_proto().tokens.pad_id == 65535
    with pytest.raises(InvalidArgument, match="pad_id"):
        batchd.Tokens(128, "uint16", pad_id=-1)
    with pytest.raises(InvalidArgument, match="'int32', 'uint16'"):
        batchd.Tokens(128, "int64")
    with pytest.raises(InvalidArgument, match="max_len=0"):
        batchd.Tokens(0)


def test_custom_spec_options_travel_as_json() -> None:
    """Custom's keyword options become the message's JSON; non-JSON values are refused."""
    spec = batchd.Custom("audio", rate=16000, channels=[0, 1])
    msg = spec._to_proto().custom
    assert msg.name == "audio" and msg.options_json == '{"channels": [0, 1], "rate": 16000}'
    assert spec == batchd.Custom("audio", channels=[0, 1], rate=16000)
    with pytest.raises(InvalidArgument, match="JSON"):
        batchd.Custom("audio", fn=print)
    with pytest.raises(InvalidArgument, match="JSON"):
        batchd.Custom("audio", gain=float("nan"))
    with pytest.raises(InvalidArgument, match="name"):
        batchd.Custom("")


@pytest.mark.parametrize(
    ("kwargs", "words"),
    [
        ({"batch_size": 0}, "batch_size=0"),
        ({"batch_size": 65537}, "65536"),
        ({"sampling": "random"}, "'class_balanced'"),
        ({"on_error": "ignore"}, "'replace'"),
        ({"transport": "tcp"}, "'inline'"),
        ({"pipeline": "image"}, "batchd.Image"),
        ({"max_error_fraction": 0.0}, "on_error='raise'"),
        ({"seed": -1}, "seed=-1"),
        ({"prefetch": 0}, "prefetch=0"),
        ({"dataset": ""}, "dataset"),
        ({"device": "tpu"}, "tpu"),
        ({"rank": 4, "world_size": 4}, "rank=4"),
    ],
)
def test_loader_arguments_are_checked_before_connecting(kwargs: dict[str, Any], words: str) -> None:
    """Bad Loader arguments fail with InvalidArgument before any server is contacted."""
    options: dict[str, Any] = {"dataset": "d", "batch_size": 4, **kwargs}
    with pytest.raises(InvalidArgument, match=words):
        batchd.Loader("unix:///nonexistent/batchd.sock", **options)


def test_cuda_device_without_cuda_is_a_clear_error() -> None:
    """Asking for a CUDA device that is not there says so and suggests device='cpu'."""
    with pytest.raises(InvalidArgument, match="cuda:99") as caught:
        batchd.Loader(
            "unix:///nonexistent/batchd.sock", dataset="d", batch_size=4, device="cuda:99"
        )
    if torch.cuda.is_available():
        assert "CUDA devices 0.." in str(caught.value)
    else:
        assert "CUDA is not available" in str(caught.value) and "device='cpu'" in str(caught.value)
