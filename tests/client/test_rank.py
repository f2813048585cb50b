"""Rank and world size: from the arguments, torch.distributed, or RANK / WORLD_SIZE."""

from __future__ import annotations

from pathlib import Path

import pytest

from batchd._pipelines import resolve_rank
from batchd.errors import InvalidArgument


def test_rank_defaults_to_a_single_process() -> None:
    """Without arguments, torch.distributed or environment, rank 0 of 1."""
    assert resolve_rank(None, None, environ={}) == (0, 1)


def test_rank_comes_from_the_environment_unless_given() -> None:
    """RANK / WORLD_SIZE fill what the caller did not pass."""
    env = {"RANK": "2", "WORLD_SIZE": "4"}
    assert resolve_rank(None, None, environ=env) == (2, 4)
    assert resolve_rank(1, None, environ=env) == (1, 4)
    assert resolve_rank(0, 2, environ=env) == (0, 2)


@pytest.mark.parametrize(
    ("env", "words"),
    [
        ({"RANK": "x", "WORLD_SIZE": "2"}, "RANK='x'"),
        ({"RANK": "3", "WORLD_SIZE": "2"}, "environment"),
        ({"WORLD_SIZE": "0"}, "world_size=0"),
    ],
)
def test_bad_rank_environment_is_named(env: dict[str, str], words: str) -> None:
    """A malformed or inconsistent RANK / WORLD_SIZE is an InvalidArgument naming it."""
    with pytest.raises(InvalidArgument, match=words):
        resolve_rank(None, None, environ=env)


def test_initialised_torch_distributed_wins_over_the_environment(tmp_path: Path) -> None:
    """With a process group up, its rank and world size are used, not RANK / WORLD_SIZE."""
    import torch.distributed as dist

    dist.init_process_group(
        "gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1
    )
    try:
        assert resolve_rank(None, None, environ={"RANK": "3", "WORLD_SIZE": "8"}) == (0, 1)
    finally:
        dist.destroy_process_group()
