"""Chaos: the faults a long training run meets, for longer than the soak test, and a table.

A throwaway Postgres (``tests/pgserver.py``) holds ``--records`` records; every run starts a
``batchd-server serve`` process on a unix socket and four training clients as processes (two
``shm``, two ``inline``; ``tests/chaos_harness.py``). Each client checkpoints after every
batch (its sample ids and ``state_dict()`` appended to a log) and resumes from its last
checkpoint when started again. Scenarios (``--only`` picks some), each ``--runs`` times for
``--duration`` seconds, a fault every few seconds (seeded by ``--seed``):

- ``client-kill``: a random client is SIGKILLed and started again (every 1-4 s);
- ``server-kill``: the server is killed -9 and started again on the same socket (every
  8-15 s); the clients reconnect and resume on their snapshot;
- ``postgres-restart``: Postgres is stopped for 2-6 s while the sessions stream, and one client
  is killed meanwhile, so it must open its session again once Postgres is back (every 8-15 s);
- ``worker-kill``: a random decode worker is SIGKILLed (every 1-4 s);
- ``worker-stop``: a stopped worker under the largest batches. The clients stream batches of
  ``--stop-batch`` (default 65,536, the largest a session may ask for: each task carries
  512 KiB of positions, more than a socket buffer holds) of tiny samples (one float32) from
  a dataset of ``--stop-records`` (default four batches); a random decode worker is stopped
  with SIGSTOP for 1-10 s (every 2-5 s), then continued (SIGCONT) or killed (SIGKILL), half
  and half. The server runs with ``--task-timeout-s 5``, so a worker stopped longer is
  killed by the pool's task deadline first and its tasks are redone by the others;
- ``watch-flood``: calls that need no place a trainer needs, from callers without the token.
  The server runs on TCP loopback with ``--auth-token-file`` (and ``--reflection``), the
  clients pass the token (``BATCHD_AUTH_TOKEN``), and a thread floods the server without it
  for the whole run: rounds of 200 Health ``Watch`` streams in flight at once on four
  connections, 16 ``Watch`` calls with 64 KiB service names, and every tenth round a
  reflection call; each call is held until the server ends it (or for 10 s), then cancelled.
  Its faults are the rounds; a line under the table counts the flood's calls by the code
  they ended with (a Watch the server answered is a problem: none may be without the token);
- ``bad-objects`` and ``hostile-parquet``: bad data (``bench/_chaos_data.py``): objects of no
  size and of too many bytes in a real S3-compatible store, read through a node cache whose
  files are damaged meanwhile; Parquet files with a hostile page header and a ZSTD bomb,
  while decode workers are killed. Samples the server recorded bad are not lost; those that
  must be bad and were not recorded are a problem of the run.

At the end the clients finish their epoch and exit, the server gets SIGTERM, and the table
says, per scenario: runs, faults injected, epochs completed, samples delivered in them,
samples lost and duplicated (per epoch, each sample of the split must come exactly once, in
batch order), batchd segments left in /dev/shm by the run's server instances, processes
of the run (servers, workers, clients) still alive, and the server's resident memory (VmRSS)
once it is ready and once the faults end (of the run that grew most; not where the server
was restarted), with the growth of its shared memory (the batches it wrote) apart.

Run: ``python bench/chaos.py`` (8 scenarios x 60 s), ``--quick`` (15 s each).
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import ipaddress
import os
import random
import secrets
import select
import shutil
import signal
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import sqlalchemy as sa
from _chaos_data import DATA_SCENARIOS, DATA_SETTINGS, BadData, data_store, prepare, recorded_bad
from _chaos_data import INTERVALS_S as DATA_INTERVALS_S
from _chaos_data import inject as inject_data
from _common import closing_line, machine_busy_s, machine_lines, markdown_table, own_cpu_s
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from batchd_server.catalog import migrate
from batchd_server.catalog.db import make_engine

TESTS_DIR = Path(__file__).resolve().parent.parent / "tests"
sys.path.insert(0, str(TESTS_DIR))

from chaos_harness import (  # noqa: E402  (tests/ goes on the path first)
    ClientFleet,
    ServerProcess,
    Tally,
    alive,
    shm_entries,
    tally,
    wait_until,
)
from pgserver import ThrowawayPostgres  # noqa: E402
from serving import SHM, record_dataset  # noqa: E402

SCENARIOS = (
    "client-kill",
    "server-kill",
    "postgres-restart",
    "worker-kill",
    "worker-stop",
    "watch-flood",
    *DATA_SCENARIOS,
)
INTERVALS_S = {
    **DATA_INTERVALS_S,
    "client-kill": (1.0, 4.0),
    "server-kill": (8.0, 15.0),
    "postgres-restart": (8.0, 15.0),
    "worker-kill": (1.0, 4.0),
    "worker-stop": (2.0, 5.0),
    "watch-flood": (1.0, 1.0),  # no faults of its own: how often it checks the clients
}
OUTAGE_S = (2.0, 6.0)
STOP_TASK_TIMEOUT_S = 5.0
"""The server's ``--task-timeout-s`` in ``worker-stop``."""
STOPPED_S = (1.0, 2 * STOP_TASK_TIMEOUT_S)
LARGE = "records-large"
"""The dataset of ``worker-stop``: tiny samples, batches of ``--stop-batch``."""
TRANSPORTS = ["shm", "shm", "inline", "inline"]
WORKERS = 2
LEASE_S = 3.0
FINISH_S = 300.0
LOOPBACK = "127.0.0.1:0"
"""Where ``watch-flood``'s server listens: TCP loopback, a free port."""
FLOOD_STREAMS = 200
"""watch-flood: tokenless Watch streams in flight at once, per round."""
FLOOD_CHANNELS = 4
"""watch-flood: connections the streams are spread over."""
FLOOD_BIG_NAMES = 16
"""watch-flood: Watch calls per round whose service name is ``BIG_NAME_BYTES`` long."""
BIG_NAME_BYTES = 64 << 10
FLOOD_REFLECT_EVERY = 10
"""watch-flood: a reflection call every this many rounds."""
FLOOD_CALL_S = 10.0
"""watch-flood: a call neither answered nor refused by then ends DEADLINE_EXCEEDED."""
FLOOD_PAUSE_S = 0.05
"""watch-flood: between rounds, the pace of the flood."""
FLOOD_MAX_CALLS = 200_000
"""watch-flood: the most calls of one run, whatever its duration."""


