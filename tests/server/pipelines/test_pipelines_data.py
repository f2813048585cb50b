"""Array and token pipelines decode real bytes as documented; custom decoders load from
real entry points. (Images: ``test_pipelines.py``.)"""

from __future__ import annotations

import io
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from batchd_server.errors import FailedPrecondition, InvalidArgument
from batchd_server.pipelines import (
    ArrayPipeline,
    BadSample,
    ImagePipeline,
    TokensPipeline,
    build_pipeline,
)
from batchd_server.storage.files import SampleFiles

from pipeline_reference import bad_kind, decode_row, info
from serving import install_decoders

# --- arrays ----------------------------------------------------------------------------------


def npy(array: np.ndarray) -> bytes:
    out = io.BytesIO()
    np.save(out, array)
    return out.getvalue()


def test_npy_files_decode_whole_and_from_byte_ranges(tmp_path: Path) -> None:
    """A .npy file, and .npy blobs inside a shard file read through byte ranges."""
    rng = np.random.default_rng(0)
    arrays = [rng.standard_normal((3, 4)).astype(np.float32) for _ in range(5)]
    (tmp_path / "one.npy").write_bytes(npy(arrays[0]))
    blobs = [npy(a) for a in arrays]
    offsets = np.cumsum([0, *map(len, blobs)])
    (tmp_path / "shard.bin").write_bytes(b"".join(blobs))
    pipeline = ArrayPipeline((3, 4), "float32")
    assert pipeline.fields()[0].dtype.str == "<f4"
    with SampleFiles(str(tmp_path)) as files:
        row = decode_row(pipeline, bytes(files.read("one.npy")))
        np.testing.assert_array_equal(row["array"], arrays[0])
        for i, expected in enumerate(arrays):
            data = files.read("shard.bin", int(offsets[i]), len(blobs[i]))
            np.testing.assert_array_equal(decode_row(pipeline, bytes(data))["array"], expected)


def test_big_endian_and_fortran_npy_are_converted() -> None:
    """Byte order and memory order are converted; the values are the same."""
    values = np.arange(24, dtype=np.int32).reshape(2, 3, 4)
    pipeline = ArrayPipeline((2, 3, 4), "<i4")
    for stored in (values.astype(">i4"), np.asfortranarray(values), values.astype(">i4").T.T):
        np.testing.assert_array_equal(decode_row(pipeline, npy(stored))["array"], values)
    fortran_big = np.asfortranarray(values.astype(">i4"))
    np.testing.assert_array_equal(decode_row(pipeline, npy(fortran_big))["array"], values)


def test_npy_of_another_shape_or_dtype_is_a_shape_error() -> None:
    """The message says what was expected and what the file holds."""
    pipeline = ArrayPipeline((2, 3), "float32")
    with pytest.raises(BadSample, match=r"holds <f8 \(2, 3\), expected <f4 \(2, 3\)") as caught:
        decode_row(pipeline, npy(np.zeros((2, 3))))
    assert caught.value.kind == "shape"
    assert bad_kind(pipeline, npy(np.zeros((3, 2), np.float32))) == "shape"
    assert bad_kind(pipeline, npy(np.zeros(6, np.float32))) == "shape"


def test_object_npy_is_refused_without_unpickling() -> None:
    """An object array is a shape error; its pickle is never loaded."""
    out = io.BytesIO()
    np.save(out, np.array([object(), None], dtype=object).reshape(1, 2), allow_pickle=True)
    assert bad_kind(ArrayPipeline((1, 2), "float64"), out.getvalue()) == "shape"


def test_garbage_and_truncated_npy_are_corrupt() -> None:
    """Not a .npy, a damaged header, or missing data bytes."""
    good = npy(np.zeros((2, 3), np.float32))
    pipeline = ArrayPipeline((2, 3), "float32")
    for data in (
        b"",
        b"not numpy at all",
        good[:9],
        good[:20],
        good[:-1],
        good + b"\x00",
        good[:10] + b"{'descr': oops" + good[24:],
        b"\x93NUMPY\x09\x00" + good[8:],
    ):
        assert bad_kind(pipeline, data) == "corrupt"


