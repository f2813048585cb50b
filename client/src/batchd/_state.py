"""A Loader's position in its run, and the saved state that carries it: written and read here.

:class:`Position` is where the next iteration starts. The Loader's epoch loop moves it as
batches are handed out; :meth:`Position.get_state` writes it as ``Loader.state_dict()`` and
:meth:`Position.read_state` with :meth:`Position.reset` read such a state back (the pair
torchdata's ``BaseNode`` calls ``get_state`` and ``reset``).

The cursor is global: ``consumed`` counts the entries of the epoch's global order that all
ranks of the saving job served together (``batchd._wire.epoch``). It is the same on every rank
(frameworks save rank 0's state and load it everywhere), and it means the same thing at any
world size, so a state saved by N ranks resumes on M: the rest of the epoch is planned from
``consumed`` for the M new ranks.

A Loader over a mix (``batchd.Mix``) saves its sources, weights and stop under ``"mix"``
(None without a mix, and missing in states from before mixing, which means the same), and
its schedule and interpolation when it has one; they must match to resume (a schedule's
steps count global batches from the run's start, so another schedule would replay other
batches). Its ``snapshot`` is the mix's token, pinning every source.

A Loader that joined its share group part way through an epoch serves that epoch in a
rotated order (NOTE [ Share groups ] in the server's ``sessions/share.py``): the epoch's
global order from entry ``rotation`` on, then its first ``rotation`` entries, every sample
once. Its state says so: ``rotation`` (entries of the global order; a whole number of global
batches at the world size that joined), and ``consumed`` counts entries of that rotated
order. Served at that world size the rotated epoch is the plan's batches ``r = rotation /
G``, ..., last, then 0, ..., r - 1 (G = batch_size * world_size); batch ``n - 1`` is the
one that holds the order's last entry (and, without drop_last, padding), so after it
``consumed`` is ``rows - rotation`` (drop_last's dropped tail counts as consumed, as it is
for a lone Loader), then grows by G per batch again. Resumed at another world size, the rest
of the rotated order is dealt to the new ranks as for any elastic resume. The next epoch is
not rotated (unless it joins its group again).

Formats: 3 (a rotated epoch: format 2 plus ``rotation``); 2 (every other state, written as
before rotations existed, so a batchd that reads format 2 resumes it); 1 (batchd before
elastic resume: a per-rank ``next_batch``, read as ``consumed = next_batch * batch_size *
world_size``). Others are refused with a message that names them and the batchd that wrote
them; a batchd from before rotations refuses a format 3 state rather than resume it in the
wrong order.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any, Final

from batchd._options import LoaderOptions
from batchd._pipelines import check_int
from batchd._proto.batchd.v1 import loader_pb2
from batchd._version import __version__
from batchd._wire.epoch import rest_of_epoch
from batchd.errors import FailedPrecondition, InvalidArgument

__all__ = ["STATE_FORMAT", "Cursor", "Position", "SavedPosition"]

STATE_FORMAT: Final = 2
ROTATED_STATE_FORMAT: Final = 3
_READS: Final = (1, 2, 3)
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
    3: (*_COMMON_KEYS, "consumed", "order_world_size", "rows", "rotation"),
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
        rotation: A rotated epoch: its order begins at this entry of the global order and
            wraps around (``start`` counts entries of the rotated order); 0: not rotated.
    """

    epoch: int
    next_batch: int = 0
    start: int = 0
    order_world_size: int = 0
    rotation: int = 0


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
    reopen_on: tuple[str, str] | None = None
    """(version, snapshot) of the saved rows when the Loader's session serves others: the
    state resumes on a session opened on them ("" for the options' own)."""
    rotation: int = 0
    """A rotated epoch's first entry of the global order (format 3); 0: not rotated."""


