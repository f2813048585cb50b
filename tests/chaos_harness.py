"""Chaos harness: a ``batchd-server`` process, training clients as processes, the faults they
live through, and the accounting afterwards. Used by the soak test (``e2e/test_soak.py``)
and by ``bench/chaos.py``, which runs the same scenarios for longer.

A client (:data:`CLIENT`) is a training loop that checkpoints after every batch: it appends
one JSON line per batch to its log (the batch's sample ids and ``loader.state_dict()``), and
when it starts it resumes from the last whole line. A client killed with SIGKILL and started
again therefore goes on from its last recorded batch; a batch it received but had not
recorded yet is served again, as it would be to a job restarted from its checkpoint. Clients
stop between epochs once the stop file exists, so every epoch in a log is either complete
or was cut short by the end of the run.

:func:`tally` reads the logs: for every complete epoch, each sample of the split must appear
exactly once (``lost`` and ``duplicated`` count the exceptions) and the batches must come in
order; :class:`ServerProcess` and :func:`shm_entries` say what a server left behind.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections import Counter, defaultdict
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final

__all__ = [
    "CLIENT",
    "ClientFleet",
    "ServerProcess",
    "Tally",
    "alive",
    "process_stats",
    "shm_entries",
    "tally",
    "wait_until",
]

READY: Final = "ready: serving on"

CLIENT: Final = r"""
import json, os, sys, time
import batchd
from batchd import errors

target, log_path, stop_path, transport, seed, batch_size, floats, dataset = sys.argv[1:9]
state = None
if os.path.exists(log_path):
    with open(log_path, "rb+") as f:
        data = f.read()
        cut = data.rfind(b"\n") + 1
        if cut < len(data):  # a line the kill cut short: drop it, its batch comes again
            f.truncate(cut)
        for line in data[:cut].splitlines():
            state = json.loads(line)["state"]

def retry(what):
    # A job's restart policy: the server may be restarting, or its catalog down.
    deadline = time.monotonic() + 180
    while True:
        try:
            return what()
        except errors.Unavailable:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.2)

loader = retry(lambda: batchd.Loader(
    target, dataset=dataset, batch_size=int(batch_size), seed=int(seed), shuffle=True,
    transport=transport, device="cpu", reconnect_timeout_s=180,
    pipeline=batchd.Array((int(floats),), "float32", raw=True)))
if state is not None:
    retry(lambda: loader.load_state_dict(state))
with open(log_path, "a") as log:
    while not os.path.exists(stop_path):
        for batch in loader:
            ids = batch["sample_id"].tolist()
            st = loader.state_dict()
            log.write(json.dumps({"ids": ids, "state": st, "pid": os.getpid()}) + "\n")
            log.flush()
