"""Ingest an image-folder tree: ``ROOT/<split>/<class>/<image>`` (or ``ROOT/<class>/<image>``
with a split given), on a local disk or in an object store; the class names become the
dataset's class list."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

from sqlalchemy.engine import Engine

from batchd_server.catalog.ingest.load import IngestReport, Source, Target, load, resolve_root
from batchd_server.catalog.manifest import SPLIT_MAX_CHARS, Row, Verifier, check_name
from batchd_server.catalog.object_roots import ObjectListing, iter_object_rows, object_images
from batchd_server.errors import DataError
from batchd_server.storage.options import DEFAULT_RETRY_S

__all__ = ["IMAGE_SUFFIXES", "ingest_imagefolder", "local_files"]

IMAGE_SUFFIXES = frozenset({".jpg", ".jpeg", ".png", ".webp"})


def _subdirs(path: Path, verifier: Verifier) -> list[str]:
    names = []
    for entry in os.scandir(path):
        if entry.name.startswith(".") or not entry.is_dir():
            continue
        if not verifier.inside(os.path.realpath(entry.path)):
            raise DataError(f"{entry.path} resolves outside --root {verifier.root} (a symlink)")
        names.append(entry.name)
    return sorted(names)


def _images(
    path: Path, verifier: Verifier, suffixes: frozenset[str] = IMAGE_SUFFIXES
) -> list[tuple[str, int]]:
    found = []
    for entry in os.scandir(path):
        name = entry.name
        if os.path.splitext(name)[1].lower() not in suffixes or not entry.is_file():
            continue
        if entry.is_symlink() and not verifier.inside(os.path.realpath(entry.path)):
            raise DataError(f"{entry.path} resolves outside --root {verifier.root} (a symlink)")
        found.append((name, entry.stat().st_size))
    found.sort()
    return found


def local_files(
    verifier: Verifier, split: str | None, suffixes: frozenset[str]
) -> list[tuple[str, str, str, int]]:
    """(split, class, path relative to the root, size) of the files with ``suffixes`` in a
    class-per-directory tree under ``verifier.root`` (``<split>/<class>/<file>``, or
    ``<class>/<file>`` with ``split``), sorted by split, class and name.

    Raises:
        DataError: a split directory name too long, or a symlink out of the root.
    """
    local = Path(verifier.root)
    splits = [split] if split is not None else _subdirs(local, verifier)
    found = []
    for s in splits:
        if len(s) > SPLIT_MAX_CHARS:
            raise DataError(f"split directory {s!r} is longer than {SPLIT_MAX_CHARS} characters")
        base = local if split is not None else local / s
        for c in _subdirs(base, verifier):
            prefix = os.path.relpath(base / c, local) + "/"
            found += [
                (s, c, prefix + name, size) for name, size in _images(base / c, verifier, suffixes)
            ]
    return found


def _no_images(root: str, split: str | None) -> str:
    layout = "root/<class>/<image>" if split else "root/<split>/<class>/<image>"
    hint = "" if split else "; for root/<class>/<image>, pass --split"
    return f"no .jpg/.jpeg/.png/.webp images found in {root} as {layout}{hint}"


def ingest_imagefolder(
    engine: Engine,
    *,
    dataset: str,
    version: str = "1",
    root: str | Path,
    split: str | None = None,
    description: str | None = None,
    object_store_retry_s: float = DEFAULT_RETRY_S,
) -> IngestReport:
    """Add the images of a class-per-directory tree.

    Without ``split`` the tree is ``root/<split>/<class>/<image>``; with it, the whole tree is
    that split: ``root/<class>/<image>``. Images are .jpg .jpeg .png .webp (any case); other
    files and hidden directories are ignored. Labels index the sorted class names (the union
    over the splits ingested), stored as ``datasets.attrs["classes"]``; a later ingest may use
    a subset of that list but never add to it. Keys are paths relative to ``root``.

    Raises:
        DataError: no images, a class the dataset does not have, a symlink out of ``root``,
            or (dataset, version) already rooted elsewhere.
    """
    stored_root, local = resolve_root(root, must_exist=True)
    if split is not None:
        check_name("split", split, SPLIT_MAX_CHARS)
    if local is None:
        listing = ObjectListing(stored_root, retry_s=object_store_retry_s)
        images = object_images(listing, split, IMAGE_SUFFIXES)
        return load(
            engine,
            Target(dataset, version, description),
            Source(
                root=stored_root,
                rows=iter_object_rows(images),
                empty=_no_images(stored_root, split),
                classes=sorted({c for _, c, _, _ in images}),
            ),
        )
    files = local_files(Verifier(local, stored_root), split, IMAGE_SUFFIXES)

    def rows() -> Iterator[Row]:
        for line, (s, c, rel, size) in enumerate(files, 1):
            # The label column holds the class name until load maps it to its index.
            yield (line, rel, rel, None, None, c, s, None, 1.0, None, True, size)

    return load(
        engine,
        Target(dataset, version, description),
        Source(
            root=stored_root,
            rows=rows(),
            empty=_no_images(stored_root, split),
            classes=sorted({c for _, c, _, _ in files}),
        ),
    )
