"""Reading and checking manifest rows, and verifying their files under a dataset root.

Everything here is pure Python over text and the filesystem; ``ingest/`` streams the rows it
yields into the database. Every problem is a :class:`~batchd_server.errors.DataError` naming
the file, the line, the field and the value, and saying what is allowed.
"""

from __future__ import annotations

import contextlib
import csv
import json
import logging
import os
import stat
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

from batchd_server.catalog.schema import datasets, samples
from batchd_server.errors import DataError, InvalidArgument
from batchd_server.limits import INT64_MAX
from batchd_server.storage.paths import path_problem

__all__ = [
    "DATASET_NAME_MAX_CHARS",
    "MANIFEST_FIELDS",
    "SPLIT_MAX_CHARS",
    "VERSION_MAX_CHARS",
    "Row",
    "RowChecker",
    "RowVerifier",
    "Verifier",
    "check_name",
    "read_csv",
    "read_jsonl",
    "trusted",
]

log = logging.getLogger(__name__)

MANIFEST_FIELDS = frozenset(
    {"path", "key", "label", "split", "length", "weight", "byte_offset", "byte_length", "attrs"}
)
_STAT_CACHE_MAX = 200_000
"""Distinct paths whose size is remembered; shard files repeat, image files do not."""
_MISSING_EXAMPLES = 5
_INT32_MAX = 2**31 - 1
_INT64_MIN = -(2**63)
# Column widths come from the schema, so a migration that widens one widens the check.
SPLIT_MAX_CHARS: int = samples.c.split.type.length  # type: ignore[attr-defined]
DATASET_NAME_MAX_CHARS: int = datasets.c.name.type.length  # type: ignore[attr-defined]
VERSION_MAX_CHARS: int = datasets.c.version.type.length  # type: ignore[attr-defined]
_FLOAT_MAX = 1.7976931348623157e308

# A row as staged for the database, in ingest._STAGE_COLUMNS order.
Row = tuple[Any, ...]


# --------------------------------------------------------------------------- validation


def _show(value: object) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def _bad(where: str, field: str, value: object, allowed: str) -> DataError:
    return DataError(f"{where}: {field}={_show(value)} is not valid; {allowed}")


def check_name(what: str, value: str, max_chars: int) -> None:
    if not isinstance(value, str) or not value or len(value) > max_chars or "\x00" in value:
        raise InvalidArgument(
            f"{what}={_show(value)} must be a non-empty string of at most {max_chars} characters"
        )


_path_problem = path_problem
"""Why a path cannot name a file under a dataset root: the one rule, ``storage/paths.py``."""


_ALLOWED = {
    "path": "path must be a string",
    "key": "key must be a non-empty string",
    "label": "label must be an integer or null",
    "split": f"split must be a non-empty string of at most {SPLIT_MAX_CHARS} characters",
    "length": f"length must be an integer from 0 to {_INT32_MAX}, or null",
    "weight": "weight must be a finite number >= 0 (default 1.0)",
    "byte_offset": "byte_offset and byte_length must be given together, as integers >= 0",
    "byte_length": "byte_offset and byte_length must be given together, as integers >= 0",
    "attrs": "attrs must be a JSON object (in CSV: a JSON object as a string) or null",
}


