"""A server killed mid-epoch and restarted is invisible to the training loop: the Loader
reconnects, reopens its session on the same snapshot at the next undelivered batch, and
the epoch yields every sample once, in the uninterrupted order. Real server processes."""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from sqlalchemy.engine import Engine

import batchd
from batchd import errors

from serving import RECORD_FLOATS, batchd_segments, record_dataset

SERVE = [sys.executable, "-m", "batchd_server.cli", "serve"]


def start_server(url: str, sock: Path, log: Path, *flags: str) -> subprocess.Popen[bytes]:
    """``batchd-server serve`` on ``sock`` with ``flags``, logging to ``log`` (a file: a pipe
    nobody reads would fill and stall the server)."""
    env = {**os.environ, "BATCHD_DATABASE_URL": url, "BATCHD_WORKERS": "1"}
    with log.open("wb") as out:
        return subprocess.Popen(
            [*SERVE, "--listen", f"unix://{sock}", *flags], env=env, stdout=out, stderr=out
        )


def wait_ready(proc: subprocess.Popen[bytes], log: Path, timeout_s: float = 120) -> str:
    """The server's shm instance id, once its log says it is ready."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        text = log.read_text()
        if "ready: serving on" in text:
            return text.split("segments batchd-", 1)[1].split("-*", 1)[0]
        if proc.poll() is not None:
            pytest.fail(f"the server exited {proc.returncode} before it was ready:\n{text}")
        time.sleep(0.05)
    pytest.fail(f"the server was not ready within {timeout_s:g} s:\n{log.read_text()}")


def stop(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(30)


def _loader(sock: Path, transport: str, **kwargs: object) -> batchd.Loader:
    kwargs.setdefault("prefetch", 4)
    return batchd.Loader(
        f"unix://{sock}",
        dataset="records",
        batch_size=10,
        seed=3,
        transport=transport,
        device="cpu",
        pipeline=batchd.Array((RECORD_FLOATS,), "float32", raw=True),
        **kwargs,  # type: ignore[arg-type]
    )


def _first_server(engine: Engine, tmp_path: Path) -> tuple[str, Path, subprocess.Popen[bytes]]:
    """300 records, and a server started on them (not waited for): the catalog's URL, the
    server's socket (where a second server starts after it is killed), the process."""
    record_dataset(engine, tmp_path / "r", n=300)
    url = engine.url.render_as_string(hide_password=False)
    sock = tmp_path / "grpc.sock"
    return url, sock, start_server(url, sock, tmp_path / "first.log")


@pytest.mark.parametrize("transport", ["shm", "inline"])
def test_a_server_killed_mid_epoch_and_restarted_is_invisible_to_the_loop(
    engine: Engine, tmp_path: Path, transport: str
) -> None:
    """kill -9 the server after 6 batches and start a new one on the same socket (its old
    socket file and segments still there): no exception reaches the loop, and the epoch's
    sample ids are an uninterrupted run's, in order."""
    url, sock, first = _first_server(engine, tmp_path)
    second: subprocess.Popen[bytes] | None = None
    try:
        first_instance = wait_ready(first, tmp_path / "first.log")
        with _loader(sock, transport) as reference:
            want = [b["sample_id"].tolist() for b in reference]
        assert len(want) == 30
        got = []
        with _loader(sock, transport, reconnect_timeout_s=60) as loader:
            assert loader.transport == transport
            snapshot = loader.snapshot
            for i, batch in enumerate(loader):
                got.append(batch["sample_id"].tolist())
                if i == 5:
                    first.kill()
                    first.wait(30)
                    assert sock.exists(), "a killed server leaves its socket file"
                    left = batchd_segments(first_instance)
                    assert any("-ring-" in n for n in left)
                    second = start_server(url, sock, tmp_path / "second.log")
            assert second is not None
            assert loader.snapshot == snapshot
            assert loader.transport == transport
        assert got == want
        second_instance = wait_ready(second, tmp_path / "second.log")
        assert batchd_segments(first_instance) == [], "the new server sweeps the old segments"
    finally:
        first.kill()
        first.wait(30)
        if second is not None:
            stop(second)
    assert second.returncode == 0, (tmp_path / "second.log").read_text()
    assert batchd_segments(second_instance) == []


def test_a_server_that_stays_away_ends_the_loop_with_unavailable_naming_it(
    engine: Engine, tmp_path: Path
) -> None:
    """With no server back within reconnect_timeout_s, the loop gets Unavailable naming the
    target and the timeout."""
    record_dataset(engine, tmp_path / "r", n=100)
    url = engine.url.render_as_string(hide_password=False)
    sock = tmp_path / "grpc.sock"
    server = start_server(url, sock, tmp_path / "server.log")
    try:
        instance = wait_ready(server, tmp_path / "server.log")
        loader = _loader(sock, "inline", reconnect_timeout_s=2)
        it = iter(loader)
        next(it)
        server.kill()
        server.wait(30)
        started = time.monotonic()
        with pytest.raises(errors.Unavailable) as caught:
            for _ in it:
                pass
        waited = time.monotonic() - started
        loader.close()
    finally:
        server.kill()
        server.wait(30)
    message = str(caught.value)
    assert f"unix://{sock}" in message and "reconnect_timeout_s=2" in message
    assert waited < 30
    # The killed server's segments stay until the next server sweeps them; sweep them here.
    restarted = start_server(url, sock, tmp_path / "sweeper.log")
    try:
        wait_ready(restarted, tmp_path / "sweeper.log")
        assert batchd_segments(instance) == []
    finally:
        stop(restarted)


