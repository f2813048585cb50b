"""The body of a worker process: receive a task, fill its slot, answer; forever.

A worker is started with the ``spawn`` method (a fresh interpreter, never a fork of a
process that has gRPC threads) and talks to the pool over one duplex pipe. Messages in:
``("task", task_id, BatchTask)``, ``("forget", session_id)`` or ``None`` (exit). Messages
out: ``("ready",)`` once, then ``(task_id, BatchResult)`` or ``(task_id, WorkerError)`` per
task. Beside the pipe, two int64 in memory shared with the pool say where the worker is:
the id of the task it runs and the sample position it reads or decodes (-1: a step of the
whole batch); the pool reads them when a task overruns its deadline (``deadline.py``). The
worker never touches the catalog database and holds no gRPC object.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import signal
import threading
import traceback
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any

__all__ = ["WorkerError", "worker_main"]

logger = logging.getLogger(__name__)

_PR_SET_PDEATHSIG = 1
_PRELOAD = ("torch",)
"""Imported in the background once the worker is ready: torch takes about a second to import,
which the image pipeline's first batch would otherwise wait for (see ``_preload``)."""


@dataclass(frozen=True)
class WorkerError:
    """An unexpected exception in a worker (a bug, not a bad sample), with its traceback."""

    type_name: str
    message: str
    traceback: str


def _die_with_parent() -> None:
    # If the server is SIGKILLed mid-task, the pipe EOF is only seen after the task; the
    # kernel's parent-death signal ends us at once instead of leaving an orphan decoding.
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    except (OSError, AttributeError):  # pragma: no cover - not Linux
        pass


def _preload() -> None:
    # The image pipeline imports torch on its first decode. A server usually starts long before
    # its first session, so importing it here, beside an idle worker, takes that second off
    # the first batch; a task that needs torch meanwhile waits on Python's import lock.
    for name in _PRELOAD:
        try:
            __import__(name)
        except Exception as e:  # a broken install shows on the first decode that needs it
            logger.debug("preloading %s failed: %s", name, e)


def worker_main(
    conn: Connection,
    parent_pid: int,
    log_level: int,
    log_format: str = "text",
    progress: Any = None,
) -> None:
    """Serve tasks from ``conn`` until told to stop or the server goes away.

    ``progress``: the pool's shared ``RawArray("q", 2)`` (task id, position), or None.
    """
    _die_with_parent()
    if os.getppid() != parent_pid:  # the parent died before prctl took effect
        return
    # A worker is one core's worth of decoding, and there is one per core: thread pools that
    # libraries size to the machine (torch's, used by the image resize; OpenMP; BLAS) would
    # only fight each other and spin idle cores. Set before anything imports them.
    for name in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS"):
        os.environ[name] = "1"
    # Ctrl-C goes to the whole process group; the server decides when workers stop.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    from batchd_server.logs import configure_logging

    configure_logging(log_level, log_format)

    import numpy as np

    from batchd_server.workers.context import SessionContext, run_batch

    where = np.zeros(2, np.int64) if progress is None else np.frombuffer(progress, np.int64)
    contexts: dict[str, SessionContext] = {}
    conn.send(("ready",))
    threading.Thread(target=_preload, name="batchd-preload", daemon=True).start()
    try:
        while True:
            try:
                message = conn.recv()
            except (EOFError, OSError):
                return  # the pool is gone
            if message is None:
                return
            if message[0] == "forget":
                context = contexts.pop(message[1], None)
                if context is not None:
                    context.close()
                continue
            _, task_id, task = message
            where[1] = -1
            where[0] = task_id
            try:
                result: object = run_batch(contexts, task, where[1:])
            except Exception as e:  # a bug: report it, stay alive for the next task
                result = WorkerError(type(e).__name__, str(e), traceback.format_exc())
            conn.send((task_id, result))
    finally:
        for context in contexts.values():
            with contextlib.suppress(Exception):  # exiting anyway
                context.close()
