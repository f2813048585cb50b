"""What a Loader's saved state is, and whether a state fits a Loader.

The cursor is global: ``consumed`` counts the entries of the epoch's global order that all
ranks of the saving job served together (``batchd._wire.epoch``). It is the same on every rank
(frameworks save rank 0's state and load it everywhere), and it means the same thing at any
world size, so a state saved by N ranks resumes on M: the rest of the epoch is planned from
``consumed`` for the M new ranks.

A Loader over a mix (``batchd.Mix``) saves its sources, weights and stop under ``"mix"``
(None without a mix, and missing in states from before mixing, which means the same); they
must match to resume. Its ``snapshot`` is the mix's token, pinning every source.

Formats: 2 (this one); 1 (batchd before elastic resume: a per-rank ``next_batch``, read as
``consumed = next_batch * batch_size * world_size``). Others are refused with a message that
names them and the batchd that wrote them.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Final

from batchd._specs import check_int
from batchd._version import __version__
from batchd.errors import InvalidArgument

__all__ = ["STATE_FORMAT", "Cursor", "SavedPosition", "check_state"]

STATE_FORMAT: Final = 2
_READS: Final = (1, 2)
# What must match for a saved state to mean the same sequence of samples. Not the rank (the
# cursor is the same on every rank) nor the world size (the cursor is global).
_COMPATIBLE_KEYS: Final = (
    "dataset",
    "split",
    "batch_size",
    "seed",
    "shuffle",
    "drop_last",
    "sampling",
)
_COMMON_KEYS: Final = (*_COMPATIBLE_KEYS, "version", "world_size", "epoch", "snapshot")
_REQUIRED: Final = {
    1: (*_COMMON_KEYS, "next_batch"),
    2: (*_COMMON_KEYS, "consumed", "order_world_size", "rows"),
}
_MAX: Final = (1 << 63) - 1


@dataclass(frozen=True)
class Cursor:
    """Where a Loader's next iteration starts.

    Attributes:
        epoch: The epoch.
        next_batch: Batches of this rank's plan already handed out.
        start: The plan begins after this many entries of the epoch's global order (an
            elastic resume); 0 is the whole epoch.
        order_world_size: The world size the epoch's order was built for; 0: the Loader's.
    """

    epoch: int
    next_batch: int = 0
    start: int = 0
    order_world_size: int = 0


@dataclass(frozen=True)
class SavedPosition:
    """A checked state's position."""

    epoch: int
    consumed: int
    """Entries of the epoch's global order served by all ranks together."""
    world_size: int
    """The saving job's world size."""
    order_world_size: int
    rows: int | None
    """The split's rows when saved (format 2), to tell a state of another plan."""
    num_batches: int | None
    """Batches per epoch when saved (format 1 only)."""


def check_state(
    state: Mapping[str, Any], mine: Mapping[str, Any], *, pinned_version: str | None
) -> SavedPosition:
    """Check that ``state`` (a ``state_dict()``) can resume a Loader whose own state is
    ``mine``; return its position.

    Raises:
        InvalidArgument: ``state`` is not such a dict, is of a format this batchd cannot
            read (the message names it), or was saved by a Loader with different options
            (the message names the key).
    """
    if not isinstance(state, Mapping):
        raise InvalidArgument(f"state must be a dict from Loader.state_dict(), not {state!r}")
    fmt = state.get("format")
    if fmt not in _READS:
        written_by = state.get("batchd_version", "an unknown version")
        raise InvalidArgument(
            f"state format={fmt!r} (written by batchd {written_by}) is not supported; batchd "
            f"{__version__} reads formats {', '.join(map(str, _READS))}. Resume with the "
            "batchd that saved it, or start the epoch afresh without load_state_dict"
        )
    missing = [key for key in _REQUIRED[fmt] if key not in state]
    if missing:
        raise InvalidArgument(f"state is missing {', '.join(missing)}; pass a state_dict()")
    # Not required: states from before mixing have no "mix", which means none.
    if state.get("mix") != mine.get("mix"):
        raise InvalidArgument(
            f"state mix={state.get('mix')!r} does not match this Loader's mix="
            f"{mine.get('mix')!r}; create the Loader with the same sources (names, splits, "
            "versions, weights and stop) to resume"
        )
    keys = [*_COMPATIBLE_KEYS, *(["version"] if pinned_version is not None else [])]
    for key in keys:
        if state[key] != mine[key]:
            raise InvalidArgument(
                f"state {key}={state[key]!r} does not match this Loader's {key}="
                f"{mine[key]!r}; create the Loader with {key}={state[key]!r} to resume"
            )
    if not isinstance(state["snapshot"], str):
        raise InvalidArgument(f"state snapshot={state['snapshot']!r} must be a string")
    epoch = check_int("state epoch", state["epoch"], 0, _MAX)
    world_size = check_int("state world_size", state["world_size"], 1, 1 << 16)
    if fmt == 1:
        next_batch = check_int("state next_batch", state["next_batch"], 0, _MAX)
        saved = state.get("num_batches")
        return SavedPosition(
            epoch=epoch,
            consumed=next_batch * int(state["batch_size"]) * world_size,
            world_size=world_size,
            order_world_size=world_size,
            rows=None,
            num_batches=None if saved is None else check_int("num_batches", saved, 0, _MAX),
        )
    return SavedPosition(
        epoch=epoch,
        consumed=check_int("state consumed", state["consumed"], 0, _MAX),
        world_size=world_size,
        order_world_size=check_int("order_world_size", state["order_world_size"], 1, 1 << 16),
        rows=check_int("state rows", state["rows"], 0, _MAX),
        num_batches=None,
    )
