"""What a Loader's saved state is, and whether a state fits a Loader."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Final

from batchd._specs import check_int
from batchd.errors import InvalidArgument

__all__ = ["STATE_FORMAT", "check_state"]

STATE_FORMAT: Final = 1
# What must match for a saved state to mean the same sequence of batches. Not the rank: the
# cursor (epoch, next_batch) is the same on every rank of a job, and frameworks save rank 0's
# state and load it on every rank.
_COMPATIBLE_KEYS: Final = (
    "dataset",
    "split",
    "batch_size",
    "world_size",
    "seed",
    "shuffle",
    "drop_last",
    "sampling",
)
_STATE_KEYS: Final = (
    *_COMPATIBLE_KEYS,
    "format",
    "version",
    "rank",
    "epoch",
    "next_batch",
    "snapshot",
)


def check_state(
    state: Mapping[str, Any], mine: Mapping[str, Any], *, pinned_version: str | None
) -> tuple[int, int]:
    """Check that ``state`` (a ``state_dict()``) can resume a Loader whose own state is
    ``mine``; return its (epoch, next_batch).

    Raises:
        InvalidArgument: ``state`` is not such a dict, or was saved by a Loader with
            different options (the message names the key).
    """
    if not isinstance(state, Mapping):
        raise InvalidArgument(f"state must be a dict from Loader.state_dict(), not {state!r}")
    if state.get("format") != STATE_FORMAT:
        raise InvalidArgument(
            f"state format={state.get('format')!r} is not supported; this batchd reads "
            f"format {STATE_FORMAT} (a dict from Loader.state_dict())"
        )
    missing = [key for key in _STATE_KEYS if key not in state]
    if missing:
        raise InvalidArgument(f"state is missing {', '.join(missing)}; pass a state_dict()")
    keys = [*_COMPATIBLE_KEYS, *(["version"] if pinned_version is not None else [])]
    for key in keys:
        if state[key] != mine[key]:
            raise InvalidArgument(
                f"state {key}={state[key]!r} does not match this Loader's {key}="
                f"{mine[key]!r}; create the Loader with {key}={state[key]!r} to resume"
            )
    epoch = check_int("state epoch", state["epoch"], 0, (1 << 63) - 1)
    next_batch = check_int("state next_batch", state["next_batch"], 0, (1 << 63) - 1)
    if not isinstance(state["snapshot"], str):
        raise InvalidArgument(f"state snapshot={state['snapshot']!r} must be a string")
    return epoch, next_batch
