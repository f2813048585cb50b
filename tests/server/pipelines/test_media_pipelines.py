"""The video and audio pipelines on bytes encoded in the test with PyAV: exact frames and
samples against a reference decode, clip choices, and hostile media as named bad samples."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from media_data import empty_wav, encode_tone, encode_video, reference_audio, reference_clip

from batchd_server.errors import InvalidArgument
from batchd_server.pipelines import BadSample, SampleInfo, build_pipeline
from batchd_server.pipelines.video import clip_indices


def _info(sample_id: int = 5, seed: int = 1, epoch: int = 0) -> SampleInfo:
    return SampleInfo(sample_id=sample_id, label=0, path="s.mp4", length=-1, seed=seed, epoch=epoch)


def _decode(kind: str, data: bytes, info: SampleInfo | None = None, **options: Any) -> dict:
    pipeline = build_pipeline(kind, options)
    row = {f.name: np.zeros(f.shape, f.dtype) for f in pipeline.fields()}
    pipeline.decode_into(memoryview(data), info or _info(), row)
    return row


@pytest.mark.parametrize("codec", ["mpeg4", "libx264"])
@pytest.mark.parametrize("clip", ["random", "uniform", "center"])
def test_video_clips_are_the_reference_decode_of_their_frames(codec: str, clip: str) -> None:
    """Every served frame equals PyAV's decode-from-start of the same source frame."""
    data = encode_video(60, 96, 64, codec=codec, gop=12)
    row = _decode("video", data, frames=5, size=32, clip=clip, clips_per_video=3, fps=10.0)
    assert row["video"].shape == (3, 5, 3, 32, 32) and row["video"].dtype == np.uint8
    for k in range(3):
        indices = row["frame_index"][k].tolist()
        assert indices == sorted(indices) and len(set(indices)) == 5  # 25 fps sampled at 10
        assert row["clip_start"][k] == pytest.approx(indices[0] / 25)
        assert np.array_equal(row["video"][k], reference_clip(data, indices, 32)), (k, indices)


def test_one_clip_leaves_out_the_clip_axis_and_a_short_video_repeats_its_last_frame() -> None:
    """clips_per_video=1: [T, 3, H, W]; a clip longer than the video ends on its last frame."""
    data = encode_video(6, 64, 96)
    row = _decode("video", data, frames=8, size=16, clip="center")
    assert row["video"].shape == (8, 3, 16, 16) and row["clip_start"].shape == ()
    assert row["frame_index"].tolist() == [0, 1, 2, 3, 4, 5, 5, 5]
    assert np.array_equal(row["video"], reference_clip(data, row["frame_index"].tolist(), 16))


def test_clip_starts_are_a_function_of_seed_epoch_and_sample() -> None:
    """The same (seed, epoch, sample) always draws the same clip; others draw others."""
    data = encode_video(120)

    def start(**kw: int) -> float:
        return float(_decode("video", data, _info(**kw), frames=4, size=16)["clip_start"])

    assert start(sample_id=1) == start(sample_id=1)
    drawn = {start(sample_id=s, seed=e, epoch=e) for s in range(4) for e in range(3)}
    assert len(drawn) > 4
    rng = np.random.default_rng(0)
    assert clip_indices(100, 25.0, 4, 0.0, "uniform", 3, rng).tolist() == [
        [0, 1, 2, 3],
        [48, 49, 50, 51],
        [96, 97, 98, 99],
    ]


@pytest.mark.parametrize(
    ("fmt", "codec"),
    [("wav", "pcm_s16le"), ("flac", "flac"), ("mp3", "libmp3lame"), ("adts", "aac")],
)
def test_audio_is_the_reference_resample_of_its_crop(fmt: str, codec: str) -> None:
    """Random crops, mono and stereo, float32 and int16: exactly the reference's samples."""
    data = encode_tone(1.5, fmt=fmt, codec=codec)
    row = _decode("audio", data, sample_rate=16000, seconds=0.5, crop="random")
    assert row["audio"].shape == (1, 8000) and row["audio_length"] == 8000
    ref = reference_audio(data, 16000, 0, 10**6)
    starts = [
        i
        for i in range(ref.shape[1] - 7999)
        if np.array_equal(ref[:, i : i + 8], row["audio"][:, :8])
    ]
    assert any(np.array_equal(ref[:, s : s + 8000], row["audio"]) for s in starts)
    whole = _decode("audio", data, mono=False, dtype="int16", max_seconds=4.0)
    n = int(whole["audio_length"])
    ref16 = reference_audio(data, 16000, 0, n, mono=False, fmt="s16")
    assert whole["audio"].dtype == np.int16 and n == ref16.shape[1]
    assert np.array_equal(whole["audio"][:, :n], ref16)


