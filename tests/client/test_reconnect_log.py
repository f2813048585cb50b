"""The warning a Loader logs when it loses its server says that it reconnects and resumes
by itself, so that the advice in the error it quotes (create a new Loader and load its
state) is not taken for something the user must do."""

from __future__ import annotations

import logging

import pytest

from batchd import errors
from batchd._reconnect import retry_until


def test_the_lost_server_warning_says_the_loader_resumes_by_itself(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The cause quoted is the doorbell's (which ends with the manual remedy); the words
    before it say the reconnect resumes the epoch and nothing needs doing unless it fails."""
    cause = errors.Unavailable(
        "the batchd server closed the doorbell /dev/shm/bell: it stopped, or closed this "
        "session. Create a new Loader and load_state_dict(old.state_dict()) to resume"
    )
    caplog.set_level(logging.WARNING, logger="batchd")
    result = retry_until(
        lambda left_s: "back",
        target="unix:///run/batchd.sock",
        timeout_s=10.0,
        lost_at=0.0,
        cause=cause,
        clock=lambda: 1.0,
        sleep=lambda s: None,
    )
    assert result == "back"
    (lost,) = [r.getMessage() for r in caplog.records if "lost the server" in r.getMessage()]
    before_cause = lost[: lost.index(str(cause))]
    assert "resum" in before_cause and "nothing to do" in before_cause, lost
