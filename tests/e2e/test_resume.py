"""Resume is exact on every transport: a fresh Loader given ``state_dict()`` yields exactly
the rest of the run, through a real server (the contract in ``tests/resume.py``)."""

from __future__ import annotations

from typing import Any

import pytest

import batchd
from batchd_server.api import RunningServer

from resume import assert_resume_yields_the_rest
from serving import records_loader

TRANSPORTS: dict[str, dict[str, Any]] = {
    "shm": {"transport": "shm"},
    "inline": {"transport": "inline"},
    "shm-zero-copy": {"transport": "shm", "zero_copy": True},
}
BATCHES_PER_EPOCH = 7  # rank 1 of 2 over 203 records: 102 samples, 16 a batch


@pytest.mark.parametrize("way", sorted(TRANSPORTS))
def test_resuming_from_state_dict_yields_exactly_the_rest_of_the_run(
    server: RunningServer, way: str
) -> None:
    """Rank 1 of 2, two epochs from epoch 2, stopped before the first batch, after one,
    one before the boundary, on it, and inside the second epoch: the rest is exact."""
    options = TRANSPORTS[way]

    def make_loader() -> batchd.Loader:
        loader = records_loader(server, seed=3, world_size=2, rank=1, prefetch=2, **options)
        assert loader.transport == options["transport"]
        assert len(loader) == BATCHES_PER_EPOCH
        loader.set_epoch(2)
        return loader

    for stop_after in (0, 1, 6, 7, 9):
        state = assert_resume_yields_the_rest(make_loader, epochs=2, stop_after=stop_after)
        epoch, next_batch = divmod(stop_after, BATCHES_PER_EPOCH)
        assert (state["epoch"], state["next_batch"]) == (2 + epoch, next_batch)
