"""The one rule for a sample's path, at ingest and at read, and the one place that confines
it to its dataset's ``s3://`` prefix.

A catalog path is relative to its dataset's root: not empty, not absolute, without a NUL,
and made of components that are not empty, ``.`` or ``..``. A local reader resolves what it
opens and refuses what leads outside its root anyway (symlinks included,
``storage/files.py``); an object store has no such resolution: ``a//b`` and ``a/./b`` name
keys other than ``a/b``, and ``..`` would leave the prefix. So ingest refuses such a path
(``catalog/manifest.py``), and a reader of a store refuses it again as ``unsafe_path``
(a catalog written before, or with ``--no-verify``) before any request: :func:`sample_url`.
"""

from __future__ import annotations

from batchd_server.pipelines.base import BadSample

__all__ = ["path_problem", "sample_url"]


def path_problem(path: str) -> str | None:
    """Why ``path`` cannot name a sample under a dataset root, or None when it can. Cheap:
    it runs once per manifest row at ingest."""
    if not path:
        return "path must be a non-empty relative path"
    if "\x00" in path:
        return "path must not contain a NUL character"
    if path[0] == "/":
        return "path must be relative to --root, not absolute"
    if "." in path or "//" in path or path[-1] == "/":
        padded = f"/{path}/"
        if "/../" in padded:
            return "path must not have a '..' component; samples stay inside --root"
        if "/./" in padded or "//" in padded:
            return (
                "path must not have an empty or '.' component (write 'a/b', not 'a//b' or './a/b')"
            )
    return None


def sample_url(root: str, path: str) -> str:
    """The URL of the catalog path ``path`` under the prefix ``root``, once the path is
    known to stay inside it.

    Raises:
        BadSample: ``unsafe_path``, saying why.
    """
    problem = path_problem(path)
    if problem is not None:
        raise BadSample("unsafe_path", f"{path!r}: {problem}")
    return f"{root.rstrip('/')}/{path}"
