"""The synthetic demo dataset: real JPEGs, varied sizes, deterministic, idempotent."""

from __future__ import annotations

from pathlib import Path

from PIL import Image

from batchd_server.demo_data import class_names, write_demo_images


def jpeg_files(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*.jpg"))}


def test_demo_data_writes_n_decodable_jpegs_of_varied_sizes_in_split_and_class_dirs(
    tmp_path: Path,
) -> None:
    """N JPEGs under train/ and val/, one folder per class, sides 160-640 px, mixed shapes."""
    info = write_demo_images(tmp_path, 40, classes=4)
    files = sorted(tmp_path.rglob("*.jpg"))
    assert len(files) == 40 == info["images"] == info["written"]
    assert info["splits"] == {"train": 32, "val": 8}
    assert {p.parent.parent.name for p in files} == {"train", "val"}
    assert {p.parent.name for p in files} == set(class_names(4)) == set(info["classes"])
    for split in ("train", "val"):
        assert sorted(p.name for p in (tmp_path / split).iterdir()) == class_names(4)
    sizes = set()
    for path in files:
        with Image.open(path) as im:
            assert im.format == "JPEG"
            im.load()
            assert min(im.size) >= 160 and max(im.size) <= 640
            sizes.add(im.size)
    assert len(sizes) > 30
    assert len({round(w / h, 1) for w, h in sizes}) > 5


def test_demo_data_is_deterministic_and_idempotent(tmp_path: Path) -> None:
    """Same seed gives the same bytes anywhere; a re-run rewrites nothing; a new seed differs."""
    first = write_demo_images(tmp_path / "a", 10, seed=3)
    rerun = write_demo_images(tmp_path / "a", 10, seed=3)
    assert (first["written"], rerun["written"]) == (10, 0)
    write_demo_images(tmp_path / "b", 10, seed=3)
    write_demo_images(tmp_path / "c", 10, seed=4)
    a, b, c = (jpeg_files(tmp_path / d) for d in "abc")
    assert a == b
    assert a.keys() == c.keys() and all(a[k] != c[k] for k in a)


def test_class_names_sort_in_label_order() -> None:
    """Directory names sort the way their labels count, so imagefolder labels match."""
    names = class_names(12)
    assert names == sorted(names) and len(set(names)) == 12