class Position:
    """Where a Loader is in its run: the epoch, and the batches of it handed out.

    The attributes are the Loader's to move (its epoch loop sets ``next_batch`` after each
    batch); ``reply`` arguments are the OpenSession answer of the session serving the run.

    Args:
        options: The Loader's options (the plan's batch size, world size and drop_last, and
            what a saved state records).
    """

    def __init__(self, options: LoaderOptions) -> None:
        assert options.world_size is not None  # set in LoaderOptions
        self._options = options
        self._world_size: int = options.world_size
        self.epoch = 0
        self.next_batch = 0
        self.start = 0
        """After an elastic resume, the epoch's plan is the rest of the epoch after this many
        entries of its global order, built for ``order_world_size`` (0: the Loader's)."""
        self.order_world_size = 0
        self.rotation = 0
        """A rotated epoch (see the module's docstring): entries of the global order before
        its first; 0: not rotated."""

    @property
    def global_batch(self) -> int:
        return self._options.batch_size * self._world_size

    def rotated_batches(
        self, reply: loader_pb2.OpenSessionResponse, cursor: Cursor | None = None
    ) -> int:
        """The plan index of the epoch's first batch when it is served as the whole plan
        rotated by whole batches (``StreamStart.rotation``, as the server decides it); 0
        otherwise. Of ``cursor``'s epoch, or this position's."""
        at = cursor or Cursor(0, self.next_batch, self.start, self.order_world_size, self.rotation)
        if at.rotation == 0 or at.start != 0:
            return 0
        if at.order_world_size not in (0, self._world_size):
            return 0
        batches, rest = divmod(at.rotation, self.global_batch)
        return batches if rest == 0 and batches < int(reply.num_batches) else 0

    def plan_index(self, index: int, reply: loader_pb2.OpenSessionResponse) -> int:
        """The ``batch_index`` the server sends for the epoch's ``index``-th batch."""
        r = self.rotated_batches(reply)
        return index if r == 0 else (r + index) % int(reply.num_batches)

    def joined(self, rotated_batches: int) -> None:
        """The server started this fresh epoch at plan batch ``rotated_batches`` (its
        share group's position): the epoch is rotated from there."""
        assert self.next_batch == 0 and self.start == 0 and self.rotation == 0
        self.rotation = rotated_batches * self.global_batch

    def epoch_batches(self, reply: loader_pb2.OpenSessionResponse) -> int:
        """Batches of the current epoch's plan on this rank: ``len(loader)``, or fewer for
        the rest of an epoch after an elastic resume."""
        if self.start == 0:
            return int(reply.num_batches)
        options = self._options
        return rest_of_epoch(
            int(reply.num_rows),
            self.start,
            batch_size=options.batch_size,
            world_size=self._world_size,
            drop_last=options.drop_last,
        )[1]

    def cursor(self, reply: loader_pb2.OpenSessionResponse) -> Cursor:
        """Where the next iteration starts."""
        n = self.epoch_batches(reply)
        if self.next_batch >= n and (n > 0 or self.start > 0):
            return Cursor(self.epoch + 1)
        return Cursor(self.epoch, self.next_batch, self.start, self.order_world_size, self.rotation)

    def move_to(self, cursor: Cursor) -> None:
        self.epoch, self.next_batch = cursor.epoch, cursor.next_batch
        self.start, self.order_world_size = cursor.start, cursor.order_world_size
        self.rotation = cursor.rotation

    def _consumed(self, cursor: Cursor, reply: loader_pb2.OpenSessionResponse) -> int:
        """Entries of the epoch's (rotated) global order ``cursor`` has consumed."""
        global_batch = self.global_batch
        r = self.rotated_batches(reply, cursor)
        if r == 0:
            return cursor.start + cursor.next_batch * global_batch
        n, i = int(reply.num_batches), cursor.next_batch
        if r + i < n:
            return i * global_batch
        return int(reply.num_rows) - cursor.rotation + (r + i - n) * global_batch

    def is_inside(self, epoch: int, reply: loader_pb2.OpenSessionResponse) -> bool:
        """Whether ``epoch`` is the epoch this position is part way through."""
        started = self.next_batch > 0 or self.start > 0
        return epoch == self.epoch and started and self.next_batch < self.epoch_batches(reply)

    # -- the saved state: written ----------------------------------------------------------

    def get_state(self, reply: loader_pb2.OpenSessionResponse) -> dict[str, Any]:
        """This position as a ``Loader.state_dict()``: plain values only (JSON- and
        ``torch.save``-friendly); see ``Loader.state_dict`` for what they mean."""
        cursor = self.cursor(reply)
        options = self._options
        state: dict[str, Any] = {
            "format": STATE_FORMAT,
            "batchd_version": __version__,
            "dataset": options.dataset,
            "version": reply.version or options.version or "",
            "split": reply.split or options.split,
            "batch_size": options.batch_size,
            "rank": options.rank,
            "world_size": self._world_size,
            "seed": options.seed,
            "shuffle": options.shuffle,
            "drop_last": options.drop_last,
            "sampling": options.sampling,
            "mix": options.mix_state(),
            "pack": options.pack_state(),
            "epoch": cursor.epoch,
            "consumed": self._consumed(cursor, reply),
            "order_world_size": cursor.order_world_size or self._world_size,
            "next_batch": cursor.next_batch,
            "num_batches": int(reply.num_batches),
            "rows": int(reply.num_rows),
            "snapshot": reply.snapshot,
        }
        if cursor.rotation:
            state["format"] = ROTATED_STATE_FORMAT
            state["rotation"] = cursor.rotation
        return state

    # -- the saved state: read -------------------------------------------------------------

    def read_state(
        self, state: Mapping[str, Any], reply: loader_pb2.OpenSessionResponse
    ) -> SavedPosition:
        """Check that ``state`` (a ``state_dict()``, any format this batchd reads) can resume
        this Loader, whose session answered ``reply``; its position, for :meth:`reset`.

        Raises:
            InvalidArgument: ``state`` is not such a dict, is of a format this batchd cannot
                read (the message names it), or was saved by a Loader with different options
                (the message names the key).
        """
        mine = self.get_state(reply)
        saved = _check_state(state, mine, pinned_version=self._options.version)
        if state["snapshot"] != mine["snapshot"] or state["version"] != mine["version"]:
            return replace(saved, reopen_on=(state["version"], state["snapshot"]))
        return saved

    def reset(
        self, saved: SavedPosition, reply: loader_pb2.OpenSessionResponse, *, target: str
    ) -> None:
        """Move to where ``saved`` (from :meth:`read_state`) continues, on the session that
        answered ``reply`` (on the saved rows). Nothing moves when it raises.

        Raises:
            InvalidArgument: the state is from another plan (other rows or batches).
            FailedPrecondition: an elastic resume on a server (at ``target``) too old for it.
        """
        options = self._options
        world_size = self._world_size
        rows, num_batches = int(reply.num_rows), int(reply.num_batches)
        global_batch = options.batch_size * world_size
        if (saved.rows is not None and rows and saved.rows != rows) or (
            saved.num_batches is not None
            and saved.world_size == world_size
            and saved.num_batches != num_batches
        ):
            raise InvalidArgument(
                f"the state's split had rows={saved.rows}, num_batches={saved.num_batches}; "
                f"this session has {rows} rows, {num_batches} batches per epoch: the state is "
                "from another plan"
            )
        if saved.rotation:
            self._reset_rotated(saved, reply, target=target)
            return
        if saved.order_world_size == world_size and saved.consumed % global_batch == 0:
            next_batch = saved.consumed // global_batch
            if next_batch > num_batches:
                raise InvalidArgument(
                    f"state consumed={saved.consumed} is past this session's epoch of "
                    f"{num_batches} batches of {global_batch}; the state is from another plan"
                )
            self.move_to(Cursor(saved.epoch, next_batch))
            return
        if not rows:
            raise FailedPrecondition(
                f"the server at {target!r} cannot resume a state saved at "
                f"world_size={saved.world_size} on world_size={world_size} (it does not "
                "report the split's rows); upgrade batchd-server, or resume with "
                f"world_size={saved.world_size}"
            )
        self.move_to(Cursor(saved.epoch, 0, saved.consumed, saved.order_world_size))

    def _reset_rotated(
        self, saved: SavedPosition, reply: loader_pb2.OpenSessionResponse, *, target: str
    ) -> None:
        """:meth:`reset` to a rotated epoch: at this world size, the same rotated batches
        from the next one on; at another, the rest of the rotated order (module docstring)."""
        rows, num_batches = int(reply.num_rows), int(reply.num_batches)
        s, consumed, global_batch = saved.rotation, saved.consumed, self.global_batch
        if not reply.rotations or not rows:
            raise FailedPrecondition(
                f"the server at {target!r} cannot resume a rotated epoch (a Loader that joined "
                "its share group part way through it); upgrade batchd-server, or start the "
                "epoch afresh without load_state_dict"
            )
        if s >= rows or consumed > rows:
            raise InvalidArgument(
                f"state rotation={s}, consumed={consumed} do not fit this session's {rows} "
                "rows; the state is from another plan"
            )
        r, rest = divmod(s, global_batch)
        if saved.order_world_size == self._world_size and rest == 0 and r < num_batches:
            after_last = consumed - (rows - s)
            next_batch: int | None = None
            if after_last < 0 and consumed % global_batch == 0:
                next_batch = consumed // global_batch
            elif after_last >= 0 and after_last % global_batch == 0:
                next_batch = num_batches - r + after_last // global_batch
            if next_batch is not None and next_batch <= num_batches:
                self.move_to(Cursor(saved.epoch, next_batch, rotation=s))
                return
        self.move_to(Cursor(saved.epoch, 0, consumed, saved.order_world_size, s))


def _check_state(
    state: Mapping[str, Any], mine: Mapping[str, Any], *, pinned_version: str | None
) -> SavedPosition:
    """Check that ``state`` (a ``state_dict()``) can resume a Loader whose own state is
    ``mine``; return its position.

    Raises:
        InvalidArgument: see :meth:`Position.read_state`.
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
            "versions, weights, stop, schedule and interpolate) to resume"
        )
    # Not required either: states from before packing have no "pack", which means none.
    if state.get("pack") != mine.get("pack"):
        raise InvalidArgument(
            f"state pack={state.get('pack')!r} does not match this Loader's pack="
            f"{mine.get('pack')!r}; create the Loader with the same batchd.Pack to resume"
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
        rotation=check_int("state rotation", state["rotation"], 1, _MAX) if fmt == 3 else 0,
    )
