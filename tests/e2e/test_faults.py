"""Faults the batch path survives: killed workers, killed clients, a small /dev/shm, a
server killed without cleaning up. Real processes, real signals, real shared memory."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from collections import Counter
from pathlib import Path

import pytest
from sqlalchemy.engine import Engine

import batchd

import serving
from chaos_harness import wait_until
from serving import RECORD_FLOATS, batchd_segments, record_dataset, records_loader, serve
from shmns import run_with_small_shm, unavailable_reason

TESTS = Path(serving.__file__).parent  # the helpers' directory, for a child's sys.path


def test_killed_workers_batches_are_redone_exactly_once(engine: Engine, tmp_path: Path) -> None:
    """SIGKILL every worker while it holds batches mid-epoch: each sample still comes once."""
    record_dataset(engine, tmp_path / "r", n=203)
    url = engine.url.render_as_string(hide_password=False)
    # 51 batches of 4, more than the ring's 16 slots: work is left when the workers freeze.
    with (
        serve(url, tmp_path, workers=2) as srv,
        records_loader(srv, batch_size=4, seed=4) as loader,
    ):
        it = iter(loader)
        ids = [i for _ in range(2) for i in next(it)["sample_id"].tolist()]
        victims = srv.pool.pids()
        for pid in victims:  # frozen workers keep the tasks they are handed
            os.kill(pid, signal.SIGSTOP)
        wait_until(lambda: srv.pool.outstanding() > 0, "tasks handed to frozen workers", 30)
        for pid in victims:
            os.kill(pid, signal.SIGKILL)
        ids += [i for batch in it for i in batch["sample_id"].tolist()]
        # The second of two deaths in a row is replaced after a short backoff.
        wait_until(
            lambda: srv.pool.restarts == len(victims) and srv.pool.alive == 2,
            "both killed workers to be replaced",
            30,
        )
        assert not set(victims) & set(srv.pool.pids())
    counts = Counter(ids)
    assert len(counts) == 203 and set(counts.values()) == {1}


_CLIENT = textwrap.dedent(
    """
    import sys
    import batchd
    loader = batchd.Loader(sys.argv[1], dataset="records", batch_size=16,
                           pipeline=batchd.Array((32,), "float32", raw=True))
    it = iter(loader)
    next(it)
    print("holding a batch", flush=True)
    sys.stdin.read()
    """
)


def test_killed_client_ring_is_reclaimed_within_the_lease(engine: Engine, tmp_path: Path) -> None:
    """A client killed with SIGKILL: its ring is gone within the lease; the next client works."""
    record_dataset(engine, tmp_path / "r", n=203)
    url = engine.url.render_as_string(hide_password=False)
    lease_s = 2.0
    with serve(url, tmp_path, lease_timeout_s=lease_s) as srv:
        client = subprocess.Popen(
            [sys.executable, "-c", _CLIENT, srv.address],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        try:
            assert client.stdout is not None
            assert client.stdout.readline().strip() == "holding a batch"
            assert len(srv.sessions) == 1
            assert any("-ring-" in name for name in batchd_segments(srv.registry.instance))
            killed_at = time.monotonic()
            client.kill()
            client.wait(30)
        finally:
            client.kill()
            client.wait(30)

        def reclaimed() -> bool:
            rings = [n for n in batchd_segments(srv.registry.instance) if "-ring-" in n]
            return len(srv.sessions) == 0 and not rings

        wait_until(reclaimed, "the killed client's session to expire", lease_s + 10)
        # The reaper checks every lease/4; allow one period beyond the lease.
        assert time.monotonic() - killed_at < lease_s + 5
        with records_loader(srv, batch_size=16) as loader:
            assert sum(len(b["sample_id"]) for b in loader) == 203


_SMALL_SHM = textwrap.dedent(
    """
    import sys
    sys.path.insert(0, {tests!r})
    from pathlib import Path
    import numpy as np
    import batchd
    from batchd import errors
    from batchd_server.catalog import migrate
    from batchd_server.catalog.db import make_engine
    from serving import record_dataset, serve

    tmp = Path({tmp!r})
    url = f"sqlite:///{{tmp}}/catalog.db"
    engine = make_engine(url)
    migrate.upgrade(engine)
    records = record_dataset(engine, tmp / "big", n=24, floats=256 * 1024)  # 1 MiB each
    spec = batchd.Array((256 * 1024,), "float32", raw=True)
    with serve(url, tmp, workers=1) as srv:
        try:
            batchd.Loader(srv.address, dataset="records", batch_size=16, pipeline=spec)
        except errors.ResourceExhausted as e:
            print("REFUSED:", e, flush=True)
        with batchd.Loader(srv.address, dataset="records", batch_size=3, pipeline=spec,
                           shuffle=False) as loader:
            got = np.concatenate([b["array"].numpy() for b in loader])
        assert np.array_equal(got, records), "served records differ"
        print("SERVED", len(got), flush=True)
    """
)


def test_small_dev_shm_fails_at_open_with_the_remedy_and_a_fitting_session_works(
    tmp_path: Path,
) -> None:
    """With /dev/shm a 64 MB tmpfs (Docker's default): a session too big for it fails at
    OpenSession naming /dev/shm, free and needed bytes and the settings to change; nothing
    dies of SIGBUS; a session that fits serves every record."""
    reason = unavailable_reason()
    if reason is not None:
        pytest.skip(f"cannot mount a private tmpfs on /dev/shm here: {reason}")
    script = _SMALL_SHM.format(tests=str(TESTS), tmp=str(tmp_path))
    done = run_with_small_shm(script, size="64m", timeout_s=240)
    assert done.returncode == 0, f"exit {done.returncode}\n{done.stdout}\n{done.stderr}"
    refused = next(line for line in done.stdout.splitlines() if line.startswith("REFUSED:"))
    for needed in ("/dev/shm", "free", "needs", "shm_size", "sizeLimit"):
        assert needed in refused, f"{needed!r} missing from: {refused}"
    assert "SERVED 24" in done.stdout


def test_server_killed_without_cleanup_leaves_segments_the_next_run_sweeps(
    engine: Engine, tmp_path: Path
) -> None:
    """SIGKILL the server holding a session: its workers die with it, and the next server
    removes the segments it left in /dev/shm."""
    record_dataset(engine, tmp_path / "r", n=50)
    url = engine.url.render_as_string(hide_password=False)
    sock = tmp_path / "first.sock"
    env = {**os.environ, "BATCHD_DATABASE_URL": url, "BATCHD_WORKERS": "1"}
    first = subprocess.Popen(
        [sys.executable, "-m", "batchd_server.cli", "serve", "--listen", f"unix://{sock}"],
        env=env,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert first.stderr is not None
        for line in first.stderr:
            if "ready: serving on" in line:
                instance = line.split("segments batchd-", 1)[1].split("-*", 1)[0]
                break
        else:
            pytest.fail(f"the server exited {first.wait()} before it was ready")
        loader = batchd.Loader(
            f"unix://{sock}",
            dataset="records",
            batch_size=8,
            pipeline=batchd.Array((RECORD_FLOATS,), "float32", raw=True),
        )
        next(iter(loader))
        left = batchd_segments(instance)
        assert any("-ring-" in n for n in left) and any(n.endswith(".lock") for n in left)
        first.kill()
        first.wait(30)
    finally:
        first.kill()
        first.wait(30)
    loader.close()  # the server is gone: closing must not raise (the session died with it)
    assert batchd_segments(instance) == left, "segments of a killed server stay until a sweep"
    with serve(url, tmp_path):
        assert batchd_segments(instance) == []


def test_a_loader_idle_past_the_lease_reopens_its_session_and_keeps_the_order(
    engine: Engine, tmp_path: Path
) -> None:
    """A long pause between epochs (evaluation, checkpointing) outlives the session's lease;
    the next epoch reopens it on the same snapshot and serves the same batches."""
    record_dataset(engine, tmp_path / "r", n=100)
    url = engine.url.render_as_string(hide_password=False)
    with serve(url, tmp_path, lease_timeout_s=1.0) as srv:
        with records_loader(srv, batch_size=16, seed=2) as fresh:
            fresh.set_epoch(1)
            want = [b["sample_id"].tolist() for b in fresh]
        with records_loader(srv, batch_size=16, seed=2) as loader:
            first = [b["sample_id"].tolist() for b in loader]
            wait_until(lambda: len(srv.sessions) == 0, "the idle session to expire", 30)
            assert [b["sample_id"].tolist() for b in loader] == want != first
