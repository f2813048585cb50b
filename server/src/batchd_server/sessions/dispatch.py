"""Where a session's batches come from, and where the slots it is done with go: its dispatcher.

A session hands every batch to its dispatcher and asks it about every slot it gives back; it
never asks whether it is in a share group. The manager builds the dispatcher before the
session (``ShareGroups.dispatch``): a :class:`SoloDispatch` for a lone session, whose every
batch is decoded by a worker into its own slot, or a share group's member's
(``share_groups.GroupDispatch``), which may read, copy or lend another member's slot instead
(NOTE [ Share groups ] in ``share.py``). Both honour :class:`Dispatch`.

Calls that pass a slot are made under the session's lock; see the NOTE for the lock order.
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from concurrent.futures import Future
from typing import Final, Protocol, runtime_checkable

from batchd_server.errors import BatchdError
from batchd_server.planning.sampling import EpochPlan
from batchd_server.sessions.ready import SubmitsTasks
from batchd_server.sessions.ring import ShareMember
from batchd_server.workers.task import BatchResult, BatchTask

__all__ = ["WAIT", "Dispatch", "Loaned", "SoloDispatch", "Wait"]


class Wait(enum.Enum):
    WAIT = "wait"


WAIT: Final = Wait.WAIT
""":meth:`Dispatch.lend`: not yet; ask again once the session's client gave a batch back."""

Loaned = tuple[ShareMember, int]
"""Another member's ring and slot, where a session's client reads a batch (a loan)."""


@runtime_checkable
class Dispatch(Protocol):
    """A session's dispatcher: who decodes its batches, and who else reads its slots."""

    def submit(self, task: BatchTask, *, borrow: bool) -> Future[BatchResult]:
        """The future of ``task``, whose slot the session took (WORKING) for it: done once
        the slot holds the batch, or once the batch is readable elsewhere (a loan, when
        ``borrow``: the stream's client reads other sessions' rings).

        Raises:
            Unavailable: the worker pool refused the task.
        """
        ...

    def lend(self, slot: int) -> Loaned | Wait | None:
        """Where the batch in ``slot`` is to be read as it goes out: another ring's slot (a
        loan), ``slot`` itself (None), or not yet (WAIT)."""
        ...

    def keep(self, slot: int, repaid: Callable[[], object]) -> bool:
        """The session is done with ``slot``: True keeps it LENT while other sessions'
        clients read it, and ``repaid()`` is called once the last of them gave it back;
        False: the session frees it now (then calls :meth:`forget`)."""
        ...

    def forget(self, slot: int) -> None:
        """``slot`` is FREE: it holds no batch for anyone now (before it can be reused)."""
        ...

    def position(self, epoch: int, plan: EpochPlan) -> int:
        """The batch of ``plan`` a fresh stream of ``epoch`` that may join its group starts
        at (``streams.may_join`` decides whether it may); 0 is the epoch's start."""
        ...

    def leave(self, release: Callable[[], object]) -> None:
        """The session closed: ``release()`` frees its ring, now or once no other session's
        client reads a slot of it any more."""
        ...

    def revoked(self) -> BatchdError | None:
        """Why the session's stream must end now: a batch its client read in another
        session's slot was kept too long, and that loan was reclaimed (once; None: run on).
        Asked while the stream waits, so cheap."""
        ...


class SoloDispatch:
    """A lone session's dispatcher: the pool decodes every batch into the session's own
    slot, nobody else reads its slots, and a fresh epoch starts at its first batch."""

    def __init__(self, pool: SubmitsTasks) -> None:
        self._pool = pool

    def submit(self, task: BatchTask, *, borrow: bool) -> Future[BatchResult]:
        return self._pool.submit(task)

    def lend(self, slot: int) -> Loaned | Wait | None:
        return None

    def keep(self, slot: int, repaid: Callable[[], object]) -> bool:
        return False

    def forget(self, slot: int) -> None:
        pass

    def position(self, epoch: int, plan: EpochPlan) -> int:
        return 0

    def leave(self, release: Callable[[], object]) -> None:
        release()

    def revoked(self) -> BatchdError | None:
        return None
