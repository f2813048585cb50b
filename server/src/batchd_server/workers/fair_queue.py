"""The worker pool's queue: round-robin across sessions, first in first out within one.

Every session of a server shares one pool. With a single first-in-first-out queue, a session
that submits a ring's worth of batches at once (a stream starting, a client acking a burst)
would have all of them decoded before the next session's one batch: with small batches a
ring holds up to 18, so a neighbour could wait for 18 batches, and over a window of 50 get
less than a third. Here each session has its own queue and the pool takes one task from
each session in turn, so two sessions with work waiting get every other task; a session
with nothing waiting costs the others nothing (the pool never idles for fairness).
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Callable, Iterator
from typing import Generic, TypeVar

__all__ = ["FairQueue"]

T = TypeVar("T")


class FairQueue(Generic[T]):
    """A queue of items, each belonging to the session ``key(item)`` names.

    :meth:`popleft` serves the sessions round-robin (the one served goes to the back of the
    line); within a session, items come out in order. :meth:`appendleft` puts an item back
    at the head of its session's queue (a task redone after its worker died), and that
    session at the front of the line. Not thread-safe: the pool holds its lock.
    """

    def __init__(self, key: Callable[[T], str]) -> None:
        self._key = key
        self._queues: OrderedDict[str, deque[T]] = OrderedDict()
        """Session -> its waiting items, in the order the sessions will be served."""
        self._size = 0

    def append(self, item: T) -> None:
        self._queue(self._key(item)).append(item)
        self._size += 1

    def appendleft(self, item: T) -> None:
        key = self._key(item)
        self._queue(key).appendleft(item)
        self._queues.move_to_end(key, last=False)
        self._size += 1

    def _queue(self, key: str) -> deque[T]:
        """Session ``key``'s queue; a new one joins the back of the line."""
        queue = self._queues.get(key)
        if queue is None:
            queue = self._queues[key] = deque()
        return queue

    def popleft(self) -> T:
        """The next item of the session whose turn it is.

        Raises:
            IndexError: the queue is empty.
        """
        if not self._queues:
            raise IndexError("pop from an empty FairQueue")
        key, queue = next(iter(self._queues.items()))
        item = queue.popleft()
        self._size -= 1
        if queue:
            self._queues.move_to_end(key)
        else:
            del self._queues[key]
        return item

    def clear(self) -> None:
        self._queues.clear()
        self._size = 0

    def __len__(self) -> int:
        return self._size

    def __bool__(self) -> bool:
        return self._size > 0

    def __iter__(self) -> Iterator[T]:
        """Every waiting item (sessions in turn order, each session's in order)."""
        for queue in self._queues.values():
            yield from queue
