"""Video and audio end to end: folders of clips and tones encoded in the test with PyAV,
ingested with ``ingest videofolder`` / ``audiofolder``, served by a real server's workers and
read through ``batchd.Loader``: exact frames, clips deterministic in (seed, epoch, sample)
across resume and elastic resume, every sample once over two ranks, bad media named."""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import sqlalchemy as sa
from media_data import (
    empty_wav,
    encode_tone,
    encode_video,
    reference_audio,
    reference_clip,
    video_tree,
    write_tree,
)
from sqlalchemy.engine import Engine

import batchd
from batchd_server.api import RunningServer
from batchd_server.catalog.ingest import ingest_audiofolder, ingest_videofolder
from batchd_server.catalog.schema import sample_errors

from serving import serve

pytestmark = [pytest.mark.backend("sqlite"), pytest.mark.slow(seconds=60)]

N_VIDEOS = 11  # prime: neither the batch nor the world size divides it
BATCH = 3
CLIP = batchd.Video(frames=4, size=32, fps=12.5)


@pytest.fixture
def videos(engine: Engine, tmp_path: Path) -> dict[str, bytes]:
    files = video_tree(tmp_path / "videos", N_VIDEOS)
    ingest_videofolder(engine, dataset="videos", root=tmp_path / "videos")
    return files


@pytest.fixture
def server(engine: Engine, tmp_path: Path) -> Iterator[RunningServer]:
    with serve(engine.url.render_as_string(hide_password=False), tmp_path) as srv:
        yield srv


def _paths(engine: Engine, dataset: str) -> dict[int, str]:
    with engine.connect() as conn:
        rows = conn.execute(
            sa.text(
                "SELECT s.id, s.path FROM samples s JOIN datasets d ON d.id = s.dataset_id "
                "WHERE d.name = :name"
            ),
            {"name": dataset},
        ).all()
    return {int(i): str(p) for i, p in rows}


def _loader(server: RunningServer, rank: int = 0, world: int = 1, **kw: Any) -> batchd.Loader:
    kw.setdefault("pipeline", CLIP)
    return batchd.Loader(
        server.address,
        dataset="videos",
        batch_size=BATCH,
        rank=rank,
        world_size=world,
        device="cpu",
        seed=7,
        **kw,
    )


def _rows(batches: list[dict[str, Any]]) -> dict[int, tuple[float, bytes]]:
    """sample id -> (clip start, frames' bytes)."""
    out = {}
    for b in batches:
        for i, sid in enumerate(b["sample_id"].tolist()):
            out[sid] = (float(b["clip_start"][i]), b["video"][i].numpy().tobytes())
    return out


def test_video_batches_hold_the_reference_frames_of_their_clips(
    engine: Engine, videos: dict[str, bytes], server: RunningServer
) -> None:
    """[B, T, 3, H, W] uint8, clip starts and frame indices: the frames PyAV decodes there."""
    paths = _paths(engine, "videos")
    seen = 0
    with _loader(server, drop_last=False) as loader:
        for batch in loader:
            video = batch["video"].numpy()
            assert video.dtype == np.uint8 and video.shape[1:] == (4, 3, 32, 32)
            assert batch["frame_index"].shape == (len(video), 4)
            for i, sid in enumerate(batch["sample_id"].tolist()):
                indices = batch["frame_index"][i].tolist()
                assert indices == sorted(indices) and indices[1] - indices[0] == 2  # 25 -> 12.5
                assert float(batch["clip_start"][i]) == pytest.approx(indices[0] / 25)
                ref = reference_clip(videos[paths[sid]], indices, 32)
                assert np.array_equal(video[i], ref), paths[sid]
                seen += 1
    assert seen == N_VIDEOS


def test_clips_are_deterministic_in_seed_epoch_and_sample(
    videos: dict[str, bytes], server: RunningServer
) -> None:
    """Two runs of an epoch agree clip for clip; another epoch draws other clips."""
    runs = []
    for epoch in (0, 0, 1):
        with _loader(server, drop_last=False) as loader:
            loader.set_epoch(epoch)
            runs.append(_rows(list(loader)))
    assert runs[0] == runs[1]
    assert {k: v[0] for k, v in runs[0].items()} != {k: v[0] for k, v in runs[2].items()}


def test_resume_and_elastic_resume_give_the_same_clips(
    videos: dict[str, bytes], server: RunningServer
) -> None:
    """A mid-epoch resume and a 2 -> 1 rank resume serve every sample once, with the clip
    the uninterrupted epoch gave it."""
    with _loader(server, drop_last=False) as loader:
        reference = list(loader)
    whole = _rows(reference)
    with _loader(server, drop_last=False) as loader:
        it = iter(loader)
        head = [next(it), next(it)]
        state = loader.state_dict()
    with _loader(server, drop_last=False) as loader:
        loader.load_state_dict(state)
        rest = list(loader)
    assert [b["sample_id"].tolist() for b in head + rest] == [
        b["sample_id"].tolist() for b in reference
    ]
    assert _rows(head + rest) == whole

    served: list[dict[str, Any]] = []
    for rank in range(2):
        with _loader(server, rank, 2) as loader:
            it = iter(loader)
            served.append(next(it))
            if rank == 0:
                state = loader.state_dict()
    with _loader(server, 0, 1) as loader:
        loader.load_state_dict(state)
        served += list(loader)
    ids = Counter(i for b in served for i in b["sample_id"].tolist())
    assert set(ids) == set(whole) and max(ids.values()) == 1
    assert _rows(served) == whole