@dataclass
class Row:
    scenario: str
    runs: int = 0
    faults: int = 0
    tally: Tally = field(default_factory=Tally)
    leaked_segments: int = 0
    leaked_processes: int = 0
    problems: list[str] = field(default_factory=list)
    endings: collections.Counter[str] = field(default_factory=collections.Counter)
    """How the stops of ``worker-stop`` ended."""
    flood: collections.Counter[tuple[str, str]] = field(default_factory=collections.Counter)
    """``watch-flood``'s calls by (kind, the code they ended with; "answered")."""
    bad: collections.Counter[str] = field(default_factory=collections.Counter)
    """The data scenarios' samples recorded bad, by kind."""
    damage: collections.Counter[str] = field(default_factory=collections.Counter)
    """The data scenarios' faults, by what they did."""
    memory: tuple[float, float, float] | None = None
    """The server's VmRSS at the start and at the end and its shared memory's growth (MiB),
    of the run that grew most."""

    def add_memory(self, start: tuple[float, float], end: tuple[float, float]) -> None:
        """One run's (VmRSS, RssShmem) in MiB at the start and at the end."""
        if self.memory is None or end[0] - start[0] > self.memory[1] - self.memory[0]:
            self.memory = (start[0], end[0], end[1] - start[1])

    def memory_cell(self) -> str:
        if self.memory is None:
            return "—"
        start, end, shm = self.memory
        return f"{start:.0f} → {end:.0f} ({end - start:+.0f}; shm {shm:+.0f})"

    def flood_cell(self) -> str:
        if not self.flood:
            return "—"
        refused = sum(n for (_, code), n in self.flood.items() if code != "answered")
        return f"{refused:,} of {self.flood.total():,}"

    def cells(self) -> list[str]:
        t = self.tally
        return [
            self.scenario,
            str(self.runs),
            str(self.faults),
            str(t.epochs),
            f"{t.samples:,}",
            str(t.lost),
            str(t.duplicated),
            str(self.leaked_segments),
            str(self.leaked_processes),
            self.memory_cell(),
            self.flood_cell(),
        ]


