"""Shared pieces of the loader benchmarks: machine facts, CPU accounting, contenders timed in
alternating rounds, markdown tables, and a batchd server run as its own process.

CPU is counted two ways. The process that runs the training loop reads its own
``getrusage(RUSAGE_SELF)`` (every thread, microsecond resolution). Loader processes (the
DataLoader's workers, or the batchd server and its decode workers) are read from
``/proc/<pid>/stat``, utime + stime in clock ticks (10 ms here), summed over a process and,
for the server, all its live descendants.
"""

from __future__ import annotations

import contextlib
import importlib.metadata
import os
import platform
import resource
import signal
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final

import numpy as np
import torch

__all__ = [
    "READY_MARKER",
    "Contender",
    "Run",
    "ServerProcess",
    "batchd_server",
    "best",
    "closing_line",
    "compete",
    "cores",
    "descendants",
    "interleave",
    "machine_busy_s",
    "machine_lines",
    "markdown_table",
    "own_cpu_s",
    "pids_cpu_s",
    "ratio",
    "reaped_children_cpu_s",
    "results_table",
    "rss_bytes",
    "self_cpu_s",
    "shm_entries",
    "spread",
]

READY_MARKER: Final = "ready: serving on"
"""What ``batchd-server serve`` logs once it accepts calls."""
_CLOCK_TICKS_PER_S: Final = os.sysconf("SC_CLK_TCK")
_STOP_TIMEOUT_S: Final = 30.0
_LOUD: Final = ("WARNING", "ERROR", "CRITICAL")
_VERSIONED: Final = ("torch", "numpy", "pillow", "simplejpeg", "grpcio", "protobuf")


def cores() -> int:
    """The CPUs this process may run on."""
    return len(os.sched_getaffinity(0))


def self_cpu_s() -> float:
    """User + system CPU seconds of this process so far, all threads."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def own_cpu_s() -> float:
    """CPU seconds of this process and of its children that have been waited for."""
    me, kids = (
        resource.getrusage(resource.RUSAGE_SELF),
        resource.getrusage(resource.RUSAGE_CHILDREN),
    )
    return me.ru_utime + me.ru_stime + kids.ru_utime + kids.ru_stime


def machine_busy_s() -> float:
    """CPU seconds every process of the machine has used since boot (/proc/stat)."""
    fields = Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]
    user, nice, system, _idle, _iowait, irq, softirq, steal = (int(f) for f in fields[:8])
    return (user + nice + system + irq + softirq + steal) / _CLOCK_TICKS_PER_S


def descendants(pid: int) -> list[int]:
    """Live descendants of ``pid`` (children of every thread, recursively)."""
    found: list[int] = []
    todo = [pid]
    while todo:
        parent = todo.pop()
        with contextlib.suppress(OSError):
            for task in Path(f"/proc/{parent}/task").iterdir():
                with contextlib.suppress(OSError):
                    kids = [int(p) for p in (task / "children").read_text().split()]
                    found += kids
                    todo += kids
    return found


def pids_cpu_s(pids: Iterable[int]) -> float:
    """User + system CPU seconds of the given processes (ones that are gone count 0)."""
    total_ticks = 0
    for pid in pids:
        with contextlib.suppress(OSError):
            # The command name in parentheses may hold spaces: split after its ")".
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
            total_ticks += int(fields[11]) + int(fields[12])  # utime, stime (stat 14, 15)
    return total_ticks / _CLOCK_TICKS_PER_S


def reaped_children_cpu_s(pid: int) -> float:
    """User + system CPU seconds of ``pid``'s children that it has waited for (``cutime`` and
    ``cstime`` of /proc/<pid>/stat); 0 when it is gone."""
    with contextlib.suppress(OSError):
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[13]) + int(fields[14])) / _CLOCK_TICKS_PER_S  # stat 16, 17
    return 0.0


def rss_bytes() -> int:
    """Resident memory of this process now (VmRSS), in bytes."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


def shm_entries() -> list[str]:
    """The ``batchd`` entries in /dev/shm."""
    return sorted(p.name for p in Path("/dev/shm").iterdir() if p.name.startswith("batchd"))


def closing_line(started: float, busy0: float, own0: float) -> str:
    """The run's last line: wall time, what other processes took of the cores meanwhile
    (``busy0``/``own0`` from :func:`machine_busy_s`/:func:`own_cpu_s` at ``started``), and any
    batchd entry left in /dev/shm."""
    wall_s = time.perf_counter() - started
    others_s = machine_busy_s() - busy0 - (own_cpu_s() - own0)
    return (
        f"\ntotal {wall_s:.0f} s; other processes on the machine used {others_s:.0f} CPU-s "
        f"meanwhile ({100 * others_s / (wall_s * cores()):.0f}% of {cores()} cores); "
        f"batchd entries left in /dev/shm: {shm_entries() or 'none'}"
    )


