"""Ingest a video or audio folder tree: ``ROOT/<split>/<class>/<file>`` (or
``ROOT/<class>/<file>`` with a split given), on a local disk or in an object store, as image
folders are; each file is probed (its header read with PyAV) for what a plan needs.

Each sample's ``length`` is its duration in milliseconds, so sampling ``"bucketed"`` groups
files of similar duration; its ``attrs`` hold what the probe found:
``{"video": {"duration_s", "fps", "frames", "width", "height"}}`` or
``{"audio": {"duration_s", "sample_rate", "channels"}}``. A file that does not probe (not
media, no stream of the kind, no duration) is left out and listed in the report's
``skipped``.

Probing opens each file's header only (a local file by its path; an object is read whole,
within ``--max-sample-bytes``), in worker processes when there are many.
"""

from __future__ import annotations

import dataclasses
import json
import multiprocessing
import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, Final

from sqlalchemy.engine import Engine

from batchd_server.catalog.ingest.imagefolder import local_files
from batchd_server.catalog.ingest.load import IngestReport, Source, Target, load, resolve_root
from batchd_server.catalog.manifest import SPLIT_MAX_CHARS, Row, Verifier, check_name
from batchd_server.catalog.object_roots import ObjectListing, object_images
from batchd_server.errors import DataError
from batchd_server.storage.options import DEFAULT_RETRY_S

__all__ = [
    "AUDIO_SUFFIXES",
    "VIDEO_SUFFIXES",
    "ingest_audiofolder",
    "ingest_videofolder",
    "probe",
]

VIDEO_SUFFIXES: Final = frozenset({".mp4", ".m4v", ".mov", ".mkv", ".webm", ".avi"})
AUDIO_SUFFIXES: Final = frozenset({".wav", ".flac", ".mp3", ".ogg", ".opus", ".m4a", ".aac"})
_IN_PROCESS_FILES: Final = 64
"""Fewer files than this are probed in the ingest's own process (a pool costs a second)."""
_CHUNK_FILES: Final = 32

Progress = Callable[[int, int, int], None]
Probed = tuple[int, dict[str, Any]] | str
"""``(length in ms, attrs)``, or why the file has none."""


def probe(source: Any, kind: str) -> Probed:
    """What ingest records of one media file (a path or a file-like object)."""
    import av

    from batchd_server.pipelines.audio import probe_seconds
    from batchd_server.pipelines.video import probe_rate

    try:
        with av.open(source, mode="r", metadata_errors="ignore") as container:
            streams = container.streams.video if kind == "video" else container.streams.audio
            if not streams:
                return f"no {kind} stream"
            stream: Any = streams[0]
            seconds = probe_seconds(container, stream)
            if kind == "video":
                rate = probe_rate(stream)
                frames = int(stream.frames or 0) or round(seconds * rate)
                if not seconds and rate:
                    seconds = frames / rate
                ctx = stream.codec_context
                found = {"duration_s": seconds, "fps": rate, "frames": frames}
                found.update(width=ctx.width, height=ctx.height)
            else:
                found = {"duration_s": seconds, "sample_rate": stream.rate}
                found["channels"] = stream.channels
    except Exception as e:  # FFmpeg's errors on hostile bytes are many kinds
        return f"not {kind} FFmpeg can read ({type(e).__name__}: {e})"
    if not seconds > 0:
        return f"no {kind} duration in its header (empty?)"
    return round(seconds * 1000), {kind: found}


_READ: Any = None


def _start(root: str) -> None:
    global _READ
    if Path(root).is_absolute():
        _READ = None
    else:
        from batchd_server.storage.open import open_reader

        _READ = open_reader(root)


def _probe_chunk(task: tuple[str, str, list[str]]) -> list[Probed]:
    root, kind, paths = task
    if _READ is None:
        return [probe(os.path.join(root, p), kind) for p in paths]
    import io

    found: list[Probed] = []
    for path in paths:
        try:
            data = _READ.read(path)
        except Exception as e:  # BadSample and store errors: the file is left out, named
            found.append(f"cannot be read ({e})")
            continue
        found.append(probe(io.BytesIO(data), kind))
    return found


