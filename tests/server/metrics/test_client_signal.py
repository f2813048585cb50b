"""The autoscaler's stall signal weighs each client once (``metrics/stall.py``,
``RecentStall``), and a session's timings are accepted up to the batches it delivered
(``TimingAllowance``)."""

from __future__ import annotations

import pytest

from batchd_server.metrics import stall
from batchd_server.metrics.stall import MAX_TIMINGS_PER_ACK, RecentStall, TimingAllowance


def test_a_client_with_many_sessions_and_reports_counts_once_in_the_signal() -> None:
    """Client A reports 64 sessions' worth of stalled batches, client B one batch that did not
    wait: the signal is the mean of the two clients' ratios, 0.5, not A's 64 to B's 1."""
    recent = RecentStall(window_s=5.0)
    for _ in range(64):
        recent.add(1.0, 0.0, now=10.0, client="A")
    recent.add(0.0, 1.0, now=10.0, client="B")
    assert recent.ratio(10.0) == pytest.approx(0.5)
    # A client with nothing in the window leaves the signal, and the table.
    recent.add(0.0, 1.0, now=14.0, client="B")
    assert recent.ratio(16.0) == pytest.approx(0.0) and len(recent) == 1
    assert recent.ratio(30.0) is None and len(recent) == 0


def test_one_clients_acks_through_the_recording_path_count_once(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The same through ``record_client_timings``, as the ack readers call it: A's 64 acks of
    64 stalled batches each against B's one ack of one batch that did not wait."""
    recent = RecentStall(window_s=5.0)
    monkeypatch.setattr(stall, "RECENT_STALL", recent)
    for _ in range(64):
        stall.record_client_timings("signal", [2.0] * 64, [0.0] * 64, now=1.0, client="A")
    stall.record_client_timings("signal", [0.0], [1.0], now=1.0, client="B")
    assert recent.ratio(1.0) == pytest.approx(0.5)


def test_timings_are_accepted_up_to_the_batches_delivered() -> None:
    """3 batches delivered: an ack of 4,096 timings is cut to 3, the next gets none until
    another batch goes out; what may be saved up is bounded."""
    allowance = TimingAllowance()
    allowance.delivered(3)
    assert (
        stall.record_client_timings(
            "allowance",
            [0.1] * MAX_TIMINGS_PER_ACK,
            [0.1] * MAX_TIMINGS_PER_ACK,
            now=1.0,
            allowance=allowance,
        )
        == 3
    )
    assert stall.record_client_timings("allowance", [0.1], [0.1], now=1.0, allowance=allowance) == 0
    allowance.delivered()
    assert allowance.take(5) == 1
    allowance.delivered(10 * MAX_TIMINGS_PER_ACK)
    assert allowance.take(10 * MAX_TIMINGS_PER_ACK) == MAX_TIMINGS_PER_ACK