class RowChecker:
    """Validates one manifest row's typed values and builds its staged row (minus the
    verification columns). JSON values arrive as parsed; CSV values are converted first.

    The checks are inlined and cheap because they run once per row of manifests with
    millions of rows; :meth:`_fail` explains whatever failed.
    """

    def __init__(self, file: str, default_split: str | None) -> None:
        self.file = file
        self.default_split = default_split
        self._splits: set[str] = set()

    def _fail(self, line: int, field: str, value: object, why: str | None = None) -> DataError:
        where = f"{self.file}, line {line}"
        if value is None and field == "path":
            return DataError(f"{where}: path is missing; every row needs a path under --root")
        if value is None and field == "split":
            return DataError(
                f"{where}: split is missing; give every row a split, or a default with --split"
            )
        return _bad(where, field, value, why or _ALLOWED[field])

    def __call__(self, line: int, get: Callable[[str], Any]) -> Row:
        """Check the row whose field values ``get(name)`` returns (None when absent)."""
        path, key, label, split = get("path"), get("key"), get("label"), get("split")
        length, weight, attrs = get("length"), get("weight"), get("attrs")
        byte_offset, byte_length = get("byte_offset"), get("byte_length")
        if type(path) is not str or _path_problem(path):
            why = _path_problem(path) if type(path) is str else None
            raise self._fail(line, "path", path, why)
        if byte_offset is not None or byte_length is not None:
            if byte_offset is None or byte_length is None:
                given = "byte_offset" if byte_length is None else "byte_length"
                other = "byte_length" if byte_length is None else "byte_offset"
                raise DataError(
                    f"{self.file}, line {line}: {given}={_show(get(given))} is given without "
                    f"{other}; {_ALLOWED[given]}"
                )
            if type(byte_offset) is not int or not 0 <= byte_offset <= INT64_MAX:
                raise self._fail(line, "byte_offset", byte_offset)
            if type(byte_length) is not int or not 0 <= byte_length <= INT64_MAX:
                raise self._fail(line, "byte_length", byte_length)
        if key is None:
            key = path if byte_offset is None else f"{path}@{byte_offset}"
        elif type(key) is not str or not key or "\x00" in key:
            raise self._fail(line, "key", key)
        if label is not None and (type(label) is not int or not _INT64_MIN <= label <= INT64_MAX):
            raise self._fail(line, "label", label)
        if split is None:
            split = self.default_split
            if split is None:
                raise self._fail(line, "split", None)
        elif split not in self._splits:
            if type(split) is not str or not 0 < len(split) <= SPLIT_MAX_CHARS or "\x00" in split:
                raise self._fail(line, "split", split)
            self._splits.add(split)
        if length is not None and (type(length) is not int or not 0 <= length <= _INT32_MAX):
            raise self._fail(line, "length", length)
        if weight is None:
            weight = 1.0
        elif (type(weight) is not float and type(weight) is not int) or not (
            0.0 <= weight <= _FLOAT_MAX  # also false for NaN
        ):
            raise self._fail(line, "weight", weight)
        if attrs is not None:
            if type(attrs) is not dict:
                raise self._fail(line, "attrs", attrs)
            try:
                attrs = json.dumps(attrs, ensure_ascii=False, allow_nan=False)
            except ValueError as e:
                why = f"attrs must not hold NaN or Infinity ({e})"
                raise self._fail(line, "attrs", attrs, why) from e
            if "\\u0000" in attrs:  # Postgres cannot store NUL in jsonb or text
                raise self._fail(line, "attrs", attrs, "attrs must not contain NUL characters")
        return (line, key, path, byte_offset, byte_length, label, split, length, weight, attrs)


def read_jsonl(f: Iterable[str], checker: RowChecker) -> Iterator[Row]:
    loads = json.loads
    fields = MANIFEST_FIELDS
    for line, text in enumerate(f, 1):
        try:
            obj = loads(text)
        except ValueError as e:
            if not text.strip():
                continue
            where = f"{checker.file}, line {line}"
            if isinstance(e, json.JSONDecodeError):
                raise DataError(f"{where}: not valid JSON ({e.msg} at column {e.pos + 1})") from e
            raise DataError(f"{where}: not valid JSON ({e})") from e
        if type(obj) is not dict:
            raise DataError(
                f"{checker.file}, line {line}: {_show(obj)} is not valid; "
                'each line must be a JSON object such as {"path": ..., "split": ...}'
            )
        if not obj.keys() <= fields:
            unknown = sorted(set(obj) - fields)[0]
            raise DataError(
                f"{checker.file}, line {line}: unknown field {unknown!r} "
                f"(value {_show(obj[unknown])}); allowed fields: {', '.join(sorted(fields))}"
            )
        yield checker(line, obj.get)


# CSV cells are text: these parse them, and a cell that does not parse is passed on as text
# for the row checker to report with what is allowed.
_CSV_PARSERS: dict[str, Callable[[str], Any]] = {
    "label": int,
    "length": int,
    "byte_offset": int,
    "byte_length": int,
    "weight": float,
    "attrs": json.loads,
}


