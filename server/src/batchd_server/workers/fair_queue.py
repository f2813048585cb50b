"""The worker pool's queue: round-robin across clients, then across each client's sessions,
first in first out within one session.

Every session of a server shares one pool. With a single first-in-first-out queue, a session
that submits a ring's worth of batches at once (a stream starting, a client acking a burst)
would have all of them decoded before the next session's one batch: with small batches a
ring holds up to 18, so a neighbour could wait for 18 batches, and over a window of 50 get
less than a third. Round-robin across sessions alone is not enough either: a tenant that
opens 64 sessions would get 64 of every 65 tasks against another tenant's one. So the line
is of clients (``tenant(item)``, the identity their quotas count against), and each client's
turn goes to its sessions in turn: two clients with work waiting get every other task
however many sessions each has, and one client's sessions share its turns evenly. A client
or session with nothing waiting costs the others nothing (the pool never idles for
fairness).
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Callable, Iterator
from typing import Generic, TypeVar

__all__ = ["FairQueue"]

T = TypeVar("T")


def _one_tenant(_item: object) -> str:
    return ""


class FairQueue(Generic[T]):
    """A queue of items, each belonging to the session ``key(item)`` names, of the client
    ``tenant(item)`` names (default: one client for all).

    :meth:`popleft` serves the clients round-robin, and each client's sessions round-robin
    (the client and the session served go to the back of their lines); within a session,
    items come out in order. :meth:`appendleft` puts an item back at the head of its
    session's queue (a task redone after its worker died), and that session and its client
    at the front of their lines. Not thread-safe: the pool holds its lock.
    """

    def __init__(self, key: Callable[[T], str], tenant: Callable[[T], str] = _one_tenant) -> None:
        self._key = key
        self._tenant = tenant
        self._tenants: OrderedDict[str, OrderedDict[str, deque[T]]] = OrderedDict()
        """Client -> (session -> its waiting items), each in the order they will be served."""
        self._size = 0

    def append(self, item: T) -> None:
        self._queue(self._tenant(item), self._key(item)).append(item)
        self._size += 1

    def appendleft(self, item: T) -> None:
        tenant, key = self._tenant(item), self._key(item)
        self._queue(tenant, key).appendleft(item)
        self._tenants[tenant].move_to_end(key, last=False)
        self._tenants.move_to_end(tenant, last=False)
        self._size += 1

    def _queue(self, tenant: str, key: str) -> deque[T]:
        """Session ``key``'s queue; a new client or session joins the back of its line."""
        sessions = self._tenants.get(tenant)
        if sessions is None:
            sessions = self._tenants[tenant] = OrderedDict()
        queue = sessions.get(key)
        if queue is None:
            queue = sessions[key] = deque()
        return queue

    def popleft(self) -> T:
        """The next item of the session whose turn it is, of the client whose turn it is.

        Raises:
            IndexError: the queue is empty.
        """
        if not self._tenants:
            raise IndexError("pop from an empty FairQueue")
        tenant, sessions = next(iter(self._tenants.items()))
        key, queue = next(iter(sessions.items()))
        item = queue.popleft()
        self._size -= 1
        if queue:
            sessions.move_to_end(key)
        else:
            del sessions[key]
        if sessions:
            self._tenants.move_to_end(tenant)
        else:
            del self._tenants[tenant]
        return item

    def clear(self) -> None:
        self._tenants.clear()
        self._size = 0

    def __len__(self) -> int:
        return self._size

    def __bool__(self) -> bool:
        return self._size > 0

    def __iter__(self) -> Iterator[T]:
        """Every waiting item (clients in turn order, each client's sessions in turn order,
        each session's in order)."""
        for sessions in self._tenants.values():
            for queue in sessions.values():
                yield from queue