def test_raw_records_need_exactly_their_size() -> None:
    """raw=True: prod(shape) * itemsize bytes, little-endian; any other length is 'shape'."""
    values = np.arange(6, dtype="<u2").reshape(2, 3)
    pipeline = ArrayPipeline((2, 3), ">u2", raw=True)
    assert pipeline.record_bytes == 12
    assert pipeline.fields()[0].dtype.str == "<u2"
    np.testing.assert_array_equal(decode_row(pipeline, values.tobytes())["array"], values)
    assert bad_kind(pipeline, values.tobytes()[:-2]) == "shape"
    assert bad_kind(pipeline, values.tobytes() + b"\x00\x00") == "shape"
    assert ArrayPipeline((2, 3), "float32").record_bytes is None


def test_gather_into_equals_decoding_each_record(tmp_path: Path) -> None:
    """The vectorised gather of raw records at unaligned offsets equals per-sample decode."""
    rng = np.random.default_rng(0)
    records = rng.standard_normal((300, 32)).astype(np.float32)
    header = b"7 bytes"
    (tmp_path / "records.bin").write_bytes(header + records.tobytes())
    pipeline = ArrayPipeline((32,), "float32", raw=True)
    size = pipeline.record_bytes
    assert size == 128
    picks = rng.permutation(300)[:256]
    offsets = (len(header) + picks * size).astype(np.int64)
    with SampleFiles(str(tmp_path)) as files:
        mapped = files.map_whole("records.bin")
        block = np.zeros((300, 32), np.float32)
        pipeline.gather_into(mapped, offsets, block[:256])
        for row, offset in zip(block[:256], offsets, strict=True):
            data = files.read("records.bin", int(offset), size)
            np.testing.assert_array_equal(decode_row(pipeline, bytes(data))["array"], row)
    np.testing.assert_array_equal(block[:256], records[picks])
    assert not block[256:].any()


def test_gather_into_refuses_records_outside_the_file() -> None:
    """An offset past the end (or negative) is BadSample('unreadable'); nothing is read."""
    pipeline = ArrayPipeline((4,), "uint8", raw=True)
    file = np.arange(10, dtype=np.uint8)
    out = np.zeros((2, 4), np.uint8)
    pipeline.gather_into(file, np.array([6, 0], np.int64), out)
    np.testing.assert_array_equal(out, [[6, 7, 8, 9], [0, 1, 2, 3]])
    for bad in ([0, 7], [-1, 0]):
        with pytest.raises(BadSample) as caught:
            pipeline.gather_into(file, np.array(bad, np.int64), out)
        assert caught.value.kind == "unreadable"
    pipeline.gather_into(file, np.zeros(0, np.int64), out[:0])
    with pytest.raises(FailedPrecondition):
        ArrayPipeline((4,), "uint8").gather_into(file, np.array([0], np.int64), out[:1])


def test_array_options_are_validated() -> None:
    """Shapes of positive integers and plain numeric dtypes only."""
    for shape, dtype in (((0, 3), "f4"), (("a",), "f4"), ((3,), "object"), ((3,), "U4"),
                         ((3,), "no-such-type"), ((3,), "i4,i4")):  # fmt: skip
        with pytest.raises(InvalidArgument):
            ArrayPipeline(shape, dtype)


# --- tokens ----------------------------------------------------------------------------------


def token_block(pipeline: TokensPipeline, batch: int) -> dict[str, np.ndarray]:
    return {f.name: np.full((batch, *f.shape), 99, f.dtype) for f in pipeline.fields()}


