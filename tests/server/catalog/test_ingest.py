"""Manifest and image-folder ingest, on Postgres and on SQLite (the ``engine`` fixture), and a
manifest under an object-store root."""

from __future__ import annotations

import csv
import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import obstore
import pytest
import sqlalchemy as sa
from s3server import ThrowawayS3, store_env, throwaway_s3
from sqlalchemy.engine import Engine

from batchd_server.catalog.ingest import ingest_imagefolder, ingest_manifest
from batchd_server.catalog.schema import datasets, samples
from batchd_server.errors import DataError

COLUMNS = ("key", "path", "byte_offset", "byte_length", "label", "split", "length", "weight")


def write_jsonl(path: Path, rows: list[dict[str, Any]]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def write_csv(path: Path, header: list[str], rows: list[list[str]]) -> Path:
    with path.open("w", newline="") as f:
        w = csv.writer(f)
        w.writerow(header)
        w.writerows(rows)
    return path


def make_files(root: Path, names: list[str], size: int = 10) -> None:
    for name in names:
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_bytes(b"x" * size)


def sample_rows(engine: Engine) -> list[sa.Row[Any]]:
    with engine.connect() as conn:
        return list(conn.execute(sa.select(samples).order_by(samples.c.id)))


def table_counts(engine: Engine) -> tuple[int, int]:
    with engine.connect() as conn:
        n_datasets = conn.scalar(sa.select(sa.func.count()).select_from(datasets))
        n_samples = conn.scalar(sa.select(sa.func.count()).select_from(samples))
    return int(n_datasets or 0), int(n_samples or 0)


def dataset_attrs(engine: Engine, name: str) -> dict[str, Any]:
    with engine.connect() as conn:
        attrs = conn.scalar(sa.select(datasets.c.attrs).where(datasets.c.name == name))
    return dict(attrs or {})


@pytest.fixture
def root(tmp_path: Path) -> Path:
    r = tmp_path / "data"
    r.mkdir()
    make_files(r, [f"img/{i}.jpg" for i in range(6)])
    return r


GOOD_ROWS: list[dict[str, Any]] = [
    {"path": "img/0.jpg", "label": 0, "split": "train"},
    {"path": "img/1.jpg", "label": 1, "split": "train", "weight": 2.5, "length": 7},
    {"path": "img/2.jpg", "label": None, "split": "val", "key": "custom-2", "attrs": {"a": 1}},
    {"path": "img/3.jpg", "split": "val", "byte_offset": 2, "byte_length": 5},
]


def test_jsonl_manifest_rows_arrive_in_samples_as_written(engine: Engine, root: Path) -> None:
    """Every field of a JSONL manifest lands in its column; ids follow the manifest's order."""
    manifest = write_jsonl(root.parent / "m.jsonl", GOOD_ROWS)
    report = ingest_manifest(engine, dataset="ds", root=root, manifest=manifest)
    assert (report.rows_read, report.inserted, report.already_present, report.unverified) == (
        4,
        4,
        0,
        0,
    )
    assert report.dataset.root == str(root.resolve())
    rows = sample_rows(engine)
    assert [tuple(getattr(r, c) for c in COLUMNS) for r in rows] == [
        ("img/0.jpg", "img/0.jpg", None, None, 0, "train", None, 1.0),
        ("img/1.jpg", "img/1.jpg", None, None, 1, "train", 7, 2.5),
        ("custom-2", "img/2.jpg", None, None, None, "val", None, 1.0),
        ("img/3.jpg@2", "img/3.jpg", 2, 5, None, "val", None, 1.0),
    ]
    assert [r.attrs for r in rows] == [None, None, {"a": 1}, None]
    assert all(r.is_verified for r in rows)
    assert [r.byte_size for r in rows] == [10, 10, 10, 5]
    assert "4 rows read, 4 inserted" in report.summary()


def test_csv_manifest_rows_arrive_in_samples_as_written(engine: Engine, root: Path) -> None:
    """A CSV manifest with a header: empty cells are null/default, attrs is a JSON string."""
    manifest = write_csv(
        root.parent / "m.csv",
        ["path", "label", "split", "weight", "attrs", "byte_offset", "byte_length"],
        [
            ["img/0.jpg", "3", "train", "", "", "", ""],
            ["img/1.jpg", "", "val", "0.5", '{"source": "cam"}', "0", "10"],
        ],
    )
    ingest_manifest(engine, dataset="ds", root=root, manifest=manifest)
    rows = sample_rows(engine)
    assert [(r.key, r.label, r.split, r.weight, r.attrs, r.byte_length) for r in rows] == [
        ("img/0.jpg", 3, "train", 1.0, None, None),
        ("img/1.jpg@0", None, "val", 0.5, {"source": "cam"}, 10),
    ]


def test_reingesting_the_same_manifest_is_idempotent(engine: Engine, root: Path) -> None:
    """A second run inserts nothing, reports every row already present, and changes no row."""
    manifest = write_jsonl(root.parent / "m.jsonl", GOOD_ROWS)
    ingest_manifest(engine, dataset="ds", root=root, manifest=manifest)
    before = sample_rows(engine)
    again = ingest_manifest(engine, dataset="ds", root=root, manifest=manifest)
    assert (again.rows_read, again.inserted, again.already_present) == (4, 0, 4)
    assert sample_rows(engine) == before


def test_a_changed_row_for_an_existing_key_is_left_as_it_was(engine: Engine, root: Path) -> None:
    """Samples are immutable: re-ingesting a key with a new label keeps the old row."""
    ingest_manifest(
        engine,
        dataset="ds",
        root=root,
        manifest=write_jsonl(root.parent / "a.jsonl", [GOOD_ROWS[0]]),
    )
    changed = [{**GOOD_ROWS[0], "label": 9}, GOOD_ROWS[1]]
    report = ingest_manifest(
        engine, dataset="ds", root=root, manifest=write_jsonl(root.parent / "b.jsonl", changed)
    )
    assert (report.inserted, report.already_present) == (1, 1)
    assert [r.label for r in sample_rows(engine)] == [0, 1]


BAD_ROWS: dict[str, tuple[dict[str, Any], str]] = {
    "label_type": ({"path": "img/1.jpg", "split": "train", "label": "7"}, "label='7'"),
    "label_bool": ({"path": "img/1.jpg", "split": "train", "label": True}, "label=True"),
    "dotdot_path": ({"path": "img/../../etc/passwd", "split": "train"}, "'..'"),
    "absolute_path": ({"path": "/etc/passwd", "split": "train"}, "absolute"),
    "missing_path": ({"split": "train", "label": 1}, "path is missing"),
    "nul_in_path": ({"path": "img/\x001.jpg", "split": "train"}, "NUL"),
    "half_byte_range": ({"path": "img/1.jpg", "split": "train", "byte_offset": 0}, "byte_length"),
    "negative_weight": ({"path": "img/1.jpg", "split": "train", "weight": -1}, "weight=-1"),
    "nan_weight": ({"path": "img/1.jpg", "split": "train", "weight": float("nan")}, "weight=nan"),
    "unknown_field": ({"path": "img/1.jpg", "split": "train", "lable": 1}, "'lable'"),
    "missing_split": ({"path": "img/1.jpg"}, "split is missing"),
    "attrs_not_object": ({"path": "img/1.jpg", "split": "train", "attrs": [1]}, "attrs=[1]"),
    "duplicate_key": ({"path": "img/0.jpg", "split": "val"}, "repeats line 1"),
}


@pytest.mark.parametrize("case", sorted(BAD_ROWS))
def test_a_bad_row_in_the_middle_names_its_line_and_writes_nothing(
    engine: Engine, root: Path, case: str
) -> None:
    """One bad row (line 3 of 4) fails the whole ingest: no dataset row and no samples."""
    bad, expected = BAD_ROWS[case]
    rows = [GOOD_ROWS[0], GOOD_ROWS[1], bad, {"path": "img/5.jpg", "split": "train"}]
    manifest = write_jsonl(root.parent / "m.jsonl", rows)
    with pytest.raises(DataError) as err:
        ingest_manifest(engine, dataset="ds", root=root, manifest=manifest)
    message = str(err.value)
    assert f"{manifest}, line 3" in message
    assert expected in message
    assert table_counts(engine) == (0, 0)


def test_a_bad_csv_cell_names_its_line_field_and_what_is_allowed(
    engine: Engine, root: Path
) -> None:
    """CSV values are parsed per column; a label that is not an integer is reported as such."""
    manifest = write_csv(
        root.parent / "m.csv",
        ["path", "label", "split"],
        [["img/0.jpg", "1", "train"], ["img/1.jpg", "1.5", "train"]],
    )
    with pytest.raises(DataError, match=r"line 3: label='1\.5' .*integer or null"):
        ingest_manifest(engine, dataset="ds", root=root, manifest=manifest)
    assert table_counts(engine) == (0, 0)


def test_an_unknown_csv_column_is_rejected_at_the_header(engine: Engine, root: Path) -> None:
    """A misspelt column fails on line 1 and lists the allowed fields."""
    manifest = write_csv(root.parent / "m.csv", ["path", "lable"], [["img/0.jpg", "1"]])
    with pytest.raises(DataError, match=r"line 1: unknown field 'lable'.*allowed fields"):
        ingest_manifest(engine, dataset="ds", root=root, manifest=manifest, split="train")


def test_a_repeated_key_on_an_existing_dataset_fails_and_keeps_its_rows(
    engine: Engine, root: Path
) -> None:
    """Duplicate keys are caught on re-ingest too, and the earlier rows stay as they were."""
    first = write_jsonl(root.parent / "a.jsonl", GOOD_ROWS)
    ingest_manifest(engine, dataset="ds", root=root, manifest=first)
    before = sample_rows(engine)
    rows = [{"path": "img/4.jpg", "split": "train"}, GOOD_ROWS[0], GOOD_ROWS[0]]
    second = write_jsonl(root.parent / "b.jsonl", rows)
    with pytest.raises(DataError, match=r"line 3: key 'img/0\.jpg' repeats line 2"):
        ingest_manifest(engine, dataset="ds", root=root, manifest=second)
    assert sample_rows(engine) == before


def test_missing_files_are_written_unverified_and_counted(engine: Engine, root: Path) -> None:
    """A row whose file is absent is kept with is_verified false and listed in the summary."""
    rows: list[dict[str, Any]] = [
        {"path": "img/0.jpg", "split": "train"},
        {"path": "gone/a.jpg", "split": "train"},
        {"path": "gone/b.bin", "split": "train", "byte_offset": 0, "byte_length": 4},
    ]
    manifest = write_jsonl(root.parent / "m.jsonl", rows)
    report = ingest_manifest(engine, dataset="ds", root=root, manifest=manifest)
    assert (report.inserted, report.unverified) == (3, 2)
    assert "gone/a.jpg" in report.summary() and "gone/b.bin" in report.summary()
    got = [(r.path, r.is_verified, r.byte_size) for r in sample_rows(engine)]
    assert got == [("img/0.jpg", True, 10), ("gone/a.jpg", False, None), ("gone/b.bin", False, 4)]


def test_rows_sharing_a_shard_file_get_distinct_default_keys(engine: Engine, root: Path) -> None:
    """Byte ranges in one shard: the default key is path@byte_offset, byte_size the range."""
    make_files(root, ["shard-0.bin"], size=100)
    rows = [
        {"path": "shard-0.bin", "byte_offset": i * 25, "byte_length": 25, "split": "train"}
        for i in range(4)
    ]
    ingest_manifest(engine, dataset="ds", root=root, manifest=write_jsonl(root / "m.jsonl", rows))
    got = [(r.key, r.byte_size, r.is_verified) for r in sample_rows(engine)]
    assert got == [(f"shard-0.bin@{i * 25}", 25, True) for i in range(4)]


def test_a_byte_range_past_the_end_of_its_file_is_an_error(engine: Engine, root: Path) -> None:
    """byte_offset + byte_length beyond the file's size names the line and writes nothing."""
    rows = [
        {"path": "img/0.jpg", "split": "train", "byte_offset": 0, "byte_length": 10},
        {"path": "img/0.jpg", "split": "train", "byte_offset": 6, "byte_length": 5},
    ]
    manifest = write_jsonl(root.parent / "m.jsonl", rows)
    with pytest.raises(DataError, match=r"line 2: .*past the end of img/0\.jpg \(10 bytes\)"):
        ingest_manifest(engine, dataset="ds", root=root, manifest=manifest)
    assert table_counts(engine) == (0, 0)


def test_a_symlink_out_of_the_root_is_rejected(engine: Engine, root: Path) -> None:
    """Sample paths stay inside the root: a link that escapes it fails the ingest."""
    outside = root.parent / "secret.txt"
    outside.write_text("x")
    os.symlink(outside, root / "img" / "link.jpg")
    manifest = write_jsonl(root.parent / "m.jsonl", [{"path": "img/link.jpg", "split": "t"}])
    with pytest.raises(DataError, match=r"line 1: .*outside --root"):
        ingest_manifest(engine, dataset="ds", root=root, manifest=manifest)


def test_no_verify_trusts_the_manifest(engine: Engine, tmp_path: Path) -> None:
    """verify=False reads no file: rows are verified and byte_size is byte_length or null."""
    rows: list[dict[str, Any]] = [
        {"path": "a.jpg", "split": "train"},
        {"path": "s.bin", "split": "train", "byte_offset": 0, "byte_length": 99},
    ]
    manifest = write_jsonl(tmp_path / "m.jsonl", rows)
    report = ingest_manifest(
        engine, dataset="ds", root=tmp_path / "not-mounted", manifest=manifest, verify=False
    )
    assert report.unverified == 0
    assert [(r.is_verified, r.byte_size) for r in sample_rows(engine)] == [(True, None), (True, 99)]


def test_a_root_that_does_not_exist_is_an_error(engine: Engine, tmp_path: Path) -> None:
    """With verification on, a mistyped --root is reported before anything is written."""
    manifest = write_jsonl(tmp_path / "m.jsonl", GOOD_ROWS)
    with pytest.raises(DataError, match="does not exist"):
        ingest_manifest(engine, dataset="ds", root=tmp_path / "nope", manifest=manifest)
    assert table_counts(engine) == (0, 0)


def test_the_same_version_under_a_different_root_is_rejected(
    engine: Engine, root: Path, tmp_path: Path
) -> None:
    """(name, version) keeps the root it was created with; the error suggests a new version."""
    manifest = write_jsonl(tmp_path / "m.jsonl", [GOOD_ROWS[0]])
    ingest_manifest(engine, dataset="ds", root=root, manifest=manifest)
    other = tmp_path / "other"
    make_files(other, ["img/0.jpg"])
    with pytest.raises(DataError, match=r"same root directory .*or give a new --version"):
        ingest_manifest(engine, dataset="ds", root=other, manifest=manifest)
    report = ingest_manifest(engine, dataset="ds", version="2", root=other, manifest=manifest)
    assert report.inserted == 1


def test_the_split_argument_is_the_default_for_rows_without_one(engine: Engine, root: Path) -> None:
    """--split fills in rows that have no split and leaves the others alone."""
    rows = [{"path": "img/0.jpg"}, {"path": "img/1.jpg", "split": "val"}]
    manifest = write_jsonl(root.parent / "m.ndjson", rows)
    ingest_manifest(engine, dataset="ds", root=root, manifest=manifest, split="train")
    assert [r.split for r in sample_rows(engine)] == ["train", "val"]


def make_tree(root: Path, layout: dict[str, list[str]]) -> None:
    for folder, names in layout.items():
        make_files(root / folder, names, size=len(folder) + 3)


def test_imagefolder_labels_index_the_sorted_class_names_across_splits(
    engine: Engine, tmp_path: Path
) -> None:
    """root/<split>/<class>/*: labels come from the union of classes, stored on the dataset."""
    make_tree(
        tmp_path,
        {
            "train/dog": ["b.jpg", "a.PNG", "notes.txt"],
            "train/cat": ["x.webp"],
            "val/emu": ["e.jpeg"],
            "val/.cache": ["h.jpg"],
        },
    )
    report = ingest_imagefolder(engine, dataset="pets", root=tmp_path)
    assert (report.rows_read, report.inserted) == (4, 4)
    assert dataset_attrs(engine, "pets") == {"classes": ["cat", "dog", "emu"]}
    got = [(r.key, r.label, r.split, r.is_verified, r.byte_size) for r in sample_rows(engine)]
    assert got == [
        ("train/cat/x.webp", 0, "train", True, 12),
        ("train/dog/a.PNG", 1, "train", True, 12),
        ("train/dog/b.jpg", 1, "train", True, 12),
        ("val/emu/e.jpeg", 2, "val", True, 10),
    ]
    again = ingest_imagefolder(engine, dataset="pets", root=tmp_path)
    assert (again.inserted, again.already_present) == (0, 4)


def test_imagefolder_with_a_split_reads_classes_directly_under_the_root(
    engine: Engine, tmp_path: Path
) -> None:
    """root/<class>/* with split given: keys are relative to the root."""
    make_tree(tmp_path, {"b": ["1.jpg"], "a": ["2.jpg"]})
    ingest_imagefolder(engine, dataset="ds", root=tmp_path, split="test")
    assert [(r.key, r.label, r.split) for r in sample_rows(engine)] == [
        ("a/2.jpg", 0, "test"),
        ("b/1.jpg", 1, "test"),
    ]
    assert dataset_attrs(engine, "ds") == {"classes": ["a", "b"]}


def test_imagefolder_rejects_a_class_added_by_a_later_ingest(
    engine: Engine, tmp_path: Path
) -> None:
    """Labels never change meaning: a subset of the classes is fine, a new class is not."""
    make_tree(tmp_path, {"train/a": ["1.jpg"], "train/b": ["2.jpg"], "train/c": ["3.jpg"]})
    ingest_imagefolder(engine, dataset="ds", root=tmp_path)
    make_tree(tmp_path, {"val/c": ["4.jpg"]})
    (tmp_path / "train" / "a" / "1.jpg").unlink()
    (tmp_path / "train" / "a").rmdir()
    subset = ingest_imagefolder(engine, dataset="ds", root=tmp_path)
    assert subset.inserted == 1
    assert [(r.key, r.label) for r in sample_rows(engine)][-1] == ("val/c/4.jpg", 2)

    make_tree(tmp_path, {"val/zebra": ["5.jpg"]})
    with pytest.raises(DataError, match=r"\['zebra'\] would add classes"):
        ingest_imagefolder(engine, dataset="ds", root=tmp_path)
    assert dataset_attrs(engine, "ds") == {"classes": ["a", "b", "c"]}
    assert len(sample_rows(engine)) == 4


def test_imagefolder_without_images_explains_the_layouts(engine: Engine, tmp_path: Path) -> None:
    """Pointing at the wrong level of a tree says which layout was expected."""
    make_tree(tmp_path, {"cat": ["1.jpg"]})
    with pytest.raises(DataError, match="pass --split"):
        ingest_imagefolder(engine, dataset="ds", root=tmp_path)
    assert table_counts(engine) == (0, 0)


def test_a_uri_root_is_stored_as_given_and_with_no_verify_its_rows_trusted(
    engine: Engine, tmp_path: Path
) -> None:
    """An s3:// root is stored without its trailing slash; --no-verify trusts the manifest
    without asking the store (verification by listing: tests/e2e/test_object_store.py)."""
    manifest = write_jsonl(tmp_path / "m.jsonl", [{"path": "a.jpg", "split": "train"}])
    report = ingest_manifest(
        engine, dataset="ds", root="s3://bucket/data/", manifest=manifest, verify=False
    )
    assert report.dataset.root == "s3://bucket/data"
    assert [(r.is_verified, r.byte_size) for r in sample_rows(engine)] == [(True, None)]


@pytest.fixture(scope="module")
def store() -> Iterator[ThrowawayS3]:
    """A throwaway object store holding one 100-byte object under ``s3://ingest/data``."""
    with throwaway_s3() as server:
        server.create_bucket("ingest")
        obstore.put(server.store("ingest"), "data/a.bin", bytes(100))
        yield server


@pytest.mark.slow(seconds=10)
def test_a_manifest_under_an_s3_root_is_verified_against_the_listing_as_against_a_disk(
    store: ThrowawayS3, sqlite_engine: Engine, tmp_path: Path
) -> None:
    """A missing object's row is written unverified and counted, a present one gets its
    size; a byte range past the end of an object is an error naming its URL."""
    rows = [{"path": "a.bin", "split": "train"}, {"path": "gone.bin", "split": "train"}]
    past = [{"path": "a.bin", "split": "train", "byte_offset": 90, "byte_length": 20}]
    with store_env(store):
        report = ingest_manifest(
            sqlite_engine,
            dataset="ds",
            root="s3://ingest/data",
            manifest=write_jsonl(tmp_path / "m.jsonl", rows),
        )
        assert (report.inserted, report.unverified, report.missing_paths) == (2, 1, ("gone.bin",))
        got = [(r.path, r.is_verified, r.byte_size) for r in sample_rows(sqlite_engine)]
        assert got == [("a.bin", True, 100), ("gone.bin", False, None)]
        with pytest.raises(
            DataError,
            match=r"line 1: .*past the end of s3://ingest/data/a\.bin \(100 bytes\); the byte "
            "range must lie inside the object",
        ):
            ingest_manifest(
                sqlite_engine,
                dataset="past",
                root="s3://ingest/data",
                manifest=write_jsonl(tmp_path / "past.jsonl", past),
            )
