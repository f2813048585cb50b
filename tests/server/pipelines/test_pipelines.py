"""Pipelines decode real files into rows exactly as their documented recipes say.

The image tests decode each file independently (``pipeline_reference.py``: simplejpeg or
Pillow directly) and follow the recipe in ``batchd_server/pipelines/image.py``'s docstring
step by step; the deterministic path must match byte for byte.
"""

from __future__ import annotations

import io
from pathlib import Path

import numpy as np
import pytest
import simplejpeg
from PIL import Image

from batchd_server.errors import InvalidArgument
from batchd_server.pipelines import BadSample, ImagePipeline, sample_rng
from batchd_server.storage.files import SampleFiles

from pipeline_reference import (
    bad_kind,
    decode_row,
    encode,
    info,
    photo,
    reference_centre,
    reference_random,
    resize_centre,
)

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
    expected = resize_centre(simplejpeg.decode_jpeg(data), 96, 96)
    assert np.abs(got - expected).mean() < 3.0


def test_the_resize_is_within_one_level_of_pillows_bilinear() -> None:
    """Step 4's torch kernel against Pillow's BILINEAR on the same decoded image."""
    pixels = photo(500, 375)
    got = decode_row(ImagePipeline(size=224), encode(pixels, "PNG")).astype(int)
    pillow = Image.fromarray(pixels).resize((298, 224), Image.Resampling.BILINEAR)
    expected = np.asarray(pillow)[:, 37:261].transpose(2, 0, 1).astype(int)
    assert np.abs(got - expected).max() <= 1


@pytest.mark.parametrize(("width", "height"), [(900, 40), (40, 900), (50_000, 1), (3, 7_000)])
def test_very_long_images_resize_only_their_kept_span(width: int, height: int) -> None:
    """Past 4:1 after the resize, only the kept span is resized: exact to the recipe, close to
    the full resize, and never the full resized image (1 x 50,000 would be 7.5 GB at 224)."""
    pixels = photo(width, height)
    data = encode(pixels, "PNG")
    size = 224 if min(width, height) == 1 else 32
    got = decode_row(ImagePipeline(size=size), data)
    np.testing.assert_array_equal(got, reference_centre(data, size, size))
    if min(width, height) >= 40:  # small enough to resize in full for comparison
        expected = resize_centre(pixels, size, size, long_span=False).astype(int)
        assert np.abs(got.astype(int) - expected).mean() < 2.0


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
    expected = resize_centre(np.asarray(Image.open(io.BytesIO(data)).convert("RGB")), 40, 40)
    got = decode_row(ImagePipeline(size=40, decoder=decoder), data)
    np.testing.assert_array_equal(got, expected)


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
