"""The decode cache end to end: real servers, workers, shared memory and disk.

Every pipeline's batches through a server with the cache (shared-memory tier, then disk tier)
equal, byte for byte, those of a server without it, for the same seed and epochs; the later
epochs really come from the cache (its hit counter moves); a session can opt out; and the
shared-memory tier is gone when the server stops (``serve`` asserts no segment is left).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from sqlalchemy.engine import Engine

import batchd
from batchd.errors import FailedPrecondition
from batchd_server.catalog.ingest import ingest_manifest
from batchd_server.metrics import REGISTRY

from serving import image_dataset, serve, token_dataset

pytestmark = pytest.mark.slow(seconds=60)

SEED = 5
EPOCHS = (0, 1, 2)
NPY_SHAPE = (3, 5)


def npy_dataset(engine: Engine, root: Path, n: int = 30) -> None:
    """``n`` .npy files, one sample each, in C, Fortran and big-endian layouts."""
    root.mkdir(parents=True)
    rows = []
    for i in range(n):
        values = np.arange(15, dtype="<f8").reshape(NPY_SHAPE) * (i + 1)
        if i % 3 == 1:
            values = np.asfortranarray(values)
        elif i % 3 == 2:
            values = values.astype(">f8")
        np.save(root / f"a{i:03d}.npy", values)
        rows.append({"path": f"a{i:03d}.npy", "split": "train", "label": i % 4})
    manifest = root.parent / "arrays.jsonl"
    manifest.write_text("".join(json.dumps(r) + "\n" for r in rows))
    ingest_manifest(engine, dataset="arrays", root=root, manifest=manifest)


PIPELINES: dict[str, tuple[str, Any]] = {
    "image": ("images", batchd.Image(size=40, resize=56)),
    "image-flip": ("images", batchd.Image(size=40, resize=48, flip=True)),
    "image-random-crop": ("images", batchd.Image(size=40, random_crop=True, flip=True)),
    "npy": ("arrays", batchd.Array(NPY_SHAPE, "float64")),
    "tokens": ("tokens", batchd.Tokens(max_len=9)),
}


@pytest.fixture
def catalog(sqlite_engine: Engine, tmp_path: Path) -> dict[str, Any]:
    image_dataset(sqlite_engine, tmp_path / "images", n=24)
    token_dataset(sqlite_engine, tmp_path / "tokens", n=40)
    npy_dataset(sqlite_engine, tmp_path / "arrays")
    return {"url": sqlite_engine.url.render_as_string(hide_password=False)}


Batches = list[dict[str, np.ndarray]]


def epochs(address: str, name: str, **options: Any) -> dict[int, Batches]:
    """Every batch of each epoch of :data:`EPOCHS`, as numpy arrays."""
    dataset, pipeline = PIPELINES[name]
    found: dict[int, Batches] = {}
    with batchd.Loader(
        address, dataset=dataset, batch_size=7, pipeline=pipeline, seed=SEED, **options
    ) as loader:
        for epoch in EPOCHS:
            loader.set_epoch(epoch)
            found[epoch] = [
                {key: value.numpy().copy() for key, value in batch.items()} for batch in loader
            ]
    return found


def lookups(dataset: str, result: str) -> float:
    labels = {"dataset": dataset, "result": result}
    return REGISTRY.get_sample_value("batchd_decode_cache_lookups_total", labels) or 0.0


def assert_same(got: dict[int, Batches], want: dict[int, Batches]) -> None:
    for epoch in EPOCHS:
        assert len(got[epoch]) == len(want[epoch]), epoch
        for a, b in zip(got[epoch], want[epoch], strict=True):
            assert a.keys() == b.keys()
            for key in a:
                assert a[key].dtype == b[key].dtype, (epoch, key)
                np.testing.assert_array_equal(a[key], b[key], err_msg=f"epoch {epoch} {key}")


@pytest.fixture
def reference(catalog: dict[str, Any], tmp_path: Path) -> dict[str, dict[int, Batches]]:
    """Every pipeline's epochs from a server without the cache."""
    (tmp_path / "reference").mkdir()
    with serve(catalog["url"], tmp_path / "reference") as srv:
        return {name: epochs(srv.address, name) for name in PIPELINES}


