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
Any of these goes to LENT instead while other members read the slot (the book asks ``keep``).
The ring itself is released when the session closes (CloseSession, lease expiry,
shutdown), after every WORKING slot is done; workers are then told to drop their mapping.
"""

from __future__ import annotations

import enum
from collections import Counter, deque
from collections.abc import Callable

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
    bug in the session, not bad input, and raises AssertionError.
    """

    def __init__(
        self,
        slots: int,
        on_free: Callable[[int], object] | None = None,
        keep: Callable[[int], bool] | None = None,
    ) -> None:
        """``on_free(slot)`` is called as each slot becomes FREE, before it can be taken
        again (a share group forgets the batch the slot held; ``sessions/share.py``).
        ``keep(slot)`` is asked first, as a slot is given back: True keeps it LENT (other
        members read it) until :meth:`free` is called again with ``was=LENT``."""
        self._states = [SlotState.FREE] * slots
        self._free: deque[int] = deque(range(slots))
        self._on_free = on_free
        self._keep = keep

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

    def free(self, slot: int, was: SlotState) -> None:
        """The slot (in state ``was``) is FREE again, or LENT while others still read it."""
        if was is not SlotState.LENT and self._keep is not None and self._keep(slot):
            self._move(slot, was, SlotState.LENT)
            return
        self._move(slot, was, SlotState.FREE)
        if self._on_free is not None:
            self._on_free(slot)
        self._free.append(slot)

    def _move(self, slot: int, was: SlotState, now: SlotState) -> None:
        assert self._states[slot] is was, f"slot {slot} is {self._states[slot]}, not {was}"
        self._states[slot] = now

    def check(self) -> None:
        """Assert that the FREE list holds exactly the FREE slots, each once."""
        free = [s for s, state in enumerate(self._states) if state is SlotState.FREE]
        assert sorted(self._free) == free, f"free list {list(self._free)} != FREE slots {free}"
