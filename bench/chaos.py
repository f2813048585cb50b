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
  killed by the pool's task deadline first and its tasks are redone by the others.

At the end the clients finish their epoch and exit, the server gets SIGTERM, and the table
says, per scenario: runs, faults injected, epochs completed, samples delivered in them,
samples lost and duplicated (per epoch, each sample of the split must come exactly once, in
batch order), batchd segments left in /dev/shm by the run's server instances, and processes
of the run (servers, workers, clients) still alive.

Run: ``python bench/chaos.py`` (5 scenarios x 60 s), ``--quick`` (15 s each).
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import os
import random
import select
import shutil
import signal
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import sqlalchemy as sa
from _common import closing_line, machine_busy_s, machine_lines, markdown_table, own_cpu_s

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

SCENARIOS = ("client-kill", "server-kill", "postgres-restart", "worker-kill", "worker-stop")
INTERVALS_S = {
    "client-kill": (1.0, 4.0),
    "server-kill": (8.0, 15.0),
    "postgres-restart": (8.0, 15.0),
    "worker-kill": (1.0, 4.0),
    "worker-stop": (2.0, 5.0),
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
        ]


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
) -> None:
    """One run of ``scenario`` on a fresh server; adds what it saw to ``row``."""
    stopping = scenario == "worker-stop"
    server = ServerProcess(
        url,
        workdir / "grpc.sock",
        workdir,
        workers=WORKERS,
        lease_timeout_s=LEASE_S,
        extra_args=("--task-timeout-s", f"{STOP_TASK_TIMEOUT_S:g}") if stopping else (),
    )
    fleet = ClientFleet(server.target, workdir / "clients", TRANSPORTS, seed=rng.randrange(1 << 30))
    if stopping:  # tiny samples in the largest batches
        fleet.batch_size, fleet.floats, fleet.dataset = stop_batch, 1, LARGE
    fleet.workdir.mkdir()
    instances = {server.start()}
    try:
        fleet.start_all()
        end = time.monotonic() + duration_s
        while time.monotonic() < end:
            time.sleep(rng.uniform(*INTERVALS_S[scenario]))  # the fault schedule
            if fleet.failed():
                row.problems += fleet.failed()
                break
            inject(scenario, rng, server, fleet, pg, instances, row)
            row.faults += 1
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
        ),
        flush=True,
    )
    rng = random.Random(args.seed)
    rows = []
    pg = ThrowawayPostgres.start()
    root = Path(tempfile.mkdtemp(prefix="batchd-chaos-"))
    try:
        url = pg.url("postgres")
        engine = make_engine(url)
        migrate.upgrade(engine)
        record_dataset(engine, root / "records", n=args.records)
        if "worker-stop" in args.only:
            record_dataset(engine, root / "large", n=stop_records, name=LARGE, floats=1)
        with engine.connect() as conn:
            splits = {name: split_ids(conn, name) for name in ("records", LARGE)}
        engine.dispose()
        for scenario in args.only:
            row = Row(scenario)
            for run in range(args.runs):
                workdir = root / f"{scenario}-{run}"
                workdir.mkdir()
                print(f"  {scenario} run {run + 1}/{args.runs} ...", file=sys.stderr, flush=True)
                split = splits[LARGE if scenario == "worker-stop" else "records"]
                run_once(scenario, pg, url, split, rng, duration, workdir, row, args.stop_batch)
            rows.append(row)
    finally:
        pg.stop()
        shutil.rmtree(root, ignore_errors=True)
    header = ["scenario", "runs", "faults", "epochs", "samples delivered", "lost"]
    header += ["duplicated", "leaked segments", "leaked processes"]
    print()
    print(markdown_table(header, [r.cells() for r in rows]))
    for row in rows:
        if row.endings:
            endings = ", ".join(f"{how}: {n}" for how, n in sorted(row.endings.items()))
            print(f"\n{row.scenario}: stops ended by {endings}")
        for problem in row.problems + row.tally.problems:
            print(f"\n{row.scenario}: {problem}")
    print(closing_line(started, busy0, own0))


if __name__ == "__main__":
    main()
