"""``ingest tar``: WebDataset-style shards become catalog rows whose byte ranges are the
payload members inside the tar (Postgres and SQLite)."""

from __future__ import annotations

import gzip
import io
import json
import tarfile
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
from sqlalchemy.engine import Engine

from batchd_server.catalog.ingest import ingest_tar
from batchd_server.catalog.tar_shards import expand_shards, split_from_name
from batchd_server.cli import main
from batchd_server.errors import DataError


def write_shard(path: Path, members: list[tuple[str, bytes]]) -> None:
    """An uncompressed tar of ``members`` (name, bytes), in that order."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with tarfile.open(path, "w", format=tarfile.GNU_FORMAT) as tar:
        for name, data in members:
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))


def image_bytes(i: int) -> bytes:
    return b"\xff\xd8\xff\xe0" + bytes([i % 256]) * (100 + i)


def image_shards(root: Path, shards: int = 3, per_shard: int = 5) -> dict[str, tuple[bytes, int]]:
    """Shards ``train-00{0..}.tar`` of (jpg, cls) samples; returns key -> (payload, label)."""
    expected = {}
    for s in range(shards):
        members = []
        for j in range(per_shard):
            i = s * per_shard + j
            key = f"sample{i:04d}"
            members += [(f"{key}.jpg", image_bytes(i)), (f"{key}.cls", f"{i % 7}\n".encode())]
            expected[f"train-{s:03d}.tar#{key}"] = (image_bytes(i), i % 7)
        write_shard(root / f"train-{s:03d}.tar", members)
    return expected


def _rows(engine: Engine) -> dict[str, Any]:
    with engine.connect() as conn:
        result = conn.execute(
            sa.text(
                "SELECT key, path, byte_offset, byte_length, label, split, attrs, is_verified "
                "FROM samples ORDER BY id"
            )
        )
        return {r.key: r for r in result}


def test_image_shards_with_cls_labels_load_every_good_sample_once_and_list_the_bad_one(
    engine: Engine, tmp_path: Path
) -> None:
    """Good samples go in with their labels and exact byte ranges; the broken one is listed."""
    expected = image_shards(tmp_path)
    write_shard(
        tmp_path / "train-003.tar",
        [
            ("good.jpg", image_bytes(99)),
            ("good.cls", b"3"),
            ("broken.jpg", image_bytes(98)),
            ("broken.cls", b"not-a-number"),
        ],
    )
    expected["train-003.tar#good"] = (image_bytes(99), 3)
    report = ingest_tar(engine, dataset="wds", root=tmp_path, shards=["train-{000..003}.tar"])
    assert report.inserted == report.rows_read == len(expected) == 16
    assert len(report.skipped) == 1 and "broken" in report.skipped[0]
    assert "'not-a-number' is not an integer" in report.skipped[0]
    assert "1 skipped" in report.summary()
    rows = _rows(engine)
    assert set(rows) == set(expected)
    for key, (payload, label) in expected.items():
        row = rows[key]
        assert (row.label, row.split, row.is_verified) == (label, "train", True)
        with open(tmp_path / row.path, "rb") as f:
            f.seek(row.byte_offset)
            assert f.read(row.byte_length) == payload
        members = row.attrs if isinstance(row.attrs, dict) else json.loads(row.attrs)
        assert set(members["members"]) == {"cls"}


def test_re_ingesting_the_same_shards_changes_nothing(engine: Engine, tmp_path: Path) -> None:
    """Idempotent: a second run finds every key already present."""
    image_shards(tmp_path)
    first = ingest_tar(engine, dataset="wds", root=tmp_path, shards=["*.tar"])
    again = ingest_tar(engine, dataset="wds", root=tmp_path, shards=["*.tar"])
    assert (first.inserted, again.inserted, again.already_present) == (15, 0, 15)


def test_a_compressed_shard_is_refused_with_how_to_recompress_it(
    engine: Engine, tmp_path: Path
) -> None:
    """A .tar.gz cannot be read by byte range: the error says to recompress uncompressed."""
    write_shard(tmp_path / "plain.tar", [("a.jpg", image_bytes(1))])
    (tmp_path / "train-000.tar.gz").write_bytes(
        gzip.compress((tmp_path / "plain.tar").read_bytes())
    )
    with pytest.raises(DataError, match=r"gzip-compressed tar.*uncompressed.*gunzip -k"):
        ingest_tar(engine, dataset="wds", root=tmp_path, shards=["train-000.tar.gz"])


def test_json_labels_captions_splits_and_extra_members(engine: Engine, tmp_path: Path) -> None:
    """--label-key reads .json; a .txt caption is no label; other members keep their ranges."""
    write_shard(
        tmp_path / "shards" / "val-000.tar",
        [
            ("a.npy", b"NPY-A"),
            ("a.json", json.dumps({"cls_id": 5}).encode()),
            ("a.txt", b"a photo of a cat"),
            ("b.npy", b"NPY-B"),
            ("b.txt", b"12"),
            ("dir/c.x.npy", b"NPY-C"),
        ],
    )
    report = ingest_tar(
        engine, dataset="wds", root=tmp_path, shards=["shards/val-*.tar"], label_key="cls_id"
    )
    assert report.inserted == 3 and not report.skipped
    rows = _rows(engine)
    a, b, c = (rows[f"shards/val-000.tar#{k}"] for k in ("a", "b", "dir/c"))
    assert (a.label, b.label, c.label) == (5, 12, None)
    assert {a.split, b.split, c.split} == {"val"}
    members = a.attrs if isinstance(a.attrs, dict) else json.loads(a.attrs)
    assert set(members["members"]) == {"json", "txt"}
    with open(tmp_path / a.path, "rb") as f:
        offset, length = members["members"]["txt"]
        f.seek(offset)
        assert f.read(length) == b"a photo of a cat"


def test_a_truncated_shard_keeps_its_whole_samples_and_lists_the_cut_one(
    engine: Engine, tmp_path: Path
) -> None:
    """A shard cut inside a member's data: the samples before it go in, the cut one is listed."""
    shard = tmp_path / "test-000.tar"
    write_shard(shard, [("a.jpg", image_bytes(1)), ("b.jpg", image_bytes(200) * 20)])
    data = shard.read_bytes()
    shard.write_bytes(data[: 512 * 3 + 100])  # a's header + data, b's header, part of b
    report = ingest_tar(engine, dataset="wds", root=tmp_path, shards=[str(shard)])
    assert report.inserted == 1 and set(_rows(engine)) == {"test-000.tar#a"}
    assert any("truncated" in s and "'b.jpg'" in s for s in report.skipped)