def _probed(
    root: str, kind: str, paths: list[str], workers: int | None, progress: Progress | None
) -> Iterator[Probed]:
    chunks = [paths[i : i + _CHUNK_FILES] for i in range(0, len(paths), _CHUNK_FILES)]
    done = 0
    if len(paths) < _IN_PROCESS_FILES:
        _start(root)
        results: Iterator[list[Probed]] = (_probe_chunk((root, kind, c)) for c in chunks)
        pool = None
    else:
        # spawn: this process may hold threads (the object store's) and a database connection.
        context = multiprocessing.get_context("spawn")
        pool = context.Pool(workers or len(os.sched_getaffinity(0)), _start, (root,))
        results = pool.imap(_probe_chunk, [(root, kind, c) for c in chunks])
    try:
        for chunk in results:
            done += len(chunk)
            if progress is not None:
                progress(done, len(paths), done)
            yield from chunk
    finally:
        if pool is not None:
            pool.terminate()
            pool.join()


def _ingest(
    engine: Engine,
    kind: str,
    suffixes: frozenset[str],
    *,
    dataset: str,
    version: str,
    root: str | Path,
    split: str | None,
    description: str | None,
    workers: int | None,
    progress: Progress | None,
    object_store_retry_s: float,
) -> IngestReport:
    stored_root, local = resolve_root(root, must_exist=True)
    if split is not None:
        check_name("split", split, SPLIT_MAX_CHARS)
    if local is None:
        listing = ObjectListing(stored_root, retry_s=object_store_retry_s)
        files = object_images(listing, split, suffixes)
    else:
        files = local_files(Verifier(local, stored_root), split, suffixes)
    skipped: list[str] = []
    listed = sorted(suffixes)
    layout = "root/<class>/<file>" if split else "root/<split>/<class>/<file>"
    empty = f"no {kind} files ({', '.join(listed)}) found in {stored_root} as {layout}"

    def rows() -> Iterator[Row]:
        probed = _probed(stored_root, kind, [f[2] for f in files], workers, progress)
        line = 0
        for (s, c, rel, size), found in zip(files, probed, strict=True):
            if isinstance(found, str):
                skipped.append(f"{rel}: {found}")
                continue
            line += 1
            length, attrs = found
            # The label column holds the class name until load maps it to its index.
            yield (line, rel, rel, None, None, c, s, length, 1.0, json.dumps(attrs), True, size)

    if not files:
        raise DataError(empty if split else f"{empty}; for root/<class>/<file>, pass --split")
    report = load(
        engine,
        Target(dataset, version, description),
        Source(
            root=stored_root,
            rows=rows(),
            empty=f"none of the {len(files)} {kind} files under {stored_root} could be probed",
            classes=sorted({c for _, c, _, _ in files}),
        ),
    )
    return dataclasses.replace(report, skipped=tuple(skipped))


def ingest_videofolder(
    engine: Engine,
    *,
    dataset: str,
    version: str = "1",
    root: str | Path,
    split: str | None = None,
    description: str | None = None,
    workers: int | None = None,
    progress: Progress | None = None,
    object_store_retry_s: float = DEFAULT_RETRY_S,
) -> IngestReport:
    """Add the videos (.mp4 .m4v .mov .mkv .webm .avi) of a class-per-directory tree, each with
    its duration, frame rate, frame count and size (see the module docstring); labels as
    :func:`~batchd_server.catalog.ingest.imagefolder.ingest_imagefolder`'s.

    Raises:
        DataError: no videos, a class the dataset does not have, a symlink out of ``root``,
            or (dataset, version) already rooted elsewhere.
    """
    return _ingest(
        engine,
        "video",
        VIDEO_SUFFIXES,
        dataset=dataset,
        version=version,
        root=root,
        split=split,
        description=description,
        workers=workers,
        progress=progress,
        object_store_retry_s=object_store_retry_s,
    )


def ingest_audiofolder(
    engine: Engine,
    *,
    dataset: str,
    version: str = "1",
    root: str | Path,
    split: str | None = None,
    description: str | None = None,
    workers: int | None = None,
    progress: Progress | None = None,
    object_store_retry_s: float = DEFAULT_RETRY_S,
) -> IngestReport:
    """Add the audio files (.wav .flac .mp3 .ogg .opus .m4a .aac) of a class-per-directory
    tree, each with its duration, sample rate and channels (see the module docstring).

    Raises:
        DataError: as :func:`ingest_videofolder`.
    """
    return _ingest(
        engine,
        "audio",
        AUDIO_SUFFIXES,
        dataset=dataset,
        version=version,
        root=root,
        split=split,
        description=description,
        workers=workers,
        progress=progress,
        object_store_retry_s=object_store_retry_s,
    )
