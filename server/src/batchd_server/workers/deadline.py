"""What the pool does with a task that overran its deadline, and when it gives up on it.

A worker whose task runs past ``task_timeout_s`` is killed (a read stuck in a stalled NFS
mount, a decoder looping on a pathological file: nothing inside the worker can interrupt
either) and replaced; before killing it, the pool reads where the worker was (the sample
position it was reading or decoding, or -1 for a step of the whole batch) from a small
shared array the worker keeps up to date. The task is then redone on a fresh worker,
changed by :func:`after_timeout`:

- never begun (the worker was stuck before it: stopped with SIGSTOP, or a previous task's
  answer would not go): redo it as it was, on another worker; it is not the task's fault,
  but the deadline still counts towards the limit below;
- stuck in a step of the whole batch (its byte ranges read together): redo it one sample
  at a time, which finds the sample that hangs, if one does;
- stuck on a sample for the first time: redo it as it was (an NFS stall may be over);
- stuck on the same sample a second time: that sample is given up. The redo skips it and
  reports it as a bad sample of kind ``timeout``, so the session's ``on_error`` policy
  applies as for any sample that cannot be read: ``raise`` fails the stream with DataLoss
  naming the sample, ``skip`` leaves it out, ``replace`` substitutes another, and
  ``max_error_fraction`` still bounds how many may go;
- after :data:`MAX_TIMEOUTS_PER_TASK` deadlines in all (every sample of the batch hangs: the
  file system is gone), the batch fails with :class:`HungBatch`, which the session turns into
  DataLoss naming the samples.
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from typing import Final

from batchd_server.errors import DataLoss
from batchd_server.workers.task import BatchTask

__all__ = [
    "BATCH_STEP",
    "HUNG_TWICE",
    "MAX_TIMEOUTS_PER_TASK",
    "NOT_BEGUN",
    "HungBatch",
    "after_timeout",
    "where_stuck",
]

BATCH_STEP: Final = -1
"""The position a worker reports while it works on the whole batch, not one sample."""
NOT_BEGUN: Final = -2
"""The position of a task its worker had not begun when the deadline passed."""
HUNG_TWICE: Final = 2
"""Deadlines one sample may cause before it is given up (reported as kind ``timeout``)."""
MAX_TIMEOUTS_PER_TASK: Final = 5
"""Deadlines one task may cause before it fails as a whole."""


class HungBatch(DataLoss):
    """A batch whose workers kept hanging past the task deadline.

    ``positions`` are the split positions of the samples they hung on (the session names
    them); the message stands on its own for anyone who cannot.
    """

    def __init__(self, message: str, positions: tuple[int, ...]) -> None:
        super().__init__(message)
        self.positions = positions


def after_timeout(
    task: BatchTask, hung_at: Counter[int], position: int, *, timeout_s: float
) -> BatchTask:
    """The task to redo after a worker hung on it at ``position`` (already counted in
    ``hung_at``, which holds every deadline the task caused).

    Raises:
        HungBatch: the task caused :data:`MAX_TIMEOUTS_PER_TASK` deadlines.
    """
    if sum(hung_at.values()) >= MAX_TIMEOUTS_PER_TASK:
        samples = tuple(sorted(p for p in hung_at if p >= 0))
        raise HungBatch(
            f"batch {task.batch_index} of session {task.spec.session_id}: decode workers "
            f"hung past the task deadline ({timeout_s:g} s) {sum(hung_at.values())} times "
            f"and were killed each time (at split positions {list(samples) or 'unknown'}); "
            f"the files under {task.spec.root} may be on a stalled file system. Check it, "
            "or raise --task-timeout-s if decoding these samples really takes this long",
            samples,
        )
    if position == NOT_BEGUN:
        return task
    if position == BATCH_STEP:
        return dataclasses.replace(task, one_by_one=True)
    if hung_at[position] >= HUNG_TWICE and position not in task.hung:
        return dataclasses.replace(task, one_by_one=True, hung=(*task.hung, position))
    return task


def where_stuck(position: int) -> str:
    """Where a worker was stuck on a task, in words, for the log."""
    if position == BATCH_STEP:
        return "at a step of the whole batch"
    if position == NOT_BEGUN:
        return "without beginning it: stopped or stuck before it"
    return f"at position {position} of the split"
