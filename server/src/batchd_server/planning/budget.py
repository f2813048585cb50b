"""What a session's plans may cost the server's memory, estimated before they are built, so
that an open past its client's plan quota (``--client-plan-quota``) is refused before it
allocates anything (``sessions/manager.py`` charges it).

The estimate is what building one epoch's plan takes at its peak, beside the plans a session
keeps (two: the epoch it streams and the next), measured with tracemalloc at a million
samples (``tests/server/planning/test_plan_bounds.py`` checks that it stays above):

- a plan of samples (a split, any sampling mode, or a mix): the epoch's global order, the
  rank's positions, and their temporaries, at most :data:`PLAN_ENTRY_BYTES` per sample of
  the epoch (all ranks; 16 measured for a split, 56 for a mix with a stop);
- a packed plan: :data:`PLAN_PIECE_BYTES` per piece (a document, or a ``seq_len`` piece of
  one), 250 measured: the pieces of the session's rows, of the two epochs kept, and a batch
  table of the documents each batch reads; and a plan of rows as above.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Final

from batchd_server.planning.mixing import Mixing, MixOptions
from batchd_server.planning.packing import (
    PackOptions,
    pack_pieces,
    source_lengths,
    source_tokens,
)

if TYPE_CHECKING:
    from batchd_server.catalog.types import SplitArrays

__all__ = ["PLAN_ENTRY_BYTES", "PLAN_PIECE_BYTES", "plan_bytes"]

PLAN_ENTRY_BYTES: Final = 64
"""Bytes a session's plans take per sample of one epoch, at most (see the module's note)."""
PLAN_PIECE_BYTES: Final = 320
"""Bytes a packed session's plans take per piece, at most (see the module's note)."""


def plan_bytes(
    mixing: Mixing,
    pack: PackOptions | None,
    pipeline: tuple[str, dict[str, Any]],
    splits: Sequence[SplitArrays],
) -> int:
    """The memory a session's plans take at most (NOTE above), from its sources' sizes (and
    a packed session's documents' lengths) alone: nothing is planned.

    Raises:
        InvalidArgument, FailedPrecondition: the sources cannot make an epoch (as
            ``Mixing.counts``), or cannot be packed (as ``pack_pieces``, ``packed_mixing``).
    """
    if pack is None:
        return PLAN_ENTRY_BYTES * sum(mixing.counts([len(s) for s in splits]))
    lengths = [
        source_lengths(split, rule)
        for split, rule in zip(splits, source_tokens(mixing, pipeline), strict=True)
    ]
    pieces, rows = pack_pieces(lengths, pack)
    if isinstance(mixing, MixOptions) and mixing.stop_samples:
        rows = mixing.stop_samples
    return PLAN_PIECE_BYTES * pieces + PLAN_ENTRY_BYTES * rows