class _Refusals(logging.Handler):
    """Sets ``seen`` when the Loader logs a reconnect try the server refused with
    ResourceExhausted (``batchd._reconnect``'s debug record of a failed try)."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.seen = threading.Event()

    def emit(self, record: logging.LogRecord) -> None:
        args = record.args if isinstance(record.args, tuple) else ()
        if any(isinstance(a, errors.ResourceExhausted) for a in args):
            self.seen.set()


def _close_after_a_refusal(refused: threading.Event, holder: batchd.Loader) -> None:
    refused.wait(60)
    holder.close()


def test_a_reopen_refused_by_a_client_limit_is_retried_until_the_place_frees(
    engine: Engine, tmp_path: Path
) -> None:
    """The restarted server allows this client one session, and another Loader of the same
    process takes it before the reconnecting Loader asks: the reopen is refused
    (ResourceExhausted), retried, and succeeds once the other Loader closes. The loop sees no
    exception and the epoch is an uninterrupted run's."""
    record_dataset(engine, tmp_path / "r", n=300)
    url = engine.url.render_as_string(hide_password=False)
    sock = tmp_path / "grpc.sock"
    refusals = _Refusals()
    reconnect_log = logging.getLogger("batchd._reconnect")
    level = reconnect_log.level
    reconnect_log.addHandler(refusals)
    reconnect_log.setLevel(logging.DEBUG)
    first = start_server(url, sock, tmp_path / "first.log")
    second: subprocess.Popen[bytes] | None = None
    holder: batchd.Loader | None = None
    closer: threading.Thread | None = None
    try:
        wait_ready(first, tmp_path / "first.log")
        with _loader(sock, "shm") as reference:
            want = [b["sample_id"].tolist() for b in reference]
        got = []
        with _loader(sock, "shm", reconnect_timeout_s=60) as loader:
            for i, batch in enumerate(loader):
                got.append(batch["sample_id"].tolist())
                if i == 5:
                    first.kill()
                    first.wait(30)
                    second = start_server(
                        url, sock, tmp_path / "second.log", "--client-max-sessions", "1"
                    )
                    wait_ready(second, tmp_path / "second.log")
                    holder = _loader(sock, "shm")  # takes this client's one place
                    closer = threading.Thread(
                        target=_close_after_a_refusal, args=(refusals.seen, holder)
                    )
                    closer.start()
        assert refusals.seen.is_set(), "the reopen was never refused: the test proves nothing"
        assert got == want
    finally:
        refusals.seen.set()  # let the closer go whatever happened
        if closer is not None:
            closer.join(60)
        if holder is not None:
            holder.close()
        reconnect_log.removeHandler(refusals)
        reconnect_log.setLevel(level)
        first.kill()
        first.wait(30)
        if second is not None:
            stop(second)
    assert second is not None and second.returncode == 0, (tmp_path / "second.log").read_text()


@pytest.mark.parametrize("transport", ["shm", "inline"])
def test_a_rotated_epoch_survives_a_server_restart(
    engine: Engine, tmp_path: Path, transport: str
) -> None:
    """A share= Loader that joined its group 22 batches into the epoch (so it serves the
    epoch rotated) loses its server part way through: the new server, which knows no group,
    serves the rest of the same rotated epoch, every sample once."""
    url, sock, first = _first_server(engine, tmp_path)
    second: subprocess.Popen[bytes] | None = None
    try:
        first_instance = wait_ready(first, tmp_path / "first.log")
        with _loader(sock, transport) as reference:
            want = [b["sample_id"].tolist() for b in reference]
        got = []
        with _loader(sock, transport, share="g", prefetch=2) as leader:
            ahead = iter(leader)
            for _ in range(22):
                next(ahead)
            joiner = _loader(sock, transport, share="g", prefetch=2, reconnect_timeout_s=60)
            with joiner:
                for i, batch in enumerate(joiner):
                    got.append(batch["sample_id"].tolist())
                    if i == 0:
                        leader.close()
                    if i == 12:  # past the wrap: the epoch's first batches now
                        first.kill()
                        first.wait(30)
                        second = start_server(url, sock, tmp_path / "second.log")
        assert second is not None
        second_instance = wait_ready(second, tmp_path / "second.log")
        assert batchd_segments(first_instance) == [], "the new server sweeps the old segments"
        k = want.index(got[0])
        assert k >= 16, f"joined at batch {k}: not rotated, the test means a rotated epoch"
        assert got == want[k:] + want[:k]
    finally:
        first.kill()
        first.wait(30)
        if second is not None:
            stop(second)
    assert batchd_segments(second_instance) == []