@dataclass(frozen=True)
class Run:
    """One timed stretch of one configuration."""

    samples: int
    batches: int
    wall_s: float
    train_cpu_s: float
    """The training-loop process's CPU (getrusage, all its threads)."""
    loader_cpu_s: float | None
    """DataLoader workers, or the batchd server and its workers; None when there are none."""
    rss_bytes: int = 0
    """Resident memory of the training process at the end of the run."""

    @property
    def samples_per_s(self) -> float:
        return self.samples / self.wall_s

    @property
    def train_cpu_ms_per_batch(self) -> float:
        return 1e3 * self.train_cpu_s / self.batches

    @property
    def loader_cpu_ms_per_batch(self) -> float | None:
        return None if self.loader_cpu_s is None else 1e3 * self.loader_cpu_s / self.batches

    @property
    def busy_percent(self) -> float:
        """The loop's and the loader processes' CPU over what the usable cores could give."""
        return 100 * (self.train_cpu_s + (self.loader_cpu_s or 0.0)) / (self.wall_s * cores())


def spread(values: Sequence[float], fmt: str = ",.0f") -> str:
    """``median (min-max)`` of ``values``, or ``median`` alone for one value."""
    med = statistics.median(values)
    if len(values) == 1:
        return format(med, fmt)
    return f"{med:{fmt}} ({min(values):{fmt}}-{max(values):{fmt}})"


def markdown_table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    """A GitHub markdown table; the first column left-aligned, the others right-aligned."""
    widths = [max(len(r[i]) for r in (header, *rows)) for i in range(len(header))]
    rule = [":" + "-" * (widths[0] - 1)] + ["-" * (w - 1) + ":" for w in widths[1:]]
    lines = []
    for cells in (header, rule, *rows):
        padded = [
            c.ljust(w) if i == 0 else c.rjust(w)
            for i, (c, w) in enumerate(zip(cells, widths, strict=True))
        ]
        lines.append("| " + " | ".join(padded) + " |")
    return "\n".join(lines)


@dataclass
class Contender:
    """One configuration of one side (a DataLoader or a batchd Loader) and its timed runs.

    ``loader_cpu`` reads the CPU seconds of the processes that load for it, or is None when
    the loop's own process does all the work. ``to_device`` is where the loop copies each
    batch (a DataLoader on CUDA); ``cuda`` makes a run wait for the device before it ends.
    """

    label: str
    side: str
    loader: Any
    loader_cpu: Callable[[], float] | None
    to_device: str | None = None
    cuda: bool = False
    runs: list[Run] = field(default_factory=list)
    epochs: int = 0

    def run(self, *, batches: int | None, warmup_batches: int, touch: bool = False) -> Run:
        """A new epoch: all of it timed, or ``warmup_batches`` untimed then ``batches`` timed.

        Timing starts before ``iter()`` for a whole epoch (so a DataLoader's refill and
        batchd's stream start count), after the warm-up batches otherwise. ``touch`` reads
        every byte of each batch once, as a training step would.
        """
        if hasattr(self.loader, "set_epoch"):
            self.loader.set_epoch(self.epochs)
        self.epochs += 1
        rows = count = 0
        start = cpu0 = lcpu0 = 0.0

        def begin() -> None:
            nonlocal start, cpu0, lcpu0
            lcpu0 = self.loader_cpu() if self.loader_cpu else 0.0
            cpu0, start = self_cpu_s(), time.perf_counter()

        if warmup_batches == 0:
            begin()
        it = iter(self.loader)
        for batch in it:
            count += 1
            if count == warmup_batches:
                begin()
            elif count > warmup_batches:
                rows += len(batch["label"])
                if touch:
                    for value in batch.values():
                        _read_all(value)
                if self.to_device is not None:
                    for value in batch.values():
                        value.to(self.to_device, non_blocking=True)
                if batches is not None and count == warmup_batches + batches:
                    break
        if self.cuda:
            torch.cuda.synchronize()
        wall_s, cpu_s = time.perf_counter() - start, self_cpu_s() - cpu0
        lcpu_s = self.loader_cpu() - lcpu0 if self.loader_cpu else None
        del it  # a batchd iteration left early gives its slots back here, outside the timing
        timed = count - warmup_batches
        if batches is not None and timed != batches:
            raise RuntimeError(f"{self.label}: the epoch had {timed} batches, not {batches}")
        return Run(rows, timed, wall_s, cpu_s, lcpu_s, rss_bytes())

    def median(self, metric: str) -> float:
        """The median over the timed runs of a :class:`Run` attribute."""
        return statistics.median(getattr(r, metric) for r in self.runs)

    def close(self) -> None:
        if hasattr(self.loader, "close"):
            self.loader.close()
        self.loader = None


