"""The parts behind overload protection, without a server: the limit settings (flags and
BATCHD_* variables), the call counter with its per-client limit, and the worker pool's
round-robin queue; and the chaos harness's accounting, which the soak test relies on."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from batchd_server import cli, cli_serve
from batchd_server.api.admission import Admission
from batchd_server.config import ServerConfig
from batchd_server.errors import ResourceExhausted
from batchd_server.metrics.admission import REFUSED
from batchd_server.workers.fair_queue import FairQueue

from chaos_harness import tally

LIMITS = ("max_concurrent_rpcs", "client_max_calls")

URL = "sqlite:///x.db"


def test_limits_have_defaults_and_come_from_the_environment() -> None:
    """128 calls with 8 kept back, 32 calls and 64 sessions per client, half the shm budget
    per client; each BATCHD_* variable sets its field, and a bad one is named."""
    config = ServerConfig(database_url=URL)
    assert (config.max_concurrent_rpcs, config.reserved_rpcs) == (128, 8)
    assert (config.client_max_calls, config.client_max_sessions) == (32, 64)
    assert config.client_shm_quota == config.shm_budget_bytes // 2
    config = ServerConfig.from_env(
        {
            "BATCHD_DATABASE_URL": URL,
            "BATCHD_MAX_CONCURRENT_RPCS": "16",
            "BATCHD_CLIENT_MAX_CALLS": "5",
            "BATCHD_CLIENT_MAX_SESSIONS": "6",
            "BATCHD_CLIENT_SHM_QUOTA": "100MiB",
            "BATCHD_MAX_SESSIONS": "7",
        }
    )
    assert (config.max_concurrent_rpcs, config.reserved_rpcs) == (16, 2)
    assert (config.client_max_calls, config.client_max_sessions) == (5, 6)
    assert (config.client_shm_quota, config.max_sessions) == (100 << 20, 7)
    assert ServerConfig(database_url=URL, max_concurrent_rpcs=2).reserved_rpcs == 1
    with pytest.raises(ValueError, match="BATCHD_CLIENT_MAX_CALLS='many'"):
        ServerConfig.from_env({"BATCHD_DATABASE_URL": URL, "BATCHD_CLIENT_MAX_CALLS": "many"})
    with pytest.raises(ValueError, match="--max-concurrent-rpcs"):
        ServerConfig(database_url=URL, max_concurrent_rpcs=1)
    with pytest.raises(ValueError, match="--client-shm-quota"):
        ServerConfig(database_url=URL, client_shm_quota_bytes=1000)


def test_serve_flags_reach_the_config(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """--max-sessions, --max-concurrent-rpcs, --client-max-calls, --client-max-sessions and
    --client-shm-quota set the config serve runs with (flags win over variables)."""
    seen: list[ServerConfig] = []

    def fake_serve(args: argparse.Namespace, engine: object) -> int:
        seen.append(args.config)
        return 0

    monkeypatch.setattr(cli_serve, "cmd_serve", fake_serve)
    monkeypatch.setenv("BATCHD_CLIENT_MAX_CALLS", "3")
    code = cli.main(
        [
            "--database-url",
            f"sqlite:///{tmp_path / 'c.db'}",
            "serve",
            "--max-sessions",
            "9",
            "--max-concurrent-rpcs",
            "24",
            "--client-max-calls",
            "4",
            "--client-max-sessions",
            "2",
            "--client-shm-quota",
            "64MiB",
        ]
    )
    assert code == 0
    (config,) = seen
    assert (config.max_sessions, config.max_concurrent_rpcs) == (9, 24)
    assert (config.client_max_calls, config.client_max_sessions) == (4, 2)
    assert config.client_shm_quota == 64 << 20


def test_admission_counts_calls_in_all_and_per_client() -> None:
    """A client stops at its own limit while others go on; the server stops at its limit;
    a ticket given back twice counts once; each refusal is counted by the limit it hit."""
    refused = {k: REFUSED.labels(k)._value.get() for k in LIMITS}
    admission = Admission(max_calls=5, client_max_calls=2)
    a1, a2 = admission.admit("a", "M"), admission.admit("a", "M")
    with pytest.raises(ResourceExhausted, match="client 'a' has 2 calls in progress"):
        admission.admit("a", "M")
    b = [admission.admit("b", "M"), admission.admit("c", "M"), admission.admit("d", "M")]
    with pytest.raises(ResourceExhausted, match=r"serving 5 calls.*--max-concurrent-rpcs"):
        admission.admit("e", "M")
    assert admission.calls == 5
    assert {k: REFUSED.labels(k)._value.get() - refused[k] for k in LIMITS} == {
        "max_concurrent_rpcs": 1,
        "client_max_calls": 1,
    }
    a1.release()
    a1.release()
    assert admission.by_client() == {"a": 1, "b": 1, "c": 1, "d": 1}
    admission.admit("e", "M").release()
    for ticket in (a2, *b):
        ticket.release()
    assert admission.calls == 0 and admission.by_client() == {}


def test_fair_queue_serves_sessions_in_turn_and_each_in_order() -> None:
    """Items of sessions A, B, C come out A B C A B C ..., each session's in order; an item
    put back goes first, with its session; a session that joins waits for its turn."""
    queue: FairQueue[tuple[str, int]] = FairQueue(lambda item: item[0])
    for i in range(3):
        queue.append(("A", i))
    for i in range(2):
        queue.append(("B", i))
    queue.append(("C", 0))
    assert len(queue) == 6 and list(queue) == [
        ("A", 0),
        ("A", 1),
        ("A", 2),
        ("B", 0),
        ("B", 1),
        ("C", 0),
    ]
    got = [queue.popleft() for _ in range(4)]
    assert got == [("A", 0), ("B", 0), ("C", 0), ("A", 1)]
    queue.appendleft(("B", 0))  # redone after its worker died
    queue.append(("D", 0))
    got = [queue.popleft() for _ in range(len(queue))]
    assert got == [("B", 0), ("A", 2), ("D", 0), ("B", 1)]
    assert not queue
    with pytest.raises(IndexError):
        queue.popleft()
    queue.append(("A", 9))
    queue.clear()
    assert len(queue) == 0 and list(queue) == []


def test_the_chaos_tally_counts_lost_duplicated_and_resumed_epochs(tmp_path: Path) -> None:
    """A client log with a complete epoch written by two processes, a complete epoch with a
    sample twice, one missing and a foreign id, an epoch cut short and a line cut by a
    kill: two epochs counted, one resumed, two lost, two duplicated."""

    def line(ids: list[int], epoch: int, next_batch: int, pid: int) -> str:
        state = {"epoch": epoch, "next_batch": next_batch, "num_batches": 3}
        return json.dumps({"ids": ids, "state": state, "pid": pid}) + "\n"

    log = tmp_path / "client-0.jsonl"
    log.write_text(
        line([0, 1], 0, 1, 1)
        + line([2, 3], 0, 2, 1)
        + line([4, 5], 1, 0, 2)  # the epoch's last batch: the state points at the next
        + line([0, 1], 1, 1, 2)
        + line([2, 2], 1, 2, 2)
        + line([4, 9], 2, 0, 2)
        + line([0, 1], 2, 1, 2)  # epoch 2 is cut short by the end of the run
        + '{"ids": [1'
    )
    result = tally([log, tmp_path / "never-written.jsonl"], set(range(6)))
    assert (result.epochs, result.samples, result.resumed) == (2, 12, 1)
    assert (result.lost, result.duplicated) == (2, 2)
    assert not result.problems
