"""The decode workers' server settings: how many processes, and how long a task may run."""

from __future__ import annotations

from dataclasses import dataclass

from batchd_server.settings import Check, seconds, setting, within
from batchd_server.workers.sizing import WorkerRange, available_cpus, parse_worker_range

__all__ = ["WorkerSettings"]


@dataclass(frozen=True, kw_only=True)
class WorkerSettings:
    """The decode workers' settings."""

    workers: WorkerRange = setting(
        flag="--workers",
        default_factory=lambda: WorkerRange(available_cpus(), available_cpus()),
        check=Check(">= 1, MIN <= MAX", WorkerRange.problem),
        parse=parse_worker_range,
        help="decode processes: N keeps N running; MIN..MAX starts MIN and adds one while "
        "trainers stall on queued decode work and cores are idle, removes one when the "
        "workers idle, never past MAX, the CPUs or what memory affords",
        metavar="N|MIN..MAX",
        default_text="the CPUs this process may use",
    )

    task_timeout_s: float = seconds(
        flag="--task-timeout-s",
        default=60.0,
        check=within(0, 86400, low_open=True),
        help="kill a decode worker whose task runs longer than this many seconds (a hung read "
        "or decode) and redo the task; a sample that hangs twice is a bad sample of kind "
        "'timeout'",
    )

    def check_workers(self) -> None:
        """Make ``workers=4`` (from Python) the range ``4..4``."""
        if isinstance(self.workers, int):
            object.__setattr__(self, "workers", WorkerRange(self.workers, self.workers))
