"""Pipelines decode real files into rows exactly as their documented recipes say.

The image tests decode each file independently (simplejpeg or Pillow directly) and follow the
recipe in ``batchd_server/pipelines/image.py``'s docstring step by step; the deterministic
path must match byte for byte.
"""

from __future__ import annotations

import io
import math
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import simplejpeg
from PIL import Image

from batchd_server.errors import FailedPrecondition, InvalidArgument
from batchd_server.pipelines import (
    ArrayPipeline,
    BadSample,
    ImagePipeline,
    Pipeline,
    SampleFiles,
    SampleInfo,
    TokensPipeline,
    build_pipeline,
    sample_rng,
)

BILINEAR = Image.Resampling.BILINEAR


# --- helpers ---------------------------------------------------------------------------------


def photo(width: int, height: int, seed: int = 0) -> np.ndarray:
    """A photo-like RGB array: gradients, a hard-edged shape and noise."""
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:height, 0:width].astype(np.float32)
    base = np.stack([255 * x / width, 255 * y / height, 128 + 100 * np.sin(x / 7 + y / 11)], -1)
    base[height // 4 : height // 2, width // 3 : width // 2] = (250, 20, 60)
    noisy = base + rng.normal(0, 10, base.shape)
    return noisy.clip(0, 255).astype(np.uint8)


def encode(pixels: np.ndarray, fmt: str, mode: str = "RGB", **save: Any) -> bytes:
    out = io.BytesIO()
    Image.fromarray(pixels).convert(mode).save(out, format=fmt, **save)
    return out.getvalue()


def info(sample_id: int = 7, epoch: int = 0, seed: int = 1, path: str = "x") -> SampleInfo:
    return SampleInfo(sample_id=sample_id, label=0, path=path, length=-1, seed=seed, epoch=epoch)


def decode_row(pipeline: Pipeline, data: bytes, sample: SampleInfo | None = None) -> Any:
    """One sample through ``pipeline``; the row dict, or the single field's array."""
    row = {f.name: np.zeros(f.shape, f.dtype) for f in pipeline.fields()}
    pipeline.decode_into(memoryview(data), sample or info(), row)
    return row.get("image", row)


def bad_kind(pipeline: Pipeline, data: bytes) -> str:
    with pytest.raises(BadSample) as caught:
        decode_row(pipeline, data)
    return caught.value.kind


def reference_shift(short: int, target: int) -> int:
    """Step 3 of the recipe: the largest k <= 3 with short >= target * 2**k (0 below 8)."""
    if target < 8:
        return 0
    return max(k for k in range(4) if short >= target * 2**k)


def reference_decode(data: bytes, shift: Any) -> Image.Image:
    """Steps 1-3 without the pipeline: simplejpeg for JPEG, Pillow for the rest."""
    image = Image.open(io.BytesIO(data))
    width, height = image.size
    if image.format != "JPEG":
        return image.convert("RGB")
    k = shift(width, height)
    if k == 0:
        return Image.fromarray(simplejpeg.decode_jpeg(data))
    scaled_w, scaled_h = math.ceil(width / 2**k), math.ceil(height / 2**k)
    pixels = simplejpeg.decode_jpeg(data, min_width=scaled_w, min_height=scaled_h)
    assert pixels.shape == (scaled_h, scaled_w, 3)
    return Image.fromarray(pixels)


def reference_centre(data: bytes, size: int, resize: int) -> np.ndarray:
    """Steps 1-4 and 7: resize the shorter side, centre crop, CHW."""
    image = reference_decode(data, lambda w, h: reference_shift(min(w, h), resize))
    width, height = image.size
    short, long = min(width, height), max(width, height)
    long_resized = round(long * resize / short)
    new_w, new_h = (resize, long_resized) if width <= height else (long_resized, resize)
    ox, oy = (new_w - size) // 2, (new_h - size) // 2
    box = (ox * width / new_w, oy * height / new_h, (ox + size) * width / new_w,
           (oy + size) * height / new_h)  # fmt: skip
    out = image.resize((size, size), BILINEAR, box=box)
    return np.asarray(out).transpose(2, 0, 1)


def reference_random(data: bytes, size: int, sample: SampleInfo, flip: bool) -> np.ndarray:
    """Steps 1-3 and 5-7: torchvision's RandomResizedCrop drawn from the sample's rng."""
    original = Image.open(io.BytesIO(data))
    width, height = original.size
    rng = sample_rng(sample.seed, sample.epoch, sample.sample_id)
    for _ in range(10):
        area = width * height * rng.uniform(0.08, 1.0)
        aspect = math.exp(rng.uniform(math.log(3 / 4), math.log(4 / 3)))
        w, h = round(math.sqrt(area * aspect)), round(math.sqrt(area / aspect))
        if 0 < w <= width and 0 < h <= height:
            i, j = int(rng.integers(0, height - h + 1)), int(rng.integers(0, width - w + 1))
            break
    else:
        raise AssertionError("these tests use images where a crop is always found")
    k = reference_shift(min(w, h), size) if original.format == "JPEG" else 0
    image = reference_decode(data, lambda _w, _h: k)
    s = 2**k
    out = np.asarray(image.resize((size, size), BILINEAR, box=(j / s, i / s, (j + w) / s,
                                                                (i + h) / s)))  # fmt: skip
    if flip and rng.random() < 0.5:
        out = out[:, ::-1]
    return out.transpose(2, 0, 1)


# --- images: exact content -------------------------------------------------------------------

FORMATS = {
    "jpeg": ("JPEG", {"quality": 90}),
    "png": ("PNG", {}),
    "webp-lossy": ("WEBP", {"quality": 80}),
    "webp-lossless": ("WEBP", {"lossless": True}),
}


@pytest.mark.parametrize("fmt", sorted(FORMATS))
@pytest.mark.parametrize("decoder", ["auto", "pillow"])
@pytest.mark.parametrize(
    ("width", "height", "size", "resize"),
    [
        (97, 64, 48, 0),  # landscape, odd side, no DCT scaling
        (64, 131, 32, 40),  # portrait, resize > size
        (80, 80, 80, 0),  # square, crop is the whole image
        (640, 480, 100, 112),  # JPEG at 1/4 scale (480 >= 448)
        (401, 1203, 24, 24),  # JPEG at 1/8 scale
    ],
)
def test_the_centre_crop_equals_an_independent_decode_exactly(
    tmp_path: Path, fmt: str, decoder: str, width: int, height: int, size: int, resize: int
) -> None:
    """Deterministic path: byte-equal to the documented recipe, through SampleFiles."""
    name, save = FORMATS[fmt]
    data = encode(photo(width, height), name, **save)
    (tmp_path / "img.bin").write_bytes(data)
    pipeline = ImagePipeline(size=size, resize=resize, decoder=decoder)
    with SampleFiles(str(tmp_path)) as files:
        got = decode_row(pipeline, bytes(files.read("img.bin")))
    assert got.shape == (3, size, size) and got.dtype == np.uint8
    np.testing.assert_array_equal(got, reference_centre(data, size, resize or size))


def test_dct_scaled_decoding_stays_close_to_a_full_decode() -> None:
    """The 1/2**k shortcut changes pixels only slightly against full decode + resize."""
    data = encode(photo(960, 720), "JPEG", quality=95)
    got = decode_row(ImagePipeline(size=96), data).astype(np.float64)
    full = Image.fromarray(simplejpeg.decode_jpeg(data))
    box = ((960 - 720) / 2, 0.0, (960 + 720) / 2, 720.0)
    expected = np.asarray(full.resize((96, 96), BILINEAR, box=box)).transpose(2, 0, 1)
    assert np.abs(got - expected).mean() < 3.0


@pytest.mark.parametrize("mode", ["L", "P", "RGBA", "LA", "1"])
def test_non_rgb_pngs_are_converted_to_rgb(mode: str) -> None:
    """Grayscale, palette, alpha and bilevel images come out as Pillow's RGB conversion."""
    data = encode(photo(50, 40), "PNG", mode=mode)
    np.testing.assert_array_equal(
        decode_row(ImagePipeline(size=32), data), reference_centre(data, 32, 32)
    )


@pytest.mark.parametrize("decoder", ["auto", "pillow"])
@pytest.mark.parametrize("mode", ["L", "CMYK"])
def test_grayscale_and_cmyk_jpegs_decode_like_pillow(decoder: str, mode: str) -> None:
    """JPEGs simplejpeg cannot or should not convert give Pillow's RGB with either decoder."""
    data = encode(photo(60, 50), "JPEG", mode=mode)
    image = Image.open(io.BytesIO(data)).convert("RGB")
    expected = np.asarray(image.resize((40, 40), BILINEAR, box=(5.0, 0.0, 55.0, 50.0)))
    got = decode_row(ImagePipeline(size=40, decoder=decoder), data)
    np.testing.assert_array_equal(got, expected.transpose(2, 0, 1))


def test_the_format_comes_from_the_bytes_not_the_name(tmp_path: Path) -> None:
    """A PNG named .jpg decodes as a PNG."""
    data = encode(photo(40, 40), "PNG")
    (tmp_path / "really-a-png.jpg").write_bytes(data)
    with SampleFiles(str(tmp_path)) as files:
        got = decode_row(ImagePipeline(size=40), bytes(files.read("really-a-png.jpg")))
    np.testing.assert_array_equal(got, photo(40, 40).transpose(2, 0, 1))


# --- images: random crop and flip ------------------------------------------------------------


@pytest.mark.parametrize("fmt", ["jpeg", "png"])
@pytest.mark.parametrize("flip", [False, True])
def test_the_random_crop_follows_the_recipe_and_the_sample_rng(fmt: str, flip: bool) -> None:
    """Random path: equal to the reference for several samples and epochs."""
    name, save = FORMATS[fmt]
    data = encode(photo(900, 700), name, **save)
    pipeline = ImagePipeline(size=56, random_crop=True, flip=flip)
    for sample_id in range(6):
        for epoch in range(2):
            sample = info(sample_id=sample_id, epoch=epoch)
            np.testing.assert_array_equal(
                decode_row(pipeline, data, sample), reference_random(data, 56, sample, flip)
            )


def test_random_crops_repeat_per_sample_and_epoch_and_change_across_epochs() -> None:
    """Same (seed, epoch, id) → the same array, whoever decodes it; a new epoch → another."""
    data = encode(photo(200, 150), "JPEG")
    first, second = (ImagePipeline(size=32, random_crop=True, flip=True) for _ in range(2))
    for sample_id in range(5):
        a = decode_row(first, data, info(sample_id=sample_id, epoch=3))
        b = decode_row(second, data, info(sample_id=sample_id, epoch=3))
        np.testing.assert_array_equal(a, b)
        c = decode_row(first, data, info(sample_id=sample_id, epoch=4))
        assert not np.array_equal(a, c)
    other_seed = decode_row(first, data, info(sample_id=0, epoch=3, seed=2))
    assert not np.array_equal(decode_row(first, data, info(sample_id=0, epoch=3)), other_seed)


def test_flip_without_random_crop_mirrors_about_half_the_samples() -> None:
    """flip=True on the centre crop: each sample is the crop or its mirror, both happen."""
    data = encode(photo(64, 48), "PNG")
    crop = reference_centre(data, 40, 40)
    pipeline = ImagePipeline(size=40, flip=True)
    flipped = []
    for sample_id in range(40):
        got = decode_row(pipeline, data, info(sample_id=sample_id))
        is_flipped = np.array_equal(got, crop[:, :, ::-1])
        assert is_flipped or np.array_equal(got, crop)
        expected = sample_rng(1, 0, sample_id).random() < 0.5
        assert is_flipped == expected
        flipped.append(is_flipped)
    assert 5 < sum(flipped) < 35


# --- images: bad data ------------------------------------------------------------------------


@pytest.mark.parametrize("decoder", ["auto", "pillow"])
def test_bad_images_are_corrupt_samples(decoder: str) -> None:
    """Truncated, garbled, empty or not-an-image bytes are BadSample('corrupt')."""
    jpeg = encode(photo(120, 90), "JPEG")
    png = encode(photo(120, 90), "PNG")
    webp = encode(photo(120, 90), "WEBP")
    pipeline = ImagePipeline(size=32, decoder=decoder)
    for data in (
        jpeg[: len(jpeg) // 2],
        jpeg[:200],
        b"\xff\xd8\xff" + bytes(500),
        png[: len(png) // 2],
        png[:40],
        webp[: len(webp) // 2],
        b"RIFF\x00\x00\x00\x00WEBPgarbage",
        b"hello, I am a text file\n",
        np.random.default_rng(0).bytes(4096),
        b"",
        encode(photo(20, 20), "GIF"),
    ):
        assert bad_kind(pipeline, data) == "corrupt"


@pytest.mark.parametrize("decoder", ["auto", "pillow"])
def test_decompression_bombs_are_refused_before_decoding(
    decoder: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Images over twice Pillow's MAX_IMAGE_PIXELS are corrupt, simplejpeg or not."""
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", 1000)
    pipeline = ImagePipeline(size=8, decoder=decoder)
    assert bad_kind(pipeline, encode(photo(50, 41), "JPEG")) == "corrupt"
    assert bad_kind(pipeline, encode(photo(50, 41), "PNG")) == "corrupt"
    assert decode_row(pipeline, encode(photo(30, 30), "JPEG")).shape == (3, 8, 8)


def test_a_corrupt_image_message_names_the_sample() -> None:
    """The message carries the path for the error log."""
    with pytest.raises(BadSample, match=r"cats/001\.jpg"):
        decode_row(ImagePipeline(size=8), b"nope", info(path="cats/001.jpg"))


def test_image_options_are_validated() -> None:
    """Out-of-range options are InvalidArgument naming the value."""
    for kwargs in (
        {"size": 0},
        {"size": 32, "resize": 16},
        {"size": 32, "decoder": "magic"},
        {"size": 32, "scale": (0.5, 0.1)},
        {"size": 32, "scale": (0.5, 2.0)},
        {"size": 32, "ratio": (0.0, 1.0)},
        {"size": 32, "ratio": "wide"},
    ):
        with pytest.raises(InvalidArgument):
            ImagePipeline(**kwargs)


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

ENTRY_POINTS = """
[batchd.decoders]
reverse = {module}:Reverse
crashy = {module}:Crashy
raising = {module}:raising_factory
notpipe = {module}:not_a_pipeline
claims_label = {module}:claims_label
unimportable = batchd_no_such_module_xyz:Thing
"""


@pytest.fixture
def decoders_installed(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """A real distribution on sys.path registering decoders in group batchd.decoders."""
    module = f"batchd_test_decoders_{tmp_path.name.replace('-', '_')}"
    site = tmp_path / "site"
    dist_info = site / "batchd_test_decoders-0.dist-info"
    dist_info.mkdir(parents=True)
    (dist_info / "METADATA").write_text(
        "Metadata-Version: 2.1\nName: batchd-test-decoders\nVersion: 0\n"
    )
    (dist_info / "entry_points.txt").write_text(ENTRY_POINTS.format(module=module))
    (site / f"{module}.py").write_text(DECODERS_MODULE)
    monkeypatch.syspath_prepend(str(site))
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
    with pytest.raises(InvalidArgument, match="array, custom, image, tokens"):
        build_pipeline("video", {})
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