def memory_mib(pid: int) -> tuple[float, float]:
    """VmRSS and RssShmem of process ``pid``, in MiB."""
    fields = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        name, _, value = line.partition(":")
        if name in ("VmRSS", "RssShmem"):
            fields[name] = int(value.split()[0]) / 1024
    return fields["VmRSS"], fields.get("RssShmem", 0.0)


class WatchFlood:
    """``watch-flood``'s caller without a token: a thread that sends round after round of
    tokenless calls to ``target`` (a loopback address) until it is stopped or has made
    ``FLOOD_MAX_CALLS``. A round: ``FLOOD_STREAMS`` Health Watch streams for the server's
    own health, ``FLOOD_BIG_NAMES`` Watch calls for 64 KiB service names and, every
    ``FLOOD_REFLECT_EVERY`` rounds, a reflection call; each is held until the server ends it
    (or ``FLOOD_CALL_S``), then cancelled, and counted in ``outcomes``."""

    def __init__(self, target: str) -> None:
        host = target.rsplit(":", 1)[0].strip("[]")
        if not ipaddress.ip_address(host).is_loopback:
            raise ValueError(f"watch-flood only floods loopback addresses, not {target!r}")
        self.target = target
        self.rounds = 0
        self.outcomes: collections.Counter[tuple[str, str]] = collections.Counter()
        self.error: BaseException | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="watch-flood", daemon=True)

    def __enter__(self) -> WatchFlood:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(2 * FLOOD_CALL_S + 30)
        if self._thread.is_alive():
            self.error = TimeoutError("the flood thread did not end its round in time")

    def _run(self) -> None:
        # Channels of their own connection each (no shared subchannel), and none carries a
        # token: this is the caller who has none.
        options = [("grpc.use_local_subchannel_pool", 1), ("grpc.max_send_message_length", -1)]
        channels = [grpc.insecure_channel(self.target, options) for _ in range(FLOOD_CHANNELS)]
        try:
            while not self._stop.is_set() and self.outcomes.total() < FLOOD_MAX_CALLS:
                self._round(channels)
                self.rounds += 1
                self._stop.wait(FLOOD_PAUSE_S)  # the flood's pace, not a synchronisation
        except BaseException as e:  # reported in the table, not lost in a thread
            self.error = e
        finally:
            for channel in channels:
                channel.close()

    def _round(self, channels: list[grpc.Channel]) -> None:
        health = [health_pb2_grpc.HealthStub(c) for c in channels]
        calls: list[tuple[str, grpc.Call]] = []
        for i in range(FLOOD_STREAMS):
            request = health_pb2.HealthCheckRequest(service="")
            calls.append(("Watch", health[i % len(health)].Watch(request, timeout=FLOOD_CALL_S)))
        for i in range(FLOOD_BIG_NAMES):
            name = f"flood-{self.rounds:06d}-{i:02d}".ljust(BIG_NAME_BYTES, "x")
            request = health_pb2.HealthCheckRequest(service=name)
            calls.append(
                ("Watch 64 KiB name", health[i % len(health)].Watch(request, timeout=FLOOD_CALL_S))
            )
        if self.rounds % FLOOD_REFLECT_EVERY == 0:
            stub = reflection_pb2_grpc.ServerReflectionStub(channels[0])
            ask = iter([reflection_pb2.ServerReflectionRequest(list_services="")])
            calls.append(("reflection", stub.ServerReflectionInfo(ask, timeout=FLOOD_CALL_S)))
        try:
            for kind, call in calls:
                try:
                    next(call)
                    self.outcomes[kind, "answered"] += 1
                except grpc.RpcError as e:
                    self.outcomes[kind, e.code().name] += 1
                except StopIteration:
                    self.outcomes[kind, "OK, nothing sent"] += 1
        finally:
            for _, call in calls:
                call.cancel()