def _read_all(tensor: torch.Tensor) -> None:
    # One single-threaded pass; DataLoader batches pay their shared memory's page faults here.
    if tensor.device.type == "cpu":
        np.bitwise_xor.reduce(tensor.numpy().reshape(-1).view(np.uint8))


def interleave(*sides: list[Contender]) -> list[Contender]:
    """The contenders of all sides spread evenly through one round (A B A B ...)."""
    keyed = [((i + 0.5) / len(s), k, c) for k, s in enumerate(sides) for i, c in enumerate(s)]
    return [c for *_, c in sorted(keyed, key=lambda t: t[:2])]


def quiesce(limit_s: float = 2.0) -> float:
    """Wait until this process's CPU clock stops moving; return the seconds waited.

    torch's OpenMP threads spin for several ms after a parallel op (a 0-worker DataLoader's
    collate): without this, that spin (~5 ms, ~0.3 ms per batch of a 16-batch epoch) is
    billed to whichever configuration runs next in the same process.
    """
    start = time.monotonic()
    last = self_cpu_s()
    while time.monotonic() - start < limit_s:
        time.sleep(0.02)
        now = self_cpu_s()
        if now - last < 0.0005:
            break
        last = now
    return time.monotonic() - start


def compete(
    first: list[Contender],
    make_second: Callable[[], list[Contender]],
    reps: int,
    *,
    batches: int | None = None,
    warmup_batches: int = 0,
    touch: bool = False,
) -> list[Contender]:
    """Warm every contender up once, then ``reps`` rounds; returns them all, closed.

    Each round runs every contender once, the sides interleaved and the order rotated by one
    per round, so slow drift of a shared machine spreads over both sides; before each run the
    process goes quiet (:func:`quiesce`). ``first`` warms up
    before ``make_second`` builds the others: DataLoaders fork their persistent workers
    then, before any batchd Loader (a gRPC channel) of the section exists.
    """

    def once(c: Contender) -> Run:
        quiesce()
        return c.run(batches=batches, warmup_batches=warmup_batches, touch=touch)

    second: list[Contender] = []
    try:
        for c in first:
            once(c)
        second = make_second()
        for c in second:
            once(c)
        order = interleave(first, second)
        for r in range(reps):
            for c in order[r % len(order) :] + order[: r % len(order)]:
                c.runs.append(once(c))
                rate = c.runs[-1].samples_per_s
                print(f"  {r + 1}/{reps} {c.label}: {rate:,.0f} samples/s", file=sys.stderr)
    finally:
        for c in first + second:
            c.close()
    return first + second


def best(contenders: Iterable[Contender], side: str) -> Contender:
    """The contender of ``side`` with the highest median samples/s."""
    return max((c for c in contenders if c.side == side), key=lambda c: c.median("samples_per_s"))


def ratio(a: Contender, b: Contender, metric: str) -> float:
    """Median of ``a`` over median of ``b`` for a :class:`Run` attribute."""
    return a.median(metric) / b.median(metric)


def results_table(contenders: Sequence[Contender], refs: dict[str, Contender]) -> str:
    """Every contender: samples/s, its ratio to each reference, the loop's CPU per batch and
    its ratio to the first reference, the loader processes' CPU per batch, and how busy the
    machine's cores were (low: the loader left them idle).

    ``refs`` maps a short name ("best") to a reference contender, whose row is in bold.
    """
    first_name, first = next(iter(refs.items()))
    header = ["config", "samples/s median (min-max)", *(f"ratio vs {n}" for n in refs)]
    header += ["train-process CPU ms/batch", f"CPU ratio vs {first_name}"]
    header += ["loader procs CPU ms/batch", f"CPU busy % of {cores()} cores"]
    rows = []
    for c in contenders:
        loader = [v for r in c.runs if (v := r.loader_cpu_ms_per_batch) is not None]
        row = ["**" + c.label + "**" if c in refs.values() else c.label]
        row += [spread([r.samples_per_s for r in c.runs])]
        row += [f"{ratio(c, ref, 'samples_per_s'):.2f}x" for ref in refs.values()]
        row += [spread([r.train_cpu_ms_per_batch for r in c.runs], ".2f")]
        row += [f"{ratio(c, first, 'train_cpu_ms_per_batch'):.2f}x"]
        row += [spread(loader, ".1f") if loader else "-", f"{c.median('busy_percent'):.0f}"]
        rows.append(row)
    named = "; ".join(f"{name} = {ref.label}" for name, ref in refs.items())
    return markdown_table(header, rows) + f"\n\nReferences (bold): {named}."


