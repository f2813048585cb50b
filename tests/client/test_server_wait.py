"""``wait_for_server_s``: a Loader where no server answers gives up with an error that names
the address and the wait (having said that it waits), or -- not told to wait -- fails at
once saying how to wait for a pool that scales to zero; refusals other than an absent server
are not waited out; the option and ``$BATCHD_WAIT_FOR_SERVER_S`` are checked."""

from __future__ import annotations

import itertools
import logging
import re
from pathlib import Path
from typing import Any

import pytest

import batchd
from batchd._server_wait import ServerWait, wait_for_server
from batchd.errors import InvalidArgument, NotFound, Unavailable


def _loader(target: str, **options: Any) -> batchd.Loader:
    defaults: dict[str, Any] = {"dataset": "synthetic", "batch_size": 3, "device": "cpu"}
    return batchd.Loader(target, **{**defaults, **options})


@pytest.mark.timeout(120)
def test_with_no_server_the_wait_runs_out_in_an_error_naming_the_address_and_the_wait(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Nothing listens on the socket: the Loader says it waits, tries again, then raises
    Unavailable naming the target, wait_for_server_s and the last error (not a gRPC
    deadline)."""
    target = f"unix://{tmp_path}/nobody.sock"
    caplog.set_level(logging.WARNING, logger="batchd")
    with pytest.raises(Unavailable) as info:
        _loader(target, wait_for_server_s=0.6)
    message = str(info.value)
    assert f"no batchd server answered at {target!r} within wait_for_server_s=0.6 s" in message
    assert "the last error: cannot reach" in message and "DEADLINE" not in message
    said = [
        r.getMessage() for r in caplog.records if "waiting for the batchd server" in r.getMessage()
    ]
    assert said and repr(target) in said[0] and "s so far" in said[0]


@pytest.mark.timeout(120)
def test_the_wait_can_come_from_the_environment(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """$BATCHD_WAIT_FOR_SERVER_S is the default (a pod spec sets it for its trainers); the
    argument wins over it."""
    target = f"unix://{tmp_path}/nobody.sock"
    monkeypatch.setenv("BATCHD_WAIT_FOR_SERVER_S", "0.3")
    with pytest.raises(Unavailable, match=r"within wait_for_server_s=0\.3 s"):
        _loader(target)
    with pytest.raises(Unavailable, match="pass wait_for_server_s="):
        _loader(target, wait_for_server_s=0)
    monkeypatch.setenv("BATCHD_WAIT_FOR_SERVER_S", "soon")
    with pytest.raises(InvalidArgument, match=r"\$BATCHD_WAIT_FOR_SERVER_S='soon'"):
        _loader(target)


def test_not_told_to_wait_it_fails_at_once_and_says_how_to_wait(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The default (no variable set): one try, the usual error plus how to wait for a pool
    that scales to zero; nothing logged about waiting."""
    monkeypatch.delenv("BATCHD_WAIT_FOR_SERVER_S", raising=False)
    caplog.set_level(logging.DEBUG, logger="batchd")
    with pytest.raises(Unavailable) as info:
        _loader(f"unix://{tmp_path}/nobody.sock")
    assert "cannot reach" in str(info.value)
    assert "pool that scales to zero" in str(info.value) and "wait_for_server_s=" in str(info.value)
    assert not [r for r in caplog.records if "waiting for" in r.getMessage()]


@pytest.mark.parametrize("bad", [-1, float("nan"), 86401, "10"])
def test_a_bad_wait_is_refused_with_its_range(bad: Any) -> None:
    with pytest.raises(InvalidArgument, match=r"wait_for_server_s=.*between 0"):
        _loader("unix:///nowhere.sock", wait_for_server_s=bad)


def test_a_server_that_answers_with_a_refusal_is_not_waited_out(double: Any) -> None:
    """A live server that refuses (no such dataset) fails the Loader at once, wait or not."""
    _, address = double
    record = ServerWait()
    with pytest.raises(NotFound, match="nope"):
        wait_for_server(
            lambda left_s: _loader(address, dataset="nope"),
            target=address,
            wait_s=300,
            record=record,
        )
    assert record.tries == 1
    with pytest.raises(NotFound, match="nope"):
        _loader(address, dataset="nope", wait_for_server_s=300)


def test_the_wait_backs_off_and_logs_at_a_modest_rate(caplog: pytest.LogCaptureFixture) -> None:
    """On a clock of its own: tries over 40 s log the waiting 3 times (at once, then 15 s
    apart), and the pauses grow to 2 s; the answer after them is logged with the time waited."""
    now = [0.0]
    pauses: list[float] = []

    def sleep(seconds: float) -> None:
        pauses.append(seconds)
        now[0] += seconds

    def attempt(left_s: float) -> str:
        if now[0] < 40.0:
            raise Unavailable("connection refused")
        return "session"

    caplog.set_level(logging.WARNING, logger="batchd")
    record = ServerWait()
    result = wait_for_server(
        attempt,
        target="dns:///pool:50051",
        wait_s=600,
        record=record,
        clock=lambda: now[0],
        sleep=sleep,
    )
    assert result == "session" and record.waited_s >= 40.0 and record.tries == len(pauses) + 1
    said = [
        r.getMessage() for r in caplog.records if "waiting for the batchd server" in r.getMessage()
    ]
    so_far = [int(re.search(r"(\d+) s so far", m).group(1)) for m in said]  # type: ignore[union-attr]
    assert len(so_far) == 3 and so_far[0] == 0, said
    assert all(b - a >= 15 for a, b in itertools.pairwise(so_far)), said
    assert max(pauses) <= 2.0 and pauses[-1] >= 1.0 and pauses[0] <= 0.1
    assert any("answered after 4" in r.getMessage() for r in caplog.records)
