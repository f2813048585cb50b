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
- ``worker-kill``: a random decode worker is SIGKILLed (every 1-4 s).

At the end the clients finish their epoch and exit, the server gets SIGTERM, and the table
says, per scenario: runs, faults injected, epochs completed, samples delivered in them,
samples lost and duplicated (per epoch, each sample of the split must come exactly once, in
batch order), batchd segments left in /dev/shm by the run's server instances, and processes
of the run (servers, workers, clients) still alive.

Run: ``python bench/chaos.py`` (4 scenarios x 60 s), ``--quick`` (15 s each).
"""

from __future__ import annotations

import argparse
import os
import random
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

SCENARIOS = ("client-kill", "server-kill", "postgres-restart", "worker-kill")
INTERVALS_S = {
    "client-kill": (1.0, 4.0),
    "server-kill": (8.0, 15.0),
    "postgres-restart": (8.0, 15.0),
    "worker-kill": (1.0, 4.0),
}
OUTAGE_S = (2.0, 6.0)
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
    else:
        raise ValueError(f"unknown scenario {scenario!r}")


def run_once(
    scenario: str,
    pg: ThrowawayPostgres,
    url: str,
    split: set[int],
    rng: random.Random,
    duration_s: float,
    workdir: Path,
    row: Row,
) -> None:
    """One run of ``scenario`` on a fresh server; adds what it saw to ``row``."""
    server = ServerProcess(
        url, workdir / "grpc.sock", workdir, workers=WORKERS, lease_timeout_s=LEASE_S
    )
    fleet = ClientFleet(server.target, workdir / "clients", TRANSPORTS, seed=rng.randrange(1 << 30))
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
            inject(scenario, rng, server, fleet, pg, instances)
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--duration", type=float, default=60.0, help="seconds per run")
    parser.add_argument("--runs", type=int, default=1, help="runs per scenario")
    parser.add_argument("--seed", type=int, default=0, help="seeds the fault schedule")
    parser.add_argument("--records", type=int, default=2000, help="samples in the split")
    parser.add_argument("--only", nargs="+", choices=SCENARIOS, default=list(SCENARIOS))
    parser.add_argument("--quick", action="store_true", help="15 s per run")
    args = parser.parse_args()
    duration = 15.0 if args.quick else args.duration
    started, busy0, own0 = time.perf_counter(), machine_busy_s(), own_cpu_s()
    for line in machine_lines():
        print(line)
    print(
        f"settings: scenarios {', '.join(args.only)}; {args.runs} run(s) of {duration:g} s "
        f"each; seed {args.seed}; {len(TRANSPORTS)} clients ({', '.join(TRANSPORTS)}), batch "
        f"16 of {args.records:,} records of 32 float32, checkpoint after every batch; "
        f"server --workers {WORKERS} --lease-timeout-s {LEASE_S:g}; catalog: throwaway "
        "Postgres (tests/pgserver.py)",
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
        with engine.connect() as conn:
            split = set(conn.scalars(sa.text("SELECT id FROM samples WHERE split = 'train'")))
        engine.dispose()
        for scenario in args.only:
            row = Row(scenario)
            for run in range(args.runs):
                workdir = root / f"{scenario}-{run}"
                workdir.mkdir()
                print(f"  {scenario} run {run + 1}/{args.runs} ...", file=sys.stderr, flush=True)
                run_once(scenario, pg, url, split, rng, duration, workdir, row)
            rows.append(row)
    finally:
        pg.stop()
        shutil.rmtree(root, ignore_errors=True)
    header = ["scenario", "runs", "faults", "epochs", "samples delivered", "lost"]
    header += ["duplicated", "leaked segments", "leaked processes"]
    print()
    print(markdown_table(header, [r.cells() for r in rows]))
    for row in rows:
        for problem in row.problems + row.tally.problems:
            print(f"\n{row.scenario}: {problem}")
    print(closing_line(started, busy0, own0))


if __name__ == "__main__":
    main()