def inject(
    scenario: str,
    rng: random.Random,
    server: ServerProcess,
    fleet: ClientFleet,
    pg: ThrowawayPostgres,
    instances: set[str],
    row: Row,
) -> None:
    """One fault of ``scenario``."""
    if scenario == "client-kill":
        fleet.kill(rng.randrange(len(TRANSPORTS)))
    elif scenario == "server-kill":
        server.kill9()
        instances.add(server.start())
    elif scenario == "postgres-restart":
        pg.pause()
        try:
            fleet.kill(rng.randrange(len(TRANSPORTS)))  # it reopens once Postgres is back
            time.sleep(rng.uniform(*OUTAGE_S))  # the outage's length, not a synchronisation
        finally:
            pg.resume()
    elif scenario == "worker-kill":
        workers = server.worker_pids()
        if workers:
            os.kill(rng.choice(workers), signal.SIGKILL)
    elif scenario == "worker-stop":
        stop_a_worker(rng, server, row)
    else:
        raise ValueError(f"unknown scenario {scenario!r}")


def stop_a_worker(rng: random.Random, server: ServerProcess, row: Row) -> None:
    """SIGSTOP a random decode worker for a while, then SIGCONT or SIGKILL it, unless the
    pool's task deadline killed it first; counts which in ``row.endings``."""
    workers = server.worker_pids()
    if not workers:
        return
    stopped_s, ending = rng.uniform(*STOPPED_S), rng.choice([signal.SIGCONT, signal.SIGKILL])
    try:
        # A pidfd, not the pid: once the pool has killed the worker, its pid may be reused.
        pidfd = os.pidfd_open(rng.choice(workers))
    except ProcessLookupError:
        return
    try:
        signal.pidfd_send_signal(pidfd, signal.SIGSTOP)
        time.sleep(stopped_s)  # how long it stays stopped, not a synchronisation
        if select.select([pidfd], [], [], 0)[0]:  # readable: the process has exited
            row.endings["killed by the pool's task deadline"] += 1
            return
        with contextlib.suppress(ProcessLookupError):
            signal.pidfd_send_signal(pidfd, ending)
        row.endings[ending.name] += 1
    finally:
        os.close(pidfd)


