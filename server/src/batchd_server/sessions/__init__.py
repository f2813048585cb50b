"""Sessions: what a client opened, the ring of slots it reads, and the streams it runs.

``options.py`` validates a request and lays out its ring; ``sources.py`` acquires the
catalog entries of its sources (one split is a mix of one); ``slots.py`` holds the slot
states (NOTE [ Slot lifecycle ]); ``session.py`` runs one session's streams over its ring
(``ring.py``), handing its batches to its dispatcher (``dispatch.py``): alone, or a share
group's member (``share.py``, ``share_groups.py``);
``error_budget.py`` decides how many bad samples they let through; ``manager.py`` opens,
finds, closes and expires sessions. Domain code: nothing here imports grpc.
"""

from __future__ import annotations

from batchd_server.sessions.manager import SessionManager
from batchd_server.sessions.options import SessionOptions, ring_slots, slot_layout
from batchd_server.sessions.ready import Bell, FieldView, ReadyBatch
from batchd_server.sessions.ring import RingRef
from batchd_server.sessions.session import Session
from batchd_server.sessions.slots import SlotBook, SlotState
from batchd_server.sessions.streams import Stream

__all__ = [
    "Bell",
    "FieldView",
    "ReadyBatch",
    "RingRef",
    "Session",
    "SessionManager",
    "SessionOptions",
    "SlotBook",
    "SlotState",
    "Stream",
    "ring_slots",
    "slot_layout",
]