loader.close()
"""


def wait_until(condition: Callable[[], bool], what: str, timeout_s: float) -> None:
    """Poll ``condition`` until it holds.

    Raises:
        TimeoutError: it did not within ``timeout_s``, naming ``what``.
    """
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout_s:g} s waiting for {what}")
        time.sleep(0.05)


def alive(pids: Iterable[int]) -> list[int]:
    """The processes of ``pids`` that still run (zombies count as gone)."""
    found = []
    for pid in pids:
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if state != "Z":
            found.append(pid)
    return found


def _children(pid: int) -> list[int]:
    kids: list[int] = []
    with contextlib.suppress(OSError):
        for task in Path(f"/proc/{pid}/task").iterdir():
            with contextlib.suppress(OSError):
                kids += [int(p) for p in (task / "children").read_text().split()]
    return kids


def process_stats(pid: int) -> dict[str, int]:
    """Resident memory (bytes), open file descriptors and threads of process ``pid``."""
    rss = threads = 0
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            rss = int(line.split()[1]) * 1024
        elif line.startswith("Threads:"):
            threads = int(line.split()[1])
    return {"rss": rss, "fds": len(os.listdir(f"/proc/{pid}/fd")), "threads": threads}


def shm_entries(shm_dir: Path, instance: str = "") -> dict[str, int]:
    """The ``batchd-<instance>`` entries in ``shm_dir`` (all batchd entries for ""), with
    their sizes in bytes."""
    found = {}
    for path in shm_dir.iterdir():
        if path.name.startswith(f"batchd-{instance}"):
            with contextlib.suppress(OSError):
                found[path.name] = path.stat().st_size
    return found


@dataclass
class ServerProcess:
    """``batchd-server serve`` on a unix socket, as its own process (so it can be killed -9
    and started again on the same socket, as a container restarted on a shared volume is).
    With ``listen``, on that TCP address instead (started again on the port it got first)."""

    database_url: str
    socket: Path
    log_dir: Path
    workers: int = 2
    lease_timeout_s: float = 3.0
    extra_args: tuple[str, ...] = ()
    """More ``serve`` options, e.g. ``("--task-timeout-s", "5")``."""
    listen: str = ""
    """A TCP address to serve on instead of ``socket``; ``127.0.0.1:0`` picks a free port."""
    address: str = ""
    """Where the server said it serves, once it has started."""
    process: subprocess.Popen[bytes] | None = None
    instance: str = ""
    starts: int = 0
    spawned: set[int] = field(default_factory=set)
    """Every server and worker process seen, for the leak check."""

    @property
    def target(self) -> str:
        """The address clients dial.

        Raises:
            RuntimeError: a TCP server that has not started yet (its port is not known).
        """
        if not self.listen:
            return f"unix://{self.socket}"
        if not self.address:
            raise RuntimeError(
                f"the server on {self.listen} has no port yet: call start() before target"
            )
        return self.address

    @property
    def pid(self) -> int:
        assert self.process is not None
        return self.process.pid

    def start(self, timeout_s: float = 120) -> str:
        """Start the server and wait until it logs that it is ready; returns its instance."""
        self.starts += 1
        log = self.log_dir / f"server-{self.starts}.log"
        env = {**os.environ, "BATCHD_DATABASE_URL": self.database_url}
        command = [sys.executable, "-m", "batchd_server.cli", "serve"]
        listen = self.address or self.listen or self.target
        command += ["--listen", listen, "--workers", str(self.workers)]
        command += ["--lease-timeout-s", str(self.lease_timeout_s), *self.extra_args]
        with log.open("wb") as out:  # a file: a pipe nobody reads would stall the server
            self.process = subprocess.Popen(command, env=env, stdout=out, stderr=out)
        process = self.process
        self.spawned.add(process.pid)

        def ready() -> bool:
            if process.poll() is not None:
                raise RuntimeError(f"batchd-server exited {process.returncode}:\n{log.read_text()}")
            return READY in log.read_text()

        wait_until(ready, f"batchd-server to be ready (log {log})", timeout_s)
        text = log.read_text()
        self.instance = text.split("segments batchd-", 1)[1].split("-*", 1)[0]
        self.address = text.split(f"{READY} ", 1)[1].split(" ", 1)[0]
        self.spawned.update(self.worker_pids())
        return self.instance

    def worker_pids(self) -> list[int]:
        """The decode workers (the server's children that are not multiprocessing's
        resource tracker)."""
        if self.process is None:
            return []
        return [
            pid
            for pid in _children(self.pid)
            if b"resource_tracker" not in _cmdline(pid) and pid in alive([pid])
        ]

    def kill9(self) -> None:
        """SIGKILL the server (not its workers: they must notice by themselves)."""
        assert self.process is not None
        self.spawned.update(self.worker_pids())
        self.process.kill()
        self.process.wait(60)

    def stop(self, timeout_s: float = 60) -> int:
        """SIGTERM and wait; returns the exit code (SIGKILL after ``timeout_s``)."""
        if self.process is None or self.process.poll() is not None:
            return -1 if self.process is None else self.process.returncode
        self.spawned.update(self.worker_pids())
        self.process.send_signal(signal.SIGTERM)
        try:
            return self.process.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait(30)
            return -9

    def log_text(self) -> str:
        return "\n".join(p.read_text() for p in sorted(self.log_dir.glob("server-*.log")))


def _cmdline(pid: int) -> bytes:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return b""


@dataclass
class ClientFleet:
    """Training clients as processes, each with its own log; killed and started again."""

    target: str
    workdir: Path
    transports: list[str]
    batch_size: int = 16
    floats: int = 32
    seed: int = 0
    dataset: str = "records"
    env: dict[str, str] = field(default_factory=dict)
    """More environment for the clients, e.g. ``{"BATCHD_AUTH_TOKEN": token}``."""
    processes: list[subprocess.Popen[bytes] | None] = field(default_factory=list)
    spawned: set[int] = field(default_factory=set)
    kills: int = 0

    def __post_init__(self) -> None:
        self.processes = [None] * len(self.transports)

    @property
    def stop_file(self) -> Path:
        return self.workdir / "stop"

    def log(self, i: int) -> Path:
        return self.workdir / f"client-{i}.jsonl"

    def start(self, i: int) -> None:
        """Start client ``i`` (resuming from its log, if it has one)."""
        args = [self.target, str(self.log(i)), str(self.stop_file), self.transports[i]]
        args += [str(self.seed + i), str(self.batch_size), str(self.floats), self.dataset]
        with (self.workdir / f"client-{i}.err").open("ab") as err:
            process = subprocess.Popen(
                [sys.executable, "-c", CLIENT, *args],
                env={**os.environ, **self.env},
                stdout=subprocess.DEVNULL,
                stderr=err,
            )
        self.processes[i] = process
        self.spawned.add(process.pid)

    def start_all(self) -> None:
        self.stop_file.unlink(missing_ok=True)
        for i in range(len(self.transports)):
            self.start(i)

    def kill(self, i: int) -> None:
        """SIGKILL client ``i`` and start it again (it resumes from its log)."""
        process = self.processes[i]
        assert process is not None
        if process.poll() is None:
            process.kill()
            self.kills += 1
        process.wait(60)
        self.start(i)

    def failed(self) -> list[str]:
        """Clients that exited on their own with an error, and the end of their stderr."""
        out = []
        for i, process in enumerate(self.processes):
            if process is not None and process.poll() not in (None, 0):
                tail = (self.workdir / f"client-{i}.err").read_text()[-3000:]
                out.append(f"client {i} exited {process.returncode}:\n{tail}")
        return out

    def finish(self, timeout_s: float) -> None:
        """Ask every client to stop after its current epoch and wait for them all.

        Raises:
            RuntimeError: a client failed or did not finish in time (it is killed).
        """
        self.stop_file.touch()
        deadline = time.monotonic() + timeout_s
        problems = []
        for i, process in enumerate(self.processes):
            assert process is not None
            try:
                process.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait(30)
                problems.append(f"client {i} did not finish its epoch within {timeout_s:g} s")
        problems += self.failed()
        if problems:
            raise RuntimeError("\n".join(problems))


@dataclass
class Tally:
    """What the clients' logs say about their complete epochs."""

    epochs: int = 0
    samples: int = 0
    """Samples delivered in complete epochs."""
    lost: int = 0
    """Samples of the split missing from a complete epoch."""
    duplicated: int = 0
    """Deliveries beyond the first of a sample within one epoch (or of a foreign id)."""
    resumed: int = 0
    """Complete epochs that more than one client process served (resumed after a kill)."""
    problems: list[str] = field(default_factory=list)

    def add(self, other: Tally) -> None:
        self.epochs += other.epochs
        self.samples += other.samples
        self.lost += other.lost
        self.duplicated += other.duplicated
        self.resumed += other.resumed
        self.problems += other.problems