def _version(dist: str) -> str:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def machine_lines() -> list[str]:
    """What the numbers depend on: CPU, cores, memory, /dev/shm, load, versions."""
    model = "unknown"
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    mem_gib = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    shm = os.statvfs("/dev/shm")
    versions = ", ".join(f"{d} {_version(d)}" for d in _VERSIONED)
    load = ", ".join(f"{x:.2f}" for x in os.getloadavg())
    return [
        f"machine: {cores()} usable cores ({os.cpu_count()} online), {model}, "
        f"{platform.machine()}, {mem_gib:.1f} GiB RAM, "
        f"/dev/shm {shm.f_bavail * shm.f_frsize / 2**30:.1f} GiB free",
        f"software: Python {platform.python_version()}, {versions}, "
        f"batchd {_version('batchd')}, batchd-server {_version('batchd-server')}",
        f"load average at start (1, 5, 15 min): {load}",
    ]


@dataclass
class ServerProcess:
    """A running ``batchd-server serve``: its address, pid and log."""

    process: subprocess.Popen[str]
    target: str
    log: list[str] = field(default_factory=list)

    def cpu_s(self) -> float:
        """CPU seconds of the server (every thread) and all its live descendants (the decode
        workers), plus what its children that have exited and been waited for used (a
        worker replaced mid-run still counts)."""
        pid = self.process.pid
        return pids_cpu_s([pid, *descendants(pid)]) + reaped_children_cpu_s(pid)


@contextlib.contextmanager
def batchd_server(
    database_url: str,
    socket_dir: Path,
    *,
    workers: int | str,
    lease_timeout_s: float,
    ready_timeout_s: float = 120.0,
    extra_args: Sequence[str] = (),
) -> Iterator[ServerProcess]:
    """``batchd-server serve`` on a unix socket in ``socket_dir``, stopped with SIGTERM;
    ``extra_args`` go on its command line (``--cache-dir DIR``, ...).

    Raises:
        RuntimeError: the server exited, or did not log that it is ready in time; the
            message carries the end of its log.
    """
    target = f"unix://{socket_dir}/batchd.sock"
    command = [sys.executable, "-m", "batchd_server.cli", "serve", "--listen", target]
    command += ["--workers", str(workers), "--lease-timeout-s", str(lease_timeout_s)]
    command += list(extra_args)
    env = {**os.environ, "BATCHD_DATABASE_URL": database_url}
    process = subprocess.Popen(
        command,
        env=env,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    server = ServerProcess(process, target)
    ready = threading.Event()

    def drain() -> None:
        # The server logs to stderr for its whole life: keep reading so it never blocks on a
        # full pipe; the event fires on the ready line or at EOF (the server died).
        assert process.stderr is not None
        for line in process.stderr:
            server.log.append(line.rstrip("\n"))
            if READY_MARKER in line:
                ready.set()
            elif not line[:1].isdigit() or any(f" {w} " in line for w in _LOUD):
                # Problems (and tracebacks, whose lines carry no timestamp) show as they come.
                print(f"batchd-server: {line}", end="", file=sys.stderr)
        ready.set()

    reader = threading.Thread(target=drain, name="batchd-server-log", daemon=True)
    reader.start()
    try:
        if not ready.wait(ready_timeout_s) or process.poll() is not None:
            tail = "\n".join(server.log[-20:])
            raise RuntimeError(
                f"batchd-server did not become ready within {ready_timeout_s:g} s "
                f"(exit code {process.poll()}); its log ends:\n{tail}"
            )
        yield server
    finally:
        if process.poll() is None:
            process.send_signal(signal.SIGTERM)
            try:
                process.wait(_STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                # Its decode workers would outlive a SIGKILLed server: kill them first.
                for pid in descendants(process.pid):
                    with contextlib.suppress(OSError):
                        os.kill(pid, signal.SIGKILL)
                process.kill()
                process.wait()
        reader.join(_STOP_TIMEOUT_S)