@pytest.mark.parametrize(("dtype", "numpy_dtype"), [("int32", "<i4"), ("uint16", "<u2")])
def test_token_batches_are_padded_to_the_longest_with_masks_and_lengths(
    dtype: str, numpy_dtype: str
) -> None:
    """Truncation to max_len, padding with pad_id, mask and length; fields rewritten in place."""
    pipeline = TokensPipeline(max_len=6, dtype=dtype, pad_id=5)
    sequences = [[1, 2, 3], [], [7, 8, 9, 10, 11, 12, 13, 14], [4]]
    block = token_block(pipeline, batch=8)
    for i, tokens in enumerate(sequences):
        row = {name: field[i, ...] for name, field in block.items()}
        pipeline.decode_into(memoryview(np.array(tokens, numpy_dtype).tobytes()), info(), row)
    shapes = pipeline.finish(block, rows=4)
    assert shapes == {"input_ids": (4, 6), "attention_mask": (4, 6), "length": (4,)}
    ids = block["input_ids"].reshape(-1)[:24].reshape(4, 6)
    mask = block["attention_mask"].reshape(-1)[:24].reshape(4, 6)
    assert ids.dtype.str == numpy_dtype
    np.testing.assert_array_equal(
        ids, [[1, 2, 3, 5, 5, 5], [5] * 6, [7, 8, 9, 10, 11, 12], [4, 5, 5, 5, 5, 5]]
    )
    np.testing.assert_array_equal(mask, [[1, 1, 1, 0, 0, 0], [0] * 6, [1] * 6, [1, 0, 0, 0, 0, 0]])
    np.testing.assert_array_equal(block["length"][:4], [3, 0, 6, 1])


def test_token_batches_shrink_to_their_longest_row() -> None:
    """A batch of short rows becomes C-contiguous (rows, longest) at each field's start."""
    pipeline = TokensPipeline(max_len=100, dtype="int32")
    block = token_block(pipeline, batch=4)
    rng = np.random.default_rng(0)
    sequences = [rng.integers(1, 1000, n).astype("<i4") for n in (3, 7, 1)]
    for i, tokens in enumerate(sequences):
        row = {name: field[i, ...] for name, field in block.items()}
        pipeline.decode_into(memoryview(tokens.tobytes()), info(), row)
    assert pipeline.finish(block, rows=3)["input_ids"] == (3, 7)
    ids = block["input_ids"].reshape(-1)[:21].reshape(3, 7)
    mask = block["attention_mask"].reshape(-1)[:21].reshape(3, 7)
    for i, tokens in enumerate(sequences):
        np.testing.assert_array_equal(ids[i, : len(tokens)], tokens)
        assert not ids[i, len(tokens) :].any()
        assert mask[i].sum() == len(tokens) and mask[i, : len(tokens)].all()


def test_an_empty_token_batch_finishes_empty() -> None:
    """rows=0 gives zero-sized shapes and touches nothing."""
    pipeline = TokensPipeline(max_len=4)
    assert pipeline.finish(token_block(pipeline, 2), 0) == {
        "input_ids": (0, 0),
        "attention_mask": (0, 0),
        "length": (0,),
    }


def test_token_files_of_a_partial_token_are_shape_errors() -> None:
    """A byte count that is not a multiple of the token size is BadSample('shape')."""
    assert bad_kind(TokensPipeline(max_len=4), b"\x01\x00\x00\x00\x02") == "shape"
    assert bad_kind(TokensPipeline(max_len=4, dtype="uint16"), b"\x01\x00\x02") == "shape"


def test_token_options_are_validated() -> None:
    """max_len, dtype and a pad_id that fits the dtype."""
    for kwargs in (
        {"max_len": 0},
        {"max_len": 4, "dtype": "int64"},
        {"max_len": 4, "dtype": "uint16", "pad_id": 70000},
        {"max_len": 4, "dtype": "uint16", "pad_id": -1},
    ):
        with pytest.raises(InvalidArgument):
            TokensPipeline(**kwargs)
    assert TokensPipeline(max_len=4, dtype="<u2").fields()[0].dtype.str == "<u2"


# --- registry --------------------------------------------------------------------------------

DECODERS_MODULE = """
import numpy as np
from batchd_server.pipelines.base import BadSample, FieldSpec, Pipeline


class Reverse(Pipeline):
    def __init__(self, n):
        self.n = n

    def fields(self):
        return [FieldSpec("reversed", np.dtype(np.uint8), (self.n,))]

    def decode_into(self, data, sample, row):
        if len(data) != self.n:
            raise BadSample("shape", f"{len(data)} bytes, want {self.n}")
        row["reversed"][...] = np.frombuffer(data, np.uint8)[::-1]


class Crashy(Reverse):
    def decode_into(self, data, sample, row):
        raise ZeroDivisionError("boom")


def raising_factory(**options):
    raise RuntimeError("cannot build")


def not_a_pipeline(**options):
    return "just a string"


def claims_label(**options):
    class Bad(Reverse):
        def fields(self):
            return [FieldSpec("label", np.dtype(np.int64), ())]
    return Bad(1)
"""

