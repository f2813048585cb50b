"""The values of sequence packing both sides check: the methods and the longest row.

The client checks a ``batchd.Pack`` when it is built, the server every request again
(``batchd_server.planning.packing``); both read them from here.
"""

from __future__ import annotations

from typing import Final

__all__ = ["MAX_SEQ_LEN", "MIN_SEQ_LEN", "PACK_FIELDS", "PACK_METHODS"]

PACK_METHODS: Final = ("best_fit", "first_fit", "concat")
"""``best_fit`` and ``first_fit`` keep every document (or seq_len piece of one) in one row;
``concat`` concatenates the documents and cuts every ``seq_len`` tokens."""
MAX_SEQ_LEN: Final = 1 << 20
"""The longest packed row, in tokens (as ``Tokens.max_len``)."""
MIN_SEQ_LEN: Final = 8
"""The shortest packed row, in tokens. A shorter row trains on next to nothing and makes the
server plan a piece for every few tokens of the epoch."""
PACK_FIELDS: Final = ("input_ids", "position_ids", "segment_ids", "document_id", "cu_seqlens")
"""The fields of a packed batch, beside ``sample_id`` and ``label`` (and a mix's ``source``)."""
