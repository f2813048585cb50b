"""The states of a ring's slots and the book that keeps them.

# NOTE [ Slot lifecycle ]
A session's ring has ``slots`` slots: ``prefetch`` of them, two for the batches in the
training loop's hands, and a few more when batches are small (see ``ring_slots``); each is
big enough for one full batch. A slot is in exactly one :class:`SlotState`:

  FREE      -- nobody uses it;
  WORKING   -- a worker has been asked to fill it with batch k (its task may still be
               queued); also a slot whose stream ended while its worker was writing: it
               stays WORKING until the worker is done, so a later stream never hands out a
               slot a worker is still writing;
  DELIVERED -- inline streams: batch k was copied into messages and sent; the client has
               not acked index k yet;
  LEASED    -- shm streams: batch k was announced under a lease; the client has not given
               the lease back yet;
  LENT      -- shm, a share group's member: the session is done with the slot, but another
               member's client still reads the batch in it (``share.py``, NOTE [ Share
               groups ]); FREE once the last of them gives its lease back.

A stream takes FREE slots for the next batches in order (so at most ``slots`` batches are
ahead of the client: the ack is the flow-control credit) and sends batches strictly in
order. FREE -> WORKING when a batch is handed to a worker; WORKING -> DELIVERED or LEASED
when its batch goes out; back to FREE when:
  inline -- the client acks the batch index on the stream's own call, or the stream ends
            for any reason (epoch done, client gone, session closed): its DELIVERED slots
            become FREE at once (their bytes were copied into messages anyway);
  shm    -- the client releases the lease on the session's doorbell. Leases belong to the
            session, not the stream: a training loop may keep a batch's tensors (views of
            the slot) past the end of the epoch. Each StreamStart lists the leases the
            client still holds; every other LEASED slot becomes FREE then. Releases of
            unknown leases (late, repeated) are ignored;
  WORKING-- its task is cancelled before a worker took it (the stream ended), or the
            worker finished writing a batch nobody will send any more.
Any of these goes to LENT instead while other members read the slot: the session asks its
dispatcher (``dispatch.py``) as it gives a slot back, then tells the book which.
The ring itself is released when the session closes (CloseSession, lease expiry,
shutdown), after every WORKING slot is done; workers are then told to drop their mapping.
"""

from __future__ import annotations

import enum
from collections import Counter, deque
from collections.abc import Iterable

__all__ = ["SlotBook", "SlotState"]


class SlotState(enum.Enum):
    """Where a slot is in its lifecycle; see NOTE [ Slot lifecycle ]."""

    FREE = "free"
    WORKING = "working"
    DELIVERED = "delivered"
    LEASED = "leased"
    LENT = "lent"


class SlotBook:
    """Each slot's state, and the FREE slots in the order they are reused.

    Not thread-safe: the session's lock guards it. A transition from the wrong state is a
    bug in the session, not bad input, and raises AssertionError. The book is told what
    happens to a slot; it calls nobody.
    """

    def __init__(self, slots: int) -> None:
        self._states = [SlotState.FREE] * slots
        self._free: deque[int] = deque(range(slots))

    def __len__(self) -> int:
        return len(self._states)

    def has_free(self) -> bool:
        return bool(self._free)

    def state(self, slot: int) -> SlotState:
        return self._states[slot]

    def counts(self) -> Counter[SlotState]:
        return Counter(self._states)

    def take(self) -> int:
        """The next FREE slot, now WORKING. Call only when :meth:`has_free`."""
        slot = self._free.popleft()
        self._move(slot, SlotState.FREE, SlotState.WORKING)
        return slot

    def sent(self, slot: int, *, leased: bool) -> None:
        """A WORKING slot's batch went out: DELIVERED (inline) or LEASED (shm)."""
        self._move(slot, SlotState.WORKING, SlotState.LEASED if leased else SlotState.DELIVERED)

    def lend(self, slot: int, was: SlotState) -> None:
        """The session is done with the slot (in state ``was``), but other sessions' clients
        still read it: LENT until :meth:`free` with ``was=LENT``."""
        self._move(slot, was, SlotState.LENT)

    def free(self, slot: int, was: SlotState) -> None:
        """The slot (in state ``was``) is FREE again."""
        self._move(slot, was, SlotState.FREE)
        self._free.append(slot)

    def _move(self, slot: int, was: SlotState, now: SlotState) -> None:
        assert self._states[slot] is was, f"slot {slot} is {self._states[slot]}, not {was}"
        self._states[slot] = now

    def check(self, places: Iterable[tuple[int, SlotState]] | None = None) -> None:
        """Assert that the FREE list holds exactly the FREE slots, each once; with
        ``places`` (where the session keeps each slot, and the state that place means), that
        it has every slot once, in the state the book has for it."""
        free = [s for s, state in enumerate(self._states) if state is SlotState.FREE]
        assert sorted(self._free) == free, f"free list {list(self._free)} != FREE slots {free}"
        if places is None:
            return
        places = list(places)
        seen = Counter(s for s, _ in places)
        twice = sorted(s for s, n in seen.items() if n > 1)
        assert not twice, f"slots {twice} are in more than one place"
        lost = sorted(set(range(len(self._states))) - set(seen))
        assert not lost, f"slots {lost} are in no state's place"
        for slot, state in places:
            assert self._states[slot] is state, (
                f"slot {slot} is kept as {state.name} but booked {self._states[slot].name}"
            )
