"""The share key of ``Loader(share=...)``: both sides check it the same way.

A key names a group of co-located sessions that read the same batches (the server's
``sessions/share.py``). It travels in ``OpenSessionRequest.share``, is logged and shown to
operators, so it is short printable ASCII.
"""

from __future__ import annotations

from typing import Final

__all__ = ["BORROWED_HELD", "LOANS_OUT", "MAX_SHARE_KEY", "share_key_problem"]

MAX_SHARE_KEY: Final = 128
"""Characters a share key may have at most."""

BORROWED_HELD: Final = 3
"""A client that reads shared slots (``StreamStart.read_shared``) lets its training loop
hold at most this many batches that live in another session's ring at once; it copies
further ones out and gives them back at once."""
LOANS_OUT: Final = BORROWED_HELD + 1
"""How many notices of batches in one other session's ring a server lets a reader's client
hold at once: it sends the next only once the client gave one back. One more than
BORROWED_HELD, so a loop that holds its share always gets the next. A share group's
member's ring has this many slots more than a lone session's, for its readers."""


def share_key_problem(key: str) -> str | None:
    """Why ``key`` cannot be a share key, or None when it can ("" means no sharing)."""
    if len(key) > MAX_SHARE_KEY:
        return f"share={key[:20]!r}... has {len(key)} characters, more than {MAX_SHARE_KEY}"
    if not all(" " < c <= "~" for c in key):
        return f"share={key!r} must be printable ASCII without spaces (a name such as 'sweep-7')"
    return None
