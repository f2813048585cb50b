"""WebDataset tar shards as catalog rows: read the headers, group members into samples.

A WebDataset shard is an uncompressed tar whose members are named ``<key>.<ext>``: the
members that share a key (the path up to the first dot of its last component) are one
sample. Nothing is extracted: each sample becomes one catalog row whose ``path`` is the shard
and whose byte range is its *payload* member's data inside the tar (the image, ``.npy`` or
token file), so the decode pipelines read it like any other byte range. The label comes from
a ``.cls`` member (an integer), a ``.json`` member (the field ``label_key``) or a ``.txt``
member holding an integer. The payload is the first member in tar order that is not one of
those; ``attrs["payload"]`` is its extension and ``attrs["members"]`` lists the sample's
other members with their byte ranges (a sample of several fields reads each from there:
``catalog/members.py``).

Only headers and the small label members are read: ``tarfile`` in seekable mode skips every
member's data with a seek. A shard that is compressed (gzip, bzip2, xz, zstd) is refused: a
byte range inside compressed data cannot be read without decompressing everything before it.
A sample that cannot be cataloged (no payload, a bad label, data past the end
of a truncated shard) is skipped and described in ``skipped``; the rest of the shard goes in.
"""

from __future__ import annotations

import glob
import json
import os
import re
import tarfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path, PurePath, PurePosixPath
from typing import IO, Any, Final

from batchd_server.catalog.manifest import Row
from batchd_server.errors import DataError

__all__ = [
    "LABEL_EXTENSIONS",
    "Shard",
    "TarSamples",
    "expand_braces",
    "expand_shards",
    "local_shards",
    "split_from_name",
]

LABEL_EXTENSIONS: Final = ("cls", "json", "txt")
"""Members that hold a label or metadata, never a payload."""
_MAX_LABEL_BYTES: Final = 1 << 16
_SPLIT_WORDS: Final = {"train": "train", "val": "val", "valid": "val", "validation": "val"} | {
    "test": "test"
}
_COMPRESSED: Final = (
    (b"\x1f\x8b", "gzip", "gunzip -k"),
    (b"BZh", "bzip2", "bunzip2 -k"),
    (b"\xfd7zXZ\x00", "xz", "unxz -k"),
    (b"\x28\xb5\x2f\xfd", "zstd", "unzstd"),
)
_BRACES: Final = re.compile(r"\{([^{}]*)\}")


def expand_shards(patterns: list[str], root: Path) -> list[Path]:
    """The shard files that ``patterns`` name, in order, each once.

    A pattern may hold brace ranges and lists (``shard-{000..099}.tar``, ``{train,val}``) and
    glob wildcards; a relative pattern is relative to ``root``.

    Raises:
        DataError: a pattern matches no file.
    """
    found: dict[Path, None] = {}
    for pattern in patterns:
        matched = []
        for expanded in expand_braces(pattern):
            full = expanded if os.path.isabs(expanded) else str(root / expanded)
            hits = sorted(glob.glob(full)) if glob.has_magic(full) else [full]
            matched += [Path(h) for h in hits if os.path.isfile(h)]
        if not matched:
            raise DataError(
                f"shard pattern {pattern!r} matches no file (relative patterns are relative to "
                f"--root {root})"
            )
        found.update(dict.fromkeys(p.resolve() for p in matched))
    return list(found)


def expand_braces(pattern: str) -> list[str]:
    """``pattern`` with its brace ranges and lists expanded, in order."""
    match = _BRACES.search(pattern)
    if match is None:
        return [pattern]
    body, head, tail = match.group(1), pattern[: match.start()], pattern[match.end() :]
    numeric = re.fullmatch(r"(-?\d+)\.\.(-?\d+)", body)
    if numeric:
        first, last = numeric.groups()
        width = len(first) if first.startswith("0") and len(first) > 1 else 0
        step = 1 if int(last) >= int(first) else -1
        options = [str(i).zfill(width) for i in range(int(first), int(last) + step, step)]
    else:
        options = body.split(",")
    return [out for option in options for out in expand_braces(head + option + tail)]


def split_from_name(shard: PurePath) -> str | None:
    """``train``/``val``/``test`` when the shard's name says so (``imagenet-train-0001.tar``)."""
    words = re.split(r"[-_.]", shard.name.lower())
    found = {_SPLIT_WORDS[w] for w in words if w in _SPLIT_WORDS}
    return found.pop() if len(found) == 1 else None


@dataclass(frozen=True)
class Shard:
    """One shard to read: a local file or an object (``catalog/object_roots.py``)."""

    rel: str
    """Its path relative to the dataset root, as the catalog records it."""
    where: str
    """The file's path or the object's URL, for messages."""
    open: Callable[[], IO[bytes]]
    """Opens it for seekable binary reads."""
    size: int | None = None
    """Its size in bytes; None: ask the opened file."""

    @property
    def name(self) -> str:
        return PurePosixPath(self.rel).name


def local_shards(root: Path, paths: list[Path]) -> list[Shard]:
    """Shard files under the local directory ``root``.

    Raises:
        DataError: a shard is not under ``root``.
    """
    shards = []
    for path in paths:
        if not path.is_relative_to(root):
            raise DataError(f"shard {path} is not under --root {root}")
        rel = path.relative_to(root).as_posix()
        shards.append(Shard(rel, str(path), _opener(path)))
    return shards


def _opener(path: Path) -> Callable[[], IO[bytes]]:
    def open_shard() -> IO[bytes]:
        return path.open("rb")

    return open_shard


