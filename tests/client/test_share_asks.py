"""A ``share=`` Loader asks its server to start each epoch at its share group's position
(``StreamStart.join_share``) and leaves the decision to the server (NOTE [ Share groups ] on
the server): it asks even where the server will refuse, and follows what the server serves.

``WireDouble`` never rotates an epoch, as a server that refuses the join; that the real
server refuses a stream that may not join is ``tests/server/sessions/test_share_dispatch.py``.
"""

from __future__ import annotations

from typing import Any

import pytest

import batchd

from resume import assert_resume_yields_the_rest, sample_ids


def _loader(address: str, **options: Any) -> batchd.Loader:
    defaults: dict[str, Any] = {"dataset": "synthetic", "batch_size": 3, "device": "cpu"}
    return batchd.Loader(address, **{**defaults, **options})


@pytest.mark.parametrize(
    "options",
    [
        pytest.param({}, id="one-rank"),
        pytest.param({"rank": 0, "world_size": 2}, id="a-rank-of-two"),
    ],
)
def test_a_share_loader_asks_at_every_epoch_and_serves_what_the_server_serves(
    double: Any, options: dict[str, Any]
) -> None:
    """Every stream of a share= Loader asks to join, a rank of a larger job's too; where the
    server does not rotate the epoch, the Loader serves it in its own order."""
    server, address = double
    with _loader(address, shuffle=False, **options) as alone:
        reference = [sample_ids(alone), sample_ids(alone)]
    alone_starts = len(server.starts)
    with _loader(address, shuffle=False, share="sweep", **options) as member:
        assert [sample_ids(member), sample_ids(member)] == reference
    assert [s.join_share for s in server.starts] == [False] * alone_starts + [True] * 2


def test_a_resumed_share_loader_asks_too_and_yields_exactly_the_rest(double: Any) -> None:
    """A share= Loader resumed part way through an epoch asks to join as well (the server
    decides that it may not) and yields exactly the rest of the run."""
    server, address = double
    assert_resume_yields_the_rest(
        lambda: _loader(address, seed=7, share="sweep"), epochs=2, stop_after=2
    )
    resumed = [s for s in server.starts if s.start_batch > 0]
    assert resumed and all(s.join_share for s in resumed)