def read_csv(f: Iterable[str], checker: RowChecker) -> Iterator[Row]:
    file = checker.file
    reader = csv.reader(f)
    header = next(reader, None)
    if header is None:
        raise DataError(f"{file}: empty file; a CSV manifest starts with a header row")
    header = [h.strip() for h in header]
    for name in header:
        if name not in MANIFEST_FIELDS:
            raise DataError(
                f"{file}, line 1: unknown field {name!r} in the header; "
                f"allowed fields: {', '.join(sorted(MANIFEST_FIELDS))}"
            )
    if len(set(header)) != len(header):
        raise DataError(f"{file}, line 1: a column is repeated in the header {header}")
    if "path" not in header:
        raise DataError(f"{file}, line 1: the header has no 'path' column; it is required")
    col = {name: i for i, name in enumerate(header)}
    ncols = len(header)
    parsers = [(name, col[name], p) for name, p in _CSV_PARSERS.items() if name in col]
    for rec in reader:
        line = reader.line_num
        if len(rec) != ncols:
            if not any(rec):
                continue
            raise DataError(f"{file}, line {line}: {len(rec)} fields, but the header has {ncols}")
        values: dict[str, Any] = {name: (rec[i] or None) for name, i in col.items()}
        for name, i, parse in parsers:
            if rec[i]:
                with contextlib.suppress(ValueError):
                    values[name] = parse(rec[i])
        yield checker(line, values.get)


# --------------------------------------------------------------------------- verification


class RowVerifier:
    """Appends (is_verified, byte_size) to checked manifest rows from the size of each row's
    file (:meth:`size_of`): a missing one is counted and its row is written unverified (it
    may arrive later); a byte range past the end is a DataError."""

    noun = "file"
    """What a path names, for the error: a file, an object."""

    def __init__(self, file: str) -> None:
        self.file = file
        self.missing_rows = 0
        self.missing_examples: list[str] = []

    def size_of(self, path: str, line: int) -> int | None:
        """The size of ``path``, None when it is missing."""
        raise NotImplementedError

    def place(self, path: str) -> str:
        """``path`` as errors name it."""
        return path

    def verify(self, row: Row) -> Row:
        """Append (is_verified, byte_size) to a checked manifest row."""
        path, byte_offset, byte_length = row[2], row[3], row[4]
        size = self.size_of(path, row[0])
        if size is None:
            self.missing_rows += 1
            examples = self.missing_examples
            if len(examples) < _MISSING_EXAMPLES and path not in examples:
                examples.append(path)
            return (*row, False, byte_length)
        if byte_length is None:
            return (*row, True, size)
        if byte_offset + byte_length > size:
            raise DataError(
                f"{self.file}, line {row[0]}: byte_offset={byte_offset} + "
                f"byte_length={byte_length} ends at byte {byte_offset + byte_length}, past the "
                f"end of {self.place(path)} ({size} bytes); the byte range must lie inside "
                f"the {self.noun}"
            )
        return (*row, True, byte_length)


class Verifier(RowVerifier):
    """Stats files under a local root, each distinct path once (shards are shared by rows).

    A regular file inside the root is verified; a missing one is counted and its row is
    written unverified (it may arrive later); anything else, a symlink out of the root
    included, is a DataError.
    """

    def __init__(self, root: Path, file: str) -> None:
        super().__init__(file)
        self.root = str(root)
        self._prefix = self.root.rstrip(os.sep) + os.sep
        self._sizes: dict[str, int | None] = {}
        self._dirs: dict[str, bool] = {}

    def inside(self, real: str) -> bool:
        return real == self.root or real.startswith(self._prefix)

    def _dir_inside(self, reldir: str) -> bool:
        ok = self._dirs.get(reldir)
        if ok is None:
            ok = self.inside(os.path.realpath(os.path.join(self.root, reldir)))
            self._dirs[reldir] = ok
        return ok

    def _stat(self, path: str, line: int) -> int | None:
        full = os.path.join(self.root, path)
        where = f"{self.file}, line {line}"
        try:
            st = os.lstat(full)
        except (FileNotFoundError, NotADirectoryError):
            return None
        except OSError as e:
            raise DataError(f"{where}: cannot stat {full}: {e.strerror}") from e
        if stat.S_ISLNK(st.st_mode):
            inside = self.inside(os.path.realpath(full))
            try:
                st = os.stat(full)
            except (FileNotFoundError, NotADirectoryError):
                return None
        else:
            inside = self._dir_inside(os.path.dirname(path))
        if not inside:
            raise _bad(where, "path", path, f"it resolves outside --root {self.root} (a symlink)")
        if not stat.S_ISREG(st.st_mode):
            raise _bad(where, "path", path, f"{full} exists but is not a regular file")
        return st.st_size

    def size_of(self, path: str, line: int) -> int | None:
        try:
            return self._sizes[path]
        except KeyError:
            size = self._stat(path, line)
            if len(self._sizes) >= _STAT_CACHE_MAX:
                self._sizes.clear()
            self._sizes[path] = size
            return size


def trusted(rows: Iterable[Row]) -> Iterator[Row]:
    for row in rows:
        yield (*row, True, row[4])
