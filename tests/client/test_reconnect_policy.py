"""The reconnect policy on its own: backoff until a deadline, then Unavailable naming the
target; errors other than Unavailable are not retried."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from batchd import errors
from batchd._reconnect import retry_until


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0
        self.sleeps: list[float] = []

    def __call__(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.sleeps.append(seconds)
        self.now += seconds


def scripted(outcomes: list[Exception | str]) -> Callable[[float], str]:
    """An attempt that raises or returns ``outcomes`` in turn, one per try."""
    tries = iter(outcomes)

    def attempt(left_s: float) -> str:
        outcome = next(tries)
        if isinstance(outcome, Exception):
            raise outcome
        return outcome

    return attempt


def test_retrying_stops_at_the_deadline_with_unavailable_naming_the_target() -> None:
    """A server that never comes back: tries with growing pauses, then one Unavailable that
    names the target, the timeout and the last error."""
    clock = FakeClock()
    lefts: list[float] = []

    def attempt(left_s: float) -> None:
        lefts.append(left_s)
        clock.now += 0.5  # each try takes a while
        raise errors.Unavailable(f"try {len(lefts)} refused")

    with pytest.raises(errors.Unavailable) as caught:
        retry_until(
            attempt,
            target="unix:///run/x.sock",
            timeout_s=10,
            lost_at=clock.now,
            cause=errors.Unavailable("gone"),
            clock=clock,
            sleep=clock.sleep,
        )
    message = str(caught.value)
    assert "'unix:///run/x.sock'" in message and "reconnect_timeout_s=10" in message
    assert f"try {len(lefts)} refused" in message
    assert clock.now >= 110 and all(0 < left <= 10 for left in lefts)
    assert max(clock.sleeps) <= 2.0 and clock.sleeps[1] > clock.sleeps[0] / 2


def test_a_server_that_comes_back_is_used_and_other_errors_are_not_retried() -> None:
    """The first try that succeeds returns; NotFound (the dataset is gone) goes straight up."""
    clock = FakeClock()
    attempt = scripted([errors.Unavailable("down"), errors.Unavailable("down"), "session"])
    kwargs = {"target": "t", "timeout_s": 60, "cause": errors.Unavailable("x"), "clock": clock}
    assert retry_until(attempt, lost_at=clock.now, sleep=clock.sleep, **kwargs) == "session"  # type: ignore[arg-type]

    def refused(left_s: float) -> str:
        raise errors.NotFound("no dataset 'd'")

    with pytest.raises(errors.NotFound):
        retry_until(refused, lost_at=clock.now, sleep=clock.sleep, **kwargs)  # type: ignore[arg-type]


def test_a_zero_timeout_makes_one_try_without_waiting() -> None:
    """reconnect_timeout_s=0: one try, told it has no time to wait; its error as it is."""
    lefts: list[float] = []

    def attempt(left_s: float) -> str:
        lefts.append(left_s)
        raise errors.Unavailable("still down")

    with pytest.raises(errors.Unavailable, match="still down"):
        retry_until(attempt, target="t", timeout_s=0, lost_at=0.0, cause=errors.Unavailable("x"))
    assert lefts == [0.0]


def test_a_refusal_from_a_server_that_is_back_is_retried_until_the_deadline() -> None:
    """ResourceExhausted (the old session still holds the client's place) is retried like an
    absent server; a refusal that lasts past the deadline ends as ResourceExhausted carrying
    the server's message, not as Unavailable."""
    clock = FakeClock()
    attempt = scripted([errors.Unavailable("down"), errors.ResourceExhausted("limit"), "session"])
    kwargs = {"target": "t", "timeout_s": 10, "cause": errors.Unavailable("x"), "clock": clock}
    assert retry_until(attempt, lost_at=clock.now, sleep=clock.sleep, **kwargs) == "session"  # type: ignore[arg-type]
    assert len(clock.sleeps) == 2

    def refused(left_s: float) -> str:
        clock.now += 0.5
        raise errors.ResourceExhausted("--client-max-sessions=1 reached for this client")

    with pytest.raises(errors.ResourceExhausted) as caught:
        retry_until(refused, lost_at=clock.now, sleep=clock.sleep, **kwargs)  # type: ignore[arg-type]
    message = str(caught.value)
    assert "still refused" in message and "reconnect_timeout_s=10" in message
    assert "--client-max-sessions=1 reached" in message


def test_tries_whose_sessions_were_lost_before_a_batch_keep_their_backoff() -> None:
    """A reopen that succeeded but lost its session before any batch counts: the next try
    waits as the third would (about 0.2 s, not at once), and a deadline that passes meanwhile
    says the server took sessions but lost them, not that it could not be reached."""
    clock = FakeClock()
    cause = errors.NotFound("expired")

    def retry(attempt: Callable[[float], str], lost_at: float, failed_before: int) -> str:
        return retry_until(
            attempt,
            target="t",
            timeout_s=10,
            lost_at=lost_at,
            cause=cause,
            failed_before=failed_before,
            clock=clock,
            sleep=clock.sleep,
        )

    assert retry(scripted(["session"]), clock.now, failed_before=2) == "session"
    assert len(clock.sleeps) == 1 and 0.1 <= clock.sleeps[0] <= 0.2
    with pytest.raises(errors.Unavailable, match=r"lost each before a batch came \(7 times"):
        retry(scripted([]), clock.now - 10, failed_before=7)