def run_once(
    scenario: str,
    pg: ThrowawayPostgres,
    url: str,
    split: set[int],
    rng: random.Random,
    duration_s: float,
    workdir: Path,
    row: Row,
    stop_batch: int,
    data: BadData | None = None,
) -> None:
    """One run of ``scenario`` on a fresh server; adds what it saw to ``row``. A data
    scenario's ``data`` says what its clients read (``bench/_chaos_data.py``)."""
    stopping, flooding = scenario == "worker-stop", scenario == "watch-flood"
    extra_args: tuple[str, ...] = data.args(workdir) if data is not None else ()
    client_env: dict[str, str] = {}
    if stopping:
        extra_args = ("--task-timeout-s", f"{STOP_TASK_TIMEOUT_S:g}")
    if flooding:  # a token server, so that the flood's calls are the unauthenticated kind
        token, token_file = secrets.token_urlsafe(24), workdir / "token"
        with open(os.open(token_file, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600), "w") as f:
            f.write(token)
        extra_args = ("--auth-token-file", str(token_file), "--reflection")
        client_env = {"BATCHD_AUTH_TOKEN": token}
    server = ServerProcess(
        url,
        workdir / "grpc.sock",
        workdir,
        workers=WORKERS,
        lease_timeout_s=LEASE_S,
        extra_args=extra_args,
        listen=LOOPBACK if flooding else "",
    )
    instances = {server.start()}
    start_memory = memory_mib(server.pid)
    first_pid = server.pid
    fleet = ClientFleet(
        server.target, workdir / "clients", TRANSPORTS, seed=rng.randrange(1 << 30), env=client_env
    )
    if stopping:  # tiny samples in the largest batches
        fleet.batch_size, fleet.floats, fleet.dataset = stop_batch, 1, LARGE
    if data is not None:
        fleet.dataset = data.dataset
    try:
        fleet.workdir.mkdir()
        fleet.start_all()
        flood = WatchFlood(server.target) if flooding else None
        with flood or contextlib.nullcontext():
            end = time.monotonic() + duration_s
            while time.monotonic() < end:
                time.sleep(rng.uniform(*INTERVALS_S[scenario]))  # the fault schedule
                if fleet.failed():
                    row.problems += fleet.failed()
                    break
                if data is not None:
                    row.damage[inject_data(rng, data, workdir, server.worker_pids())] += 1
                    row.faults += 1
                elif flood is None:
                    inject(scenario, rng, server, fleet, pg, instances, row)
                    row.faults += 1
        if flood is not None:
            row.faults += flood.rounds
            row.flood.update(flood.outcomes)
            if flood.error is not None:
                row.problems.append(f"the flood failed: {flood.error!r}")
        if server.process is not None and server.process.poll() is None and server.pid == first_pid:
            row.add_memory(start_memory, memory_mib(server.pid))
        try:
            fleet.finish(FINISH_S)
        except RuntimeError as e:
            row.problems.append(str(e))
        code = server.stop()
        if code != 0:
            row.problems.append(f"the server exited {code}:\n{server.log_text()[-3000:]}")
    finally:
        for process in fleet.processes:
            if process is not None and process.poll() is None:
                process.kill()
                process.wait(30)
        server.stop()
    row.runs += 1
    row.leaked_segments += sum(len(shm_entries(SHM, i)) for i in instances)
    ours = server.spawned | fleet.spawned
    try:
        wait_until(lambda: not alive(ours), "the run's processes to exit", 15)
    except TimeoutError:
        row.leaked_processes += len(alive(ours))
    if data is not None:  # a bad sample recorded is not lost; one that must be bad is
        engine = make_engine(url)
        try:
            bad = recorded_bad(engine, data.dataset)
        finally:
            engine.dispose()
        row.bad.update(bad.values())
        for sample, kind in sorted(data.must_be_bad.items()):
            if sample not in bad or kind not in ("", bad[sample]):
                got = bad.get(sample, "not recorded bad")
                row.problems.append(f"sample {sample}: {got}, where it must be {kind or 'bad'}")
        split = split - bad.keys()
    row.tally.add(tally([fleet.log(i) for i in range(len(TRANSPORTS))], split))