def test_audio_batches_pad_to_the_longest_row_with_a_mask() -> None:
    """finish(): [B, C, L] zero-padded, lengths and mask of each row."""
    pipeline = build_pipeline("audio", {"sample_rate": 8000, "max_seconds": 2.0})
    block = {f.name: np.full((3, *f.shape), 7, f.dtype) for f in pipeline.fields()}
    for i, seconds in enumerate((0.5, 1.0, 0.25)):
        row = {name: array[i, ...] for name, array in block.items()}
        pipeline.decode_into(memoryview(encode_tone(seconds)), _info(i), row)
    shapes = pipeline.finish(block, 3)
    assert shapes == {"audio": (3, 1, 8000), "audio_length": (3,), "audio_mask": (3, 8000)}
    audio = block["audio"].reshape(-1)[: 3 * 8000].reshape(3, 1, 8000)
    mask = block["audio_mask"].reshape(-1)[: 3 * 8000].reshape(3, 8000)
    assert block["audio_length"].tolist() == [4000, 8000, 2000]
    assert mask.sum(axis=1).tolist() == [4000, 8000, 2000]
    assert not audio[0, :, 4000:].any() and not audio[2, :, 2000:].any()
    assert audio[0, :, :4000].any()


def _kind(kind: str, data: bytes, **options: Any) -> str:
    with pytest.raises(BadSample) as caught:
        _decode(kind, data, **options)
    return caught.value.kind


def test_hostile_media_are_bad_samples_of_named_kinds() -> None:
    """Not media, truncated, empty, no such stream: each one named, never a crash."""
    video = encode_video(200, fmt="matroska", gop=10)
    assert _kind("video", b"plain text, not a video at all") == "corrupt"
    assert _kind("video", encode_video(40)[:2000]) == "corrupt"  # moov at the end: cut off
    assert _kind("video", video[: len(video) // 3], clip="center") == "truncated"
    assert _kind("audio", empty_wav()) == "empty"
    assert _kind("audio", empty_wav(), seconds=1.0) == "empty"
    assert _kind("audio", b"") == "empty"
    assert _kind("audio", encode_video(10)) == "corrupt"  # no audio stream
    assert _kind("video", encode_tone(0.2)) == "corrupt"  # no video stream
    tone = encode_tone(2.0)
    # A cut WAV decodes what is left: its length says how much.
    cut = _decode("audio", tone[: len(tone) // 4], crop="start", seconds=1.0)
    assert 0 < int(cut["audio_length"]) < 16000


@pytest.mark.parametrize("kind", ["video", "audio"])
def test_mutated_media_decode_or_are_bad_samples_never_a_crash(kind: str) -> None:
    """Bytes of a valid file with random bytes overwritten or cut: each decodes to the
    field shapes or raises BadSample; nothing else escapes (and nothing hangs)."""
    rng = np.random.default_rng(0)
    video = encode_video(30, codec="libx264")
    base = {"video": video, "audio": encode_tone(0.5, fmt="flac", codec="flac")}[kind]
    pipeline = build_pipeline(kind, {"frames": 4, "size": 16} if kind == "video" else {})
    kinds = set()
    for trial in range(60):
        data = bytearray(base)
        if trial % 3 == 0:
            data = data[: int(rng.integers(1, len(data)))]
        else:
            at = rng.integers(0, len(data), size=int(rng.integers(1, 40)))
            data_np = np.frombuffer(data, np.uint8).copy()
            data_np[at] = rng.integers(0, 256, size=len(at))
            data = bytearray(data_np.tobytes())
        row = {f.name: np.zeros(f.shape, f.dtype) for f in pipeline.fields()}
        try:
            pipeline.decode_into(memoryview(bytes(data)), _info(trial), row)
            kinds.add("ok")
        except BadSample as e:
            kinds.add(e.kind)
    assert kinds <= {"ok", "corrupt", "truncated", "empty", "too_large"}, kinds


def test_bad_options_are_refused_when_built() -> None:
    """Out-of-range options are InvalidArgument, naming the option."""
    for kind, options in [
        ("video", {"frames": 0}),
        ("video", {"clip": "middle"}),
        ("video", {"fps": -1.0}),
        ("video", {"clips_per_video": 1000}),
        ("audio", {"sample_rate": 10}),
        ("audio", {"crop": "end"}),
        ("audio", {"dtype": "float64"}),
        ("audio", {"seconds": 0.0}),
    ]:
        with pytest.raises(InvalidArgument, match=next(iter(options))):
            build_pipeline(kind, options)