def _records(log: Path) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    if not log.exists():
        return out
    for line in log.read_text().splitlines():
        with contextlib.suppress(ValueError):  # a line a kill cut short
            out.append(json.loads(line))
    return out


def tally(logs: Iterable[Path], split_ids: set[int]) -> Tally:
    """Check every complete epoch of every log: each of ``split_ids`` exactly once, batches
    in order. An epoch at the end of a log that is not complete is not counted."""
    total = Tally()
    for log in logs:
        epochs: dict[int, list[tuple[int, list[int]]]] = defaultdict(list)
        writers: dict[int, set[int]] = defaultdict(set)
        num_batches = 0
        for record in _records(log):
            state = record["state"]
            num_batches = state["num_batches"]
            if state["next_batch"] > 0:
                epoch, index = state["epoch"], state["next_batch"] - 1
            else:  # the last batch of an epoch: the state already points at the next one
                epoch, index = state["epoch"] - 1, num_batches - 1
            epochs[epoch].append((index, record["ids"]))
            writers[epoch].add(record["pid"])
        for epoch, batches in sorted(epochs.items()):
            if batches[-1][0] != num_batches - 1:
                continue  # cut short by the end of the run
            total.epochs += 1
            total.resumed += len(writers[epoch]) > 1
            indices = [index for index, _ in batches]
            if indices != list(range(num_batches)):
                total.problems.append(
                    f"{log.name} epoch {epoch}: batches {indices} instead of 0..{num_batches - 1}"
                )
            counts = Counter(i for _, ids in batches for i in ids)
            total.samples += sum(counts.values())
            total.lost += len(split_ids - counts.keys())
            total.duplicated += sum(n - 1 if i in split_ids else n for i, n in counts.items())
    return total