def test_shard_patterns_and_splits_from_names_are_checked(tmp_path: Path) -> None:
    """Brace ranges and globs expand in order; no match and no split are clear errors."""
    for name in ("a-001.tar", "a-002.tar", "a-010.tar"):
        write_shard(tmp_path / name, [("x.jpg", b"x")])
    found = expand_shards(["a-{001..002}.tar", "a-0*.tar"], tmp_path)
    assert [p.name for p in found] == ["a-001.tar", "a-002.tar", "a-010.tar"]
    with pytest.raises(DataError, match=r"'b-\{0..1\}.tar' matches no file"):
        expand_shards(["b-{0..1}.tar"], tmp_path)
    assert split_from_name(Path("imagenet-train-0001.tar")) == "train"
    assert split_from_name(Path("laion_validation_03.tar")) == "val"
    assert split_from_name(Path("shard-0001.tar")) is None


def test_the_cli_ingests_tar_shards_and_prints_the_skipped(
    sqlite_url: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`batchd-server ingest tar` takes brace ranges and prints the summary with skips."""
    image_shards(tmp_path / "data", shards=2, per_shard=3)
    write_shard(tmp_path / "data" / "shard-9.tar", [("lonely.cls", b"1")])
    argv = ["ingest", "tar", "--database-url", sqlite_url, "--dataset", "wds"]
    argv += ["--root", str(tmp_path / "data"), "--split", "train", "train-{000..001}.tar"]
    assert main([*argv, "shard-9.tar"]) == 0
    out = capsys.readouterr().out
    assert "6 inserted" in out and "1 skipped" in out and "lonely" in out
    assert main(["ingest", "tar", "--database-url", sqlite_url, "--dataset", "wds"]) != 0
    assert "required: --root, SHARD" in capsys.readouterr().err
