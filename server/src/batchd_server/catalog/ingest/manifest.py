"""Ingest a JSONL or CSV manifest: one row of it, one sample, its file under the root
(stat-ed, or listed in the object store, unless the manifest is trusted)."""

from __future__ import annotations

from pathlib import Path

from sqlalchemy.engine import Engine

from batchd_server.catalog.ingest.load import IngestReport, Source, Target, load, resolve_root
from batchd_server.catalog.manifest import (
    SPLIT_MAX_CHARS,
    RowChecker,
    RowVerifier,
    Verifier,
    check_name,
    read_csv,
    read_jsonl,
    trusted,
)
from batchd_server.catalog.object_roots import ObjectListing, ObjectVerifier
from batchd_server.errors import DataError
from batchd_server.storage.options import DEFAULT_RETRY_S

__all__ = ["ingest_manifest"]


def ingest_manifest(
    engine: Engine,
    *,
    dataset: str,
    version: str = "1",
    root: str | Path,
    manifest: str | Path,
    split: str | None = None,
    verify: bool = True,
    description: str | None = None,
    object_store_retry_s: float = DEFAULT_RETRY_S,
) -> IngestReport:
    """Add the rows of a JSONL (``.jsonl``/``.ndjson``) or CSV (``.csv``) manifest.

    Fields: ``path`` (required, relative to ``root``), ``split`` (required unless ``split``
    gives a default), and optionally ``key`` (default: the path, or ``path@byte_offset`` for
    a byte range), ``label``, ``length``, ``weight``, ``byte_offset`` + ``byte_length``,
    ``attrs`` (a JSON object). A key the dataset already has is left unchanged.

    Args:
        verify: stat each file under ``root``: rows with a missing file are written with
            ``is_verified`` false; a byte range past the end of its file is an error.
            ``False`` trusts the manifest: nothing is read, every row is verified, and
            ``byte_size`` is ``byte_length`` (or unknown).

    Raises:
        DataError: a bad row (the message names file, line, field and value; nothing is
            written), a missing root, or (dataset, version) already rooted elsewhere.
    """
    file = str(manifest)
    path = Path(manifest).expanduser()
    suffix = path.suffix.lower()
    if suffix not in (".jsonl", ".ndjson", ".csv"):
        raise DataError(f"manifest {file!r} must end in .jsonl, .ndjson or .csv")
    if not path.is_file():
        raise DataError(f"manifest {file!r} does not exist or is not a file")
    if split is not None:
        check_name("split", split, SPLIT_MAX_CHARS)
    stored_root, local_root = resolve_root(root, must_exist=verify)
    checker = RowChecker(file, split)
    verifier: RowVerifier | None = None
    if verify:
        if local_root is not None:
            verifier = Verifier(local_root, file)
        else:
            listing = ObjectListing(stored_root, retry_s=object_store_retry_s)
            verifier = ObjectVerifier(listing, file)
    with path.open(encoding="utf-8-sig", newline="" if suffix == ".csv" else None) as f:
        parsed = read_csv(f, checker) if suffix == ".csv" else read_jsonl(f, checker)
        rows = map(verifier.verify, parsed) if verifier else trusted(parsed)
        try:
            return load(
                engine,
                Target(dataset, version, description),
                Source(
                    root=stored_root,
                    rows=rows,
                    file=file,
                    missing=verifier,
                ),
            )
        except UnicodeDecodeError as e:
            raise DataError(f"{file}: not UTF-8 text ({e.reason} at byte {e.start})") from e