def _refuse_compressed(shard: Shard) -> None:
    with shard.open() as f:
        magic = f.read(6)
    for prefix, kind, command in _COMPRESSED:
        if magic.startswith(prefix):
            raise DataError(
                f"{shard.where} is a {kind}-compressed tar; samples are read as byte ranges of "
                f"the shard, which needs an uncompressed tar. Recompress it uncompressed "
                f"({command} {shard.name}, or tar -cf) and ingest the .tar"
            )


@dataclass
class _Sample:
    key: str
    members: dict[str, tuple[int, int]] = field(default_factory=dict)
    """extension -> (data offset, size) in the tar."""
    problems: list[str] = field(default_factory=list)


@dataclass
class TarSamples:
    """The rows of a set of shards; ``skipped`` fills in as ``rows()`` is consumed.

    Args:
        shards: The shards, local files or objects.
        split: The split of every sample; None takes it from each shard's name.
        label_key: The field of a ``.json`` member that holds the label.
        progress: Called after each shard with (shards done, shards, samples so far).
    """

    shards: list[Shard]
    split: str | None = None
    label_key: str = "label"
    progress: Callable[[int, int, int], None] | None = None
    skipped: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        for shard in self.shards:
            if self.split is None and split_from_name(PurePosixPath(shard.rel)) is None:
                raise DataError(
                    f"cannot tell the split of shard {shard.name} from its name (no single "
                    "train/val/test word in it); pass --split"
                )
            _refuse_compressed(shard)

    def rows(self) -> Iterator[Row]:
        line = 0
        for done, shard in enumerate(self.shards, 1):
            rel = shard.rel
            split = self.split or split_from_name(PurePosixPath(rel))
            with shard.open() as f:
                for sample in self._samples(shard, f):
                    row = self._row(rel, split, sample, f)
                    if row is not None:
                        line += 1
                        yield (line, *row)
            if self.progress is not None:
                self.progress(done, len(self.shards), line)

    def _samples(self, shard: Shard, f: Any) -> Iterator[_Sample]:
        """The shard's samples in tar order (WebDataset keeps a sample's members together)."""
        size = shard.size if shard.size is not None else os.fstat(f.fileno()).st_size
        current: _Sample | None = None
        try:
            with tarfile.open(fileobj=f, mode="r:") as tar:
                for member in tar:
                    if member.isdir():
                        continue
                    where = f"{shard.name}: member {member.name!r}"
                    if not member.isreg():
                        self.skipped.append(f"{where}: not a regular file; skipped")
                        continue
                    key, ext = _split_name(member.name)
                    if current is None or current.key != key:
                        if current is not None:
                            yield current
                        current = _Sample(key)
                    if not ext:
                        current.problems.append(f"{where} has no extension")
                    elif ext in current.members:
                        current.problems.append(f"{where} repeats extension .{ext}")
                    elif member.offset_data + member.size > size:
                        current.problems.append(
                            f"{where} ends at byte {member.offset_data + member.size}, past the "
                            f"end of the shard ({size} bytes): the shard is truncated"
                        )
                    else:
                        current.members[ext] = (member.offset_data, member.size)
        except tarfile.TarError as e:
            self.skipped.append(
                f"{shard.name}: unreadable after byte {f.tell()} ({e}); the rest of the shard "
                "was skipped"
            )
        if current is not None:
            yield current

    def _row(self, rel: str, split: str | None, sample: _Sample, f: Any) -> Row | None:
        where = f"{rel}: sample {sample.key!r}"
        payloads = [e for e in sample.members if e.split(".")[-1] not in LABEL_EXTENSIONS]
        problems = list(sample.problems)
        if not payloads:
            found = ", ".join(f".{e}" for e in sample.members) or "nothing"
            problems.append(f"needs a payload member besides .cls/.json/.txt; has {found}")
        label = None
        if not problems:
            try:
                label = self._label(sample, f)
            except ValueError as e:
                problems.append(str(e))
        if problems:
            self.skipped.append(f"{where}: {'; '.join(problems)}; skipped")
            return None
        offset, length = sample.members[payloads[0]]
        # Every member's range (the payload's is the row's own): what a session of several
        # fields reads each field from (``catalog/members.py``).
        others = {e: [o, n] for e, (o, n) in sample.members.items() if e != payloads[0]}
        attrs = json.dumps({"payload": payloads[0], "members": others})
        key = f"{rel}#{sample.key}"
        return (key, rel, offset, length, label, split, None, 1.0, attrs, True, length)

    def _label(self, sample: _Sample, f: Any) -> int | None:
        for ext in LABEL_EXTENSIONS:
            if ext not in sample.members:
                continue
            offset, size = sample.members[ext]
            if size > _MAX_LABEL_BYTES:
                raise ValueError(
                    f".{ext} holds {size} bytes, more than a label's {_MAX_LABEL_BYTES}"
                )
            f.seek(offset)
            text = f.read(size).decode("utf-8", "replace").strip()
            if ext == "json":
                try:
                    value = json.loads(text).get(self.label_key)
                except (ValueError, AttributeError):
                    raise ValueError(".json is not a JSON object") from None
                if value is None:
                    continue
            elif ext == "txt" and not re.fullmatch(r"-?\d+", text):
                continue  # a caption, not a label
            else:
                value = text
            try:
                return int(value)
            except (TypeError, ValueError):
                raise ValueError(f".{ext} label {value!r} is not an integer") from None
        return None


def _split_name(name: str) -> tuple[str, str]:
    """WebDataset's split of a member name: key = up to the first dot of the last path
    component, extension = the rest (``a/b.x.jpg`` -> ``a/b``, ``x.jpg``)."""
    directory, _, base = name.rpartition("/")
    stem, _, ext = base.partition(".")
    return (f"{directory}/{stem}" if directory else stem), ext.lower()
