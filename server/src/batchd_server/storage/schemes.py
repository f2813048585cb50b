"""A dataset root's scheme: ``s3`` of ``s3://bucket/prefix`` (``gs``, ``az``), ``""`` of a
local directory.

The one place that tells a store's root from a local one; which reader serves each scheme is
``storage/open.READERS``, and which store each scheme names is ``storage/clouds.CLOUDS``.
"""

from __future__ import annotations

__all__ = ["is_local_root", "scheme_of"]


def scheme_of(root: str) -> str:
    """``root``'s scheme: the part before ``://``, ``""`` for a local path."""
    scheme, sep, _ = root.partition("://")
    return scheme.lower() if sep else ""


def is_local_root(root: str) -> bool:
    """Whether ``root`` is a directory of this machine (confined by ``--data-root``), not a
    prefix of a store (confined by the server's credentials)."""
    return scheme_of(root) == ""