def split_ids(conn: sa.Connection, dataset: str) -> set[int]:
    """The sample ids of ``dataset``'s train split."""
    query = sa.text(
        "SELECT s.id FROM samples s JOIN datasets d ON d.id = s.dataset_id "
        "WHERE d.name = :name AND s.split = 'train'"
    )
    return set(conn.scalars(query, {"name": dataset}))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--duration", type=float, default=60.0, help="seconds per run")
    parser.add_argument("--runs", type=int, default=1, help="runs per scenario")
    parser.add_argument("--seed", type=int, default=0, help="seeds the fault schedule")
    parser.add_argument("--records", type=int, default=2000, help="samples in the split")
    parser.add_argument("--only", nargs="+", choices=SCENARIOS, default=list(SCENARIOS))
    parser.add_argument("--quick", action="store_true", help="15 s per run")
    parser.add_argument(
        "--stop-batch", type=int, default=1 << 16, help="worker-stop: the clients' batch size"
    )
    parser.add_argument(
        "--stop-records",
        type=int,
        default=0,
        help="worker-stop: samples in its split (default: four batches)",
    )
    args = parser.parse_args()
    stop_records = args.stop_records or 4 * args.stop_batch
    duration = 15.0 if args.quick else args.duration
    started, busy0, own0 = time.perf_counter(), machine_busy_s(), own_cpu_s()
    for line in machine_lines():
        print(line)
    print(
        f"settings: scenarios {', '.join(args.only)}; {args.runs} run(s) of {duration:g} s "
        f"each; seed {args.seed}; {len(TRANSPORTS)} clients ({', '.join(TRANSPORTS)}), batch "
        f"16 of {args.records:,} records of 32 float32, checkpoint after every batch; "
        f"server --workers {WORKERS} --lease-timeout-s {LEASE_S:g}; catalog: throwaway "
        "Postgres (tests/pgserver.py)"
        + (
            f"; worker-stop: batch {args.stop_batch:,} of {stop_records:,} records of 1 "
            f"float32, --task-timeout-s {STOP_TASK_TIMEOUT_S:g}"
            if "worker-stop" in args.only
            else ""
        )
        + (
            f"; watch-flood: server on TCP loopback with --auth-token-file and --reflection, "
            f"rounds of {FLOOD_STREAMS} tokenless Watch streams on {FLOOD_CHANNELS} "
            f"connections + {FLOOD_BIG_NAMES} Watch calls with {BIG_NAME_BYTES >> 10} KiB "
            f"names, a reflection call every {FLOOD_REFLECT_EVERY} rounds"
            if "watch-flood" in args.only
            else ""
        )
        + "".join(f"; {s}: {DATA_SETTINGS[s]}" for s in args.only if s in DATA_SETTINGS),
        flush=True,
    )
    rng = random.Random(args.seed)
    rows = []
    pg = ThrowawayPostgres.start()
    root = Path(tempfile.mkdtemp(prefix="batchd-chaos-"))
    stack = contextlib.ExitStack()
    try:
        s3 = stack.enter_context(data_store(args.only))
        url = pg.url("postgres")
        engine = make_engine(url)
        migrate.upgrade(engine)
        record_dataset(engine, root / "records", n=args.records)
        if "worker-stop" in args.only:
            record_dataset(engine, root / "large", n=stop_records, name=LARGE, floats=1)
        data = {
            s: prepare(s, engine, root / s, args.records, s3)
            for s in args.only
            if s in DATA_SCENARIOS
        }
        with engine.connect() as conn:
            splits = {name: split_ids(conn, name) for name in ("records", LARGE)}
            splits.update({s: split_ids(conn, d.dataset) for s, d in data.items()})
        engine.dispose()
        for scenario in args.only:
            row = Row(scenario)
            for run in range(args.runs):
                workdir = root / f"{scenario}-{run}"
                workdir.mkdir()
                print(f"  {scenario} run {run + 1}/{args.runs} ...", file=sys.stderr, flush=True)
                name = LARGE if scenario == "worker-stop" else "records"
                split = splits[scenario if scenario in data else name]
                run_once(
                    scenario, pg, url, split, rng, duration, workdir, row, args.stop_batch,
                    data.get(scenario),
                )  # fmt: skip
            rows.append(row)
    finally:
        stack.close()
        pg.stop()
        shutil.rmtree(root, ignore_errors=True)
    header = ["scenario", "runs", "faults", "epochs", "samples delivered", "lost"]
    header += ["duplicated", "leaked segments", "leaked processes"]
    header += ["server VmRSS MiB, start → end", "flood calls refused"]
    print()
    print(markdown_table(header, [r.cells() for r in rows]))
    for row in rows:
        if row.endings:
            endings = ", ".join(f"{how}: {n}" for how, n in sorted(row.endings.items()))
            print(f"\n{row.scenario}: stops ended by {endings}")
        if row.bad or row.damage:
            bad = ", ".join(f"{kind}: {n}" for kind, n in sorted(row.bad.items()))
            damage = ", ".join(f"{how}: {n}" for how, n in sorted(row.damage.items()))
            print(
                f"\n{row.scenario}: samples recorded bad by kind: {bad or 'none'}; faults: {damage}"
            )
        if row.flood:
            kinds = sorted({kind for kind, _ in row.flood})
            ends = "; ".join(
                f"{kind}: "
                + ", ".join(
                    f"{code} {n:,}" for (k, code), n in sorted(row.flood.items()) if k == kind
                )
                for kind in kinds
            )
            print(f"\n{row.scenario}: flood calls ended by {ends}")
            if any(code == "answered" for _, code in row.flood):
                row.problems.append("the server answered a call that carried no token")
        for problem in row.problems + row.tally.problems:
            print(f"\n{row.scenario}: {problem}")
    print(closing_line(started, busy0, own0))


if __name__ == "__main__":
    main()
