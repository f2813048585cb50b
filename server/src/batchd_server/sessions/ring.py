"""A session's ring of slots as the session, its share group and a client see it: the segment,
where each field lies in a slot, and what a client needs to map it.

The manager makes a session's :class:`SessionRing` before the session itself, so that the
session's dispatcher (``dispatch.py``) can be built around it first: a share group reads and
copies batches between its members' rings (NOTE [ Share groups ] in ``share.py``).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Protocol

from batchd._wire.ring import HEADER_BYTES, slot_offset
from batchd_server.shm.segments import Segment
from batchd_server.workers.task import SlotField

__all__ = ["RingRef", "SessionRing", "ShareMember"]


@dataclass(frozen=True)
class RingRef:
    """A session's ring, as a client maps it: its own (OpenSession) or another member's (a
    loan's notice, ``StreamBatchesResponse.ring``)."""

    name: str
    segment_bytes: int
    slot_bytes: int
    slots: int
    token: bytes


class ShareMember(Protocol):
    """A session's ring, as its share group sees it."""

    @property
    def id(self) -> str:
        """The session's id."""
        ...

    @property
    def layout(self) -> tuple[SlotField, ...]: ...

    @property
    def slots(self) -> int:
        """Slots in the member's ring."""
        ...

    @property
    def client(self) -> str:
        """Who opened the member's session: a closed member's ring that its loans keep is
        charged to the clients that borrow it."""
        ...

    @property
    def ring_ref(self) -> RingRef:
        """The member's ring, as a client maps it."""
        ...

    def slot_memory(self, slot: int) -> memoryview:
        """The bytes of slot ``slot`` of the member's ring."""
        ...


@dataclass(frozen=True, eq=False)
class SessionRing:
    """Session ``id``'s ring: ``segment`` cut into slots of ``slot_bytes`` after the header,
    each laid out as ``layout``; ``token`` proves a client may map it; ``client``: who opened
    the session (the identity its quotas count against)."""

    id: str
    segment: Segment
    layout: tuple[SlotField, ...]
    slot_bytes: int
    token: bytes
    client: str = ""

    @functools.cached_property
    def slots(self) -> int:
        """Slots in the ring (``ring_slots`` decided how many when it was reserved)."""
        return (self.segment.nbytes - HEADER_BYTES) // self.slot_bytes

    @functools.cached_property
    def ring_ref(self) -> RingRef:
        return RingRef(
            self.segment.name, self.segment.nbytes, self.slot_bytes, self.slots, self.token
        )

    def slot_memory(self, slot: int) -> memoryview:
        start = slot_offset(slot, self.slot_bytes)
        return memoryview(self.segment.buf)[start : start + self.slot_bytes]