@pytest.mark.parametrize("tier", ["shm", "disk"])
def test_every_pipeline_is_byte_identical_with_the_cache_and_hits_after_epoch_1(
    catalog: dict[str, Any], reference: dict[str, dict[int, Batches]], tmp_path: Path, tier: str
) -> None:
    """Same seed, same epochs: the cached server's batches equal the uncached server's, and
    the later epochs hit. ``disk``: a shared-memory tier too small for any entry, so every
    entry goes to, and comes from, the disk directory."""
    config: dict[str, Any] = {"decode_cache_bytes": 64 << 20}
    if tier == "disk":
        config = {
            "decode_cache_bytes": 1,
            "decode_cache_dir": tmp_path / "dc",
            "decode_cache_dir_bytes": 64 << 20,
        }
    with serve(catalog["url"], tmp_path, **config) as srv:
        for name, (dataset, _) in PIPELINES.items():
            hits = lookups(dataset, "hit")
            assert_same(epochs(srv.address, name), reference[name])
            assert lookups(dataset, "hit") > hits, f"{name}: no hit in 3 epochs"
    if tier == "disk":
        assert any(p.name.startswith("dc-") for p in (tmp_path / "dc").iterdir())


def test_deterministic_rows_all_hit_in_the_second_epoch(
    catalog: dict[str, Any], tmp_path: Path
) -> None:
    """A deterministic pipeline misses every sample once, then hits every one."""
    with serve(catalog["url"], tmp_path, decode_cache_bytes=64 << 20) as srv:
        hits, misses = lookups("images", "hit"), lookups("images", "miss")
        dataset, pipeline = PIPELINES["image"]
        with batchd.Loader(srv.address, dataset=dataset, batch_size=6, pipeline=pipeline) as loader:
            first = sum(len(b["sample_id"]) for b in loader)
            assert lookups("images", "miss") - misses == first
            loader.set_epoch(1)
            second = sum(len(b["sample_id"]) for b in loader)
        assert lookups("images", "hit") - hits == second == first
        assert lookups("images", "miss") - misses == first


def test_a_session_that_opts_out_neither_reads_nor_writes_the_cache(
    catalog: dict[str, Any], tmp_path: Path
) -> None:
    with serve(catalog["url"], tmp_path, decode_cache_bytes=64 << 20) as srv:
        before = lookups("images", "hit"), lookups("images", "miss")
        for epoch in range(2):
            got = epochs(srv.address, "image", decode_cache=False)
            assert len(got[epoch]) > 0
        assert (lookups("images", "hit"), lookups("images", "miss")) == before
        assert not [
            p
            for p in Path("/dev/shm").iterdir()
            if "-dc-" in p.name and p.name.startswith(f"batchd-{srv.registry.instance}")
        ]


def test_corrupt_entries_are_ignored_decoded_again_and_replaced(
    catalog: dict[str, Any], tmp_path: Path
) -> None:
    """Every entry overwritten with a flipped byte: the batches stay the same, each lookup
    counts as corrupt, and the next run hits again on the rewritten entries."""
    with serve(catalog["url"], tmp_path, decode_cache_bytes=64 << 20) as srv:
        first = epochs(srv.address, "image")
        prefix = f"batchd-{srv.registry.instance}-dc-"
        entries = [p for p in srv.registry.shm_dir.iterdir() if p.name.startswith(prefix)]
        assert entries
        for path in entries:
            data = bytearray(path.read_bytes())
            data[len(data) // 2] ^= 0xFF
            path.write_bytes(data)
        corrupt = lookups("images", "corrupt")
        assert_same(epochs(srv.address, "image"), first)
        assert lookups("images", "corrupt") - corrupt == len(entries)
        hits = lookups("images", "hit")
        assert_same(epochs(srv.address, "image"), first)
        assert lookups("images", "hit") - hits == sum(len(b["sample_id"]) for b in first[0]) * 3


def test_a_cache_smaller_than_the_dataset_stays_in_its_bound_and_exact(
    catalog: dict[str, Any], tmp_path: Path
) -> None:
    """Room for about a third of the rows: the tier never holds more than its bound, what it
    holds hits in later epochs, and every batch equals the uncached path's (a session that
    opts out, on the same server)."""
    bound = 40_000  # 24 rows of 3 x 40 x 40 = 4,800 bytes, plus their headers
    with serve(catalog["url"], tmp_path, decode_cache_bytes=bound) as srv:
        hits = lookups("images", "hit")
        cached = epochs(srv.address, "image")
        prefix = f"batchd-{srv.registry.instance}-dc"
        held = [
            p.stat().st_size for p in srv.registry.shm_dir.iterdir() if p.name.startswith(prefix)
        ]
        assert 0 < sum(held) <= bound
        assert lookups("images", "hit") > hits
        assert_same(cached, epochs(srv.address, "image", decode_cache=False))


def test_a_server_whose_budget_cannot_hold_the_cache_refuses_to_start(
    catalog: dict[str, Any], tmp_path: Path
) -> None:
    with (
        pytest.raises(FailedPrecondition, match=r"decode cache .*--shm-budget"),
        serve(catalog["url"], tmp_path, shm_budget_bytes=64 << 20, decode_cache_bytes=96 << 20),
    ):
        pass
