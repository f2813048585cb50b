"""Samples ingested from WebDataset tar shards are served by the image and array pipelines,
read as byte ranges inside the tars (real server, Postgres and SQLite)."""

from __future__ import annotations

import io
import tarfile
from pathlib import Path

import numpy as np
import sqlalchemy as sa
from PIL import Image
from sqlalchemy.engine import Engine

import batchd
from batchd_server.catalog.ingest import ingest_tar

from serving import serve


def _shard(path: Path, members: list[tuple[str, bytes]]) -> None:
    with tarfile.open(path, "w") as tar:
        for name, data in members:
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))


def _jpeg(colour: tuple[int, int, int], size: tuple[int, int]) -> bytes:
    out = io.BytesIO()
    Image.new("RGB", size, colour).save(out, format="JPEG", quality=95)
    return out.getvalue()


def _npy(values: np.ndarray) -> bytes:
    out = io.BytesIO()
    np.save(out, values)
    return out.getvalue()


def test_images_and_arrays_in_tar_shards_are_served_with_their_labels(
    engine: Engine, tmp_path: Path
) -> None:
    """Image and Array pipelines decode the payload ranges; labels come from .cls members."""
    root = tmp_path / "shards"
    root.mkdir()
    colours = {}
    for s in range(2):
        members = []
        for j in range(6):
            i = s * 6 + j
            colour = (20 * i, 255 - 20 * i, 100)
            colours[i] = colour
            members += [
                (f"img{i:03d}.jpg", _jpeg(colour, (40 + i, 30 + 2 * i))),
                (f"img{i:03d}.cls", str(i % 3).encode()),
            ]
        _shard(root / f"images-train-{s}.tar", members)
        _shard(
            root / f"arrays-train-{s}.tar",
            [(f"a{s}{j}.npy", _npy(np.full(4, s * 10 + j, np.float32))) for j in range(5)],
        )
    ingest_tar(engine, dataset="wds-images", root=root, shards=["images-train-{0..1}.tar"])
    ingest_tar(engine, dataset="wds-arrays", root=root, shards=["arrays-*.tar"])
    with engine.connect() as conn:
        key_of = dict(conn.execute(sa.text("SELECT id, key FROM samples")).all())
    url = engine.url.render_as_string(hide_password=False)
    with serve(url, tmp_path) as server:
        with batchd.Loader(
            server.address,
            dataset="wds-images",
            batch_size=5,
            pipeline=batchd.Image(size=16),
            device="cpu",
        ) as loader:
            seen = []
            for batch in loader:
                assert loader.last_failed_sample_ids == ()
                for sid, label, image in zip(
                    batch["sample_id"].tolist(),
                    batch["label"].tolist(),
                    batch["image"],
                    strict=True,
                ):
                    i = int(key_of[sid].rsplit("img", 1)[1])
                    assert label == i % 3
                    # A flat colour survives decode and resize within JPEG's error.
                    mean = image.float().mean(dim=(1, 2)).tolist()
                    assert np.allclose(mean, colours[i], atol=6), (mean, colours[i])
                    seen.append(i)
            assert sorted(seen) == list(range(12))
        with batchd.Loader(
            server.address,
            dataset="wds-arrays",
            batch_size=4,
            pipeline=batchd.Array((4,), "float32"),
            device="cpu",
            shuffle=False,
        ) as loader:
            values = sorted(int(row[0]) for batch in loader for row in batch["array"].tolist())
            assert values == [0, 1, 2, 3, 4, 10, 11, 12, 13, 14]
