"""How many batches the rest of an epoch has: the arithmetic both sides must agree on.

An epoch's *global order* is one sequence of sample positions for all ranks of a job (see
``batchd_server.planning.sampling``). Ranks consume it together, a global batch of ``batch_size *
world_size`` entries at a time, so how far an epoch got is one number, the entries consumed,
whatever the world size was: that is what makes a state saved by N ranks resumable on M.
The server plans the rest of an epoch from that number and the client counts its batches
with the same function.
"""

from __future__ import annotations

from batchd._wire.ring import ceil_div

__all__ = ["rest_of_epoch"]


def rest_of_epoch(
    rows: int, consumed: int, *, batch_size: int, world_size: int, drop_last: bool
) -> tuple[int, int]:
    """(samples, batches) per rank for an epoch of ``rows`` samples whose first ``consumed``
    entries of the global order were served already.

    Without ``drop_last`` the rest is padded by wrapping around to the epoch's start until
    every rank has as many samples (at most ``world_size - 1`` repeat); with it, the entries
    that cannot fill a batch on every rank are left out. ``consumed == 0`` is a whole epoch.
    """
    remaining = max(rows - consumed, 0)
    if drop_last:
        batches = remaining // world_size // batch_size
        return batches * batch_size, batches
    samples = ceil_div(remaining, world_size)
    return samples, ceil_div(samples, batch_size)