ENTRY_POINTS = {
    "reverse": "Reverse",
    "crashy": "Crashy",
    "raising": "raising_factory",
    "notpipe": "not_a_pipeline",
    "claims_label": "claims_label",
    "unimportable": "batchd_no_such_module_xyz:Thing",
}


@pytest.fixture
def decoders_installed(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """A real distribution on sys.path registering decoders in group batchd.decoders."""
    module = install_decoders(tmp_path / "site", DECODERS_MODULE, ENTRY_POINTS)
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    yield
    monkeypatch.delitem(__import__("sys").modules, module, raising=False)


def test_builtin_kinds_build_from_options() -> None:
    """image, array and tokens take their constructor's keyword arguments."""
    assert isinstance(build_pipeline("image", {"size": 8, "random_crop": True}), ImagePipeline)
    array = build_pipeline("array", {"shape": [2, 2], "dtype": "float32", "raw": True})
    assert isinstance(array, ArrayPipeline) and array.shape == (2, 2)
    assert isinstance(build_pipeline("tokens", {"max_len": 8}), TokensPipeline)


def test_unknown_kinds_and_options_are_invalid_arguments() -> None:
    """The message lists the kinds, or the options the kind takes."""
    with pytest.raises(
        InvalidArgument, match="array, audio, chat, custom, fields, image, text, tokens, video"
    ):
        build_pipeline("hologram", {})
    with pytest.raises(InvalidArgument, match=r"unknown options \['colour'\]"):
        build_pipeline("image", {"size": 8, "colour": "red"})
    with pytest.raises(InvalidArgument, match=r"missing options \['size'\]"):
        build_pipeline("image", {})
    with pytest.raises(InvalidArgument):
        build_pipeline("array", {"shape": 5, "dtype": "f4"})


def test_a_custom_decoder_registered_by_entry_point_builds_and_decodes(
    decoders_installed: None,
) -> None:
    """build_pipeline('custom') finds the entry point, passes options, and decodes."""
    from batchd_server.pipelines import registered_decoders

    assert {"reverse", "crashy", "raising", "notpipe"} <= set(registered_decoders())
    pipeline = build_pipeline("custom", {"name": "reverse", "options": {"n": 3}})
    assert [f.name for f in pipeline.fields()] == ["reversed"]
    np.testing.assert_array_equal(decode_row(pipeline, b"abc")["reversed"], list(b"cba"))
    assert bad_kind(pipeline, b"ab") == "shape"
    assert pipeline.finish({"reversed": np.zeros((2, 3), np.uint8)}, 2) == {"reversed": (2, 3)}


def test_a_custom_decoder_that_crashes_costs_a_sample_not_a_worker(
    decoders_installed: None,
) -> None:
    """Any exception from a custom decode_into becomes BadSample('decoder') naming it."""
    pipeline = build_pipeline("custom", {"name": "crashy", "options": {"n": 3}})
    with pytest.raises(BadSample, match=r"crashy.*ZeroDivisionError: boom") as caught:
        decode_row(pipeline, b"abc")
    assert caught.value.kind == "decoder"


def test_broken_custom_decoders_are_invalid_arguments(decoders_installed: None) -> None:
    """Unknown name (lists the registered), import error, raising or non-Pipeline factory."""
    with pytest.raises(InvalidArgument, match=r"registered: .*crashy.*reverse"):
        build_pipeline("custom", {"name": "nope"})
    for name, match in (
        ("unimportable", "cannot be imported"),
        ("raising", "cannot build"),
        ("notpipe", "returned str"),
        ("claims_label", "label"),
    ):
        with pytest.raises(InvalidArgument, match=match):
            build_pipeline("custom", {"name": name})
    with pytest.raises(InvalidArgument, match="unexpected keyword"):
        build_pipeline("custom", {"name": "reverse", "options": {"n": 1, "m": 2}})
    with pytest.raises(InvalidArgument, match="needs options"):
        build_pipeline("custom", {"options": {}})
