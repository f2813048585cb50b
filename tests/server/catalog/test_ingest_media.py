"""``ingest videofolder`` / ``audiofolder``: class-per-directory trees of media encoded in the
test, each file probed for its duration (the sample's length, in ms) and what a plan needs;
files that do not probe are left out and named; local and ``s3://`` roots alike."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
from media_data import empty_wav, encode_tone, encode_video, write_tree
from s3server import store_env, throwaway_s3
from sqlalchemy.engine import Engine

from batchd_server.catalog.ingest import ingest_audiofolder, ingest_videofolder
from batchd_server.cli import main
from batchd_server.errors import DataError


def _rows(engine: Engine) -> list[tuple[Any, ...]]:
    with engine.connect() as conn:
        found = conn.execute(
            sa.text("SELECT path, label, split, length, attrs FROM samples ORDER BY id")
        ).all()
    return [
        (p, label, s, n, json.loads(a) if isinstance(a, str) else a) for p, label, s, n, a in found
    ]


@pytest.mark.backend("sqlite")
def test_videos_are_probed_for_duration_rate_and_frames(engine: Engine, tmp_path: Path) -> None:
    """length is the duration in ms; attrs hold fps, frames and size; a file that is not a
    video is skipped and named; other suffixes are ignored."""
    write_tree(
        tmp_path,
        {
            "train/cat/a.mp4": encode_video(50, 96, 64),
            "train/cat/b.mkv": encode_video(25, 64, 48, fmt="matroska"),
            "train/dog/c.mp4": b"not a video",
            "train/dog/d.mp4": encode_video(75, codec="libx264"),
            "train/dog/notes.txt": b"ignored",
        },
    )
    report = ingest_videofolder(engine, dataset="v", root=tmp_path)
    assert report.inserted == 3
    assert len(report.skipped) == 1 and report.skipped[0].startswith("train/dog/c.mp4: not video")
    assert "1 skipped" in report.summary()
    rows = _rows(engine)
    assert [(p, label, s) for p, label, s, _, _ in rows] == [
        ("train/cat/a.mp4", 0, "train"),
        ("train/cat/b.mkv", 0, "train"),
        ("train/dog/d.mp4", 1, "train"),
    ]
    a = rows[0][4]["video"]
    assert (a["fps"], a["frames"], a["width"], a["height"]) == (25.0, 50, 96, 64)
    assert a["duration_s"] == pytest.approx(2.0, abs=0.05)
    assert [r[3] for r in rows] == [pytest.approx(ms, abs=50) for ms in (2000, 1000, 3000)]


@pytest.mark.backend("sqlite")
def test_audio_folders_are_probed_in_worker_processes_with_progress(
    engine: Engine, tmp_path: Path
) -> None:
    """Many files: probed by a pool, progress reported to the end; an empty WAV is skipped
    (no duration), the others carry sample rate and channels."""
    files = {f"c{i % 3}/t{i:03d}.wav": encode_tone(0.05 + 0.01 * (i % 5)) for i in range(70)}
    files["c0/zero.wav"] = empty_wav()
    write_tree(tmp_path, files)
    calls: list[tuple[int, int, int]] = []
    report = ingest_audiofolder(
        engine,
        dataset="a",
        root=tmp_path,
        split="train",
        workers=2,
        progress=lambda *a: calls.append(a),
    )
    assert report.inserted == 70 and [s.split(":")[0] for s in report.skipped] == ["c0/zero.wav"]
    assert calls[-1][:2] == (71, 71)
    rows = _rows(engine)
    assert {r[4]["audio"]["sample_rate"] for r in rows} == {22050}
    assert {r[4]["audio"]["channels"] for r in rows} == {2}
    assert {r[3] for r in rows} == {50, 60, 70, 80, 90}


@pytest.mark.backend("sqlite")
def test_a_tree_without_media_is_refused_saying_what_was_looked_for(
    engine: Engine, tmp_path: Path, sqlite_url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """No matching files: DataError naming the suffixes and the layout; the command line
    ingests a tree and prints the summary."""
    write_tree(tmp_path / "empty", {"train/x/readme.md": b"nothing"})
    with pytest.raises(DataError, match=r"no audio files \(\.aac, .*\.wav\) found .*--split"):
        ingest_audiofolder(engine, dataset="a", root=tmp_path / "empty")
    write_tree(tmp_path / "ok", {"x/t.flac": encode_tone(0.2, fmt="flac", codec="flac")})
    argv = ["ingest", "audiofolder", "--database-url", sqlite_url, "--dataset", "cli"]
    assert main([*argv, "--root", str(tmp_path / "ok"), "--split", "train"]) == 0
    assert "1 inserted" in capsys.readouterr().out


@pytest.mark.slow(seconds=15)
def test_an_s3_tree_gives_the_rows_of_the_same_files_on_disk(
    sqlite_engine: Engine, tmp_path: Path
) -> None:
    """The same videos ingested from a local root and from s3:// give the same rows."""
    write_tree(
        tmp_path / "local",
        {f"train/{c}/v{i}.mp4": encode_video(30 + 5 * i, seed=i) for i, c in enumerate("aab")},
    )
    ingest_videofolder(sqlite_engine, dataset="local", root=tmp_path / "local")
    local = _rows(sqlite_engine)
    with throwaway_s3() as store, store_env(store):
        store.create_bucket("media")
        store.upload_tree(tmp_path / "local", "media", "videos")
        with sqlite_engine.begin() as conn:
            conn.execute(sa.text("DELETE FROM samples"))
        ingest_videofolder(sqlite_engine, dataset="remote", root="s3://media/videos")
    assert _rows(sqlite_engine) == local