def test_two_ranks_serve_every_video_once(
    engine: Engine, videos: dict[str, bytes], server: RunningServer
) -> None:
    """Disjoint ranks whose union is the split, each sample once (drop_last)."""
    per_rank = []
    for rank in range(2):
        with _loader(server, rank, 2, drop_last=True) as loader:
            per_rank.append([i for b in loader for i in b["sample_id"].tolist()])
    served = per_rank[0] + per_rank[1]
    assert len(served) == len(set(served)) == (N_VIDEOS // (2 * BATCH)) * 2 * BATCH
    assert set(served) <= set(_paths(engine, "videos"))
    with _loader(server, 0, 2, drop_last=False) as a, _loader(server, 1, 2, drop_last=False) as b:
        union = {i for loader in (a, b) for batch in loader for i in batch["sample_id"].tolist()}
    assert union == set(_paths(engine, "videos"))


def test_bad_media_are_skipped_and_named(engine: Engine, tmp_path: Path) -> None:
    """A truncated video, a file that is not media and an audio file of zero samples, each
    replaced after ingest: one bad sample of a named kind each, the rest delivered."""
    video_tree(tmp_path / "v", 6, frames=60)
    write_tree(tmp_path / "a", {f"train/x/t{i}.wav": encode_tone(0.3 + 0.1 * i) for i in range(5)})
    ingest_videofolder(engine, dataset="v", root=tmp_path / "v")
    ingest_audiofolder(engine, dataset="a", root=tmp_path / "a")
    cut = encode_video(200, fmt="matroska", seed=1)
    write_tree(
        tmp_path / "v",
        {"train/a/v000.mp4": cut[: len(cut) // 3], "train/b/v001.mp4": b"not a video"},
    )
    write_tree(tmp_path / "a", {"train/x/t2.wav": empty_wav()})
    url = engine.url.render_as_string(hide_password=False)
    with serve(url, tmp_path) as srv:
        for name, pipeline, n in (
            ("v", batchd.Video(frames=4, size=16, clip="center"), 6),
            ("a", batchd.Audio(sample_rate=8000), 5),
        ):
            with batchd.Loader(
                srv.address,
                dataset=name,
                batch_size=2,
                pipeline=pipeline,
                device="cpu",
                on_error="skip",
                max_error_fraction=0.5,
            ) as loader:
                rows = sum(len(b["sample_id"]) for b in loader)
            assert rows == n - (2 if name == "v" else 1)
    paths = {**_paths(engine, "v"), **_paths(engine, "a")}
    with engine.connect() as conn:
        kinds = {
            paths[i]: k
            for i, k in conn.execute(sa.select(sample_errors.c.sample_id, sample_errors.c.kind))
        }
    assert kinds == {
        "train/a/v000.mp4": "truncated",
        "train/b/v001.mp4": "corrupt",
        "train/x/t2.wav": "empty",
    }


def test_audio_is_served_padded_with_lengths_and_bucketed_by_duration(
    engine: Engine, tmp_path: Path
) -> None:
    """Whole files resampled to [B, C, L] with lengths and masks; ingest records durations,
    so bucketed batches hold files of similar length; the samples are the reference's."""
    durations = [0.2, 1.1, 0.3, 1.0, 0.25, 1.2, 0.35, 0.9]
    files = {
        f"train/c{i % 2}/t{i}.flac": encode_tone(d, fmt="flac", codec="flac")
        for i, d in enumerate(durations)
    }
    write_tree(tmp_path / "a", files)
    ingest_audiofolder(engine, dataset="a", root=tmp_path / "a")
    paths = _paths(engine, "a")
    with engine.connect() as conn:
        recorded = dict(conn.execute(sa.text("SELECT path, attrs FROM samples")).all())
        lengths = dict(conn.execute(sa.text("SELECT path, length FROM samples")).all())
    attrs = json.loads(recorded["train/c1/t1.flac"])  # SQLite keeps JSON as text
    assert attrs["audio"]["sample_rate"] == 22050 and attrs["audio"]["channels"] == 2
    assert abs(lengths["train/c1/t1.flac"] - 1100) <= 30
    url = engine.url.render_as_string(hide_password=False)
    with (
        serve(url, tmp_path) as srv,
        batchd.Loader(
            srv.address,
            dataset="a",
            batch_size=4,
            pipeline=batchd.Audio(sample_rate=16000, max_seconds=2.0),
            sampling="bucketed",
            device="cpu",
        ) as loader,
    ):
        batches = list(loader)
    assert len(batches) == 2
    for b in batches:
        audio, length, mask = b["audio"].numpy(), b["audio_length"].numpy(), b["audio_mask"].numpy()
        assert audio.dtype == np.float32 and audio.shape[:2] == (4, 1)
        assert audio.shape[2] == length.max() == mask.shape[1]
        assert (mask.sum(axis=1) == length).all()
        seconds = sorted(
            durations[int(paths[s].rsplit("t", 1)[1][:-5])] for s in b["sample_id"].tolist()
        )
        assert seconds[-1] - seconds[0] < 0.5  # short with short, long with long
        for i, sid in enumerate(b["sample_id"].tolist()):
            ref = reference_audio(files[paths[sid]], 16000, 0, int(length[i]))
            assert np.array_equal(audio[i, :, : length[i]], ref)
            assert not audio[i, :, length[i] :].any()
