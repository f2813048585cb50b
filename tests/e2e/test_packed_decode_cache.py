"""Packed sessions through the decode cache, end to end: a real server, real workers.

A packed session's documents read one by one (whole token files) go through the decode
cache like any session's samples: its later epochs are served from the cache, and every
packed batch equals, byte for byte, the one a session that opts out of the cache gets.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
from sqlalchemy.engine import Engine

import batchd
from batchd_server.metrics import REGISTRY

from serving import serve, token_dataset

pytestmark = pytest.mark.slow(seconds=30)

EPOCHS = (0, 1, 2)

Batches = list[dict[str, np.ndarray]]


def packed_epochs(address: str, **options: Any) -> tuple[dict[int, Batches], list[float]]:
    """Every packed batch of each epoch of :data:`EPOCHS`, as numpy arrays, and the decode
    cache's misses in each epoch."""
    found: dict[int, Batches] = {}
    missed: list[float] = []
    with batchd.Loader(
        address,
        dataset="tokens",
        batch_size=3,
        pipeline=batchd.Tokens(max_len=64),
        pack=batchd.Pack(seq_len=24),
        seed=11,
        device="cpu",
        **options,
    ) as loader:
        for epoch in EPOCHS:
            loader.set_epoch(epoch)
            before = lookups("miss")
            found[epoch] = [{k: v.numpy().copy() for k, v in b.items()} for b in loader]
            missed.append(lookups("miss") - before)
    return found, missed


def lookups(result: str) -> float:
    labels = {"dataset": "tokens", "result": result}
    return REGISTRY.get_sample_value("batchd_decode_cache_lookups_total", labels) or 0.0


def test_a_packed_epoch_is_served_from_the_decode_cache_bit_identical_to_uncached(
    sqlite_engine: Engine, tmp_path: Path
) -> None:
    """Three packed epochs with the cache equal those of a session that opts out, field by
    field; the first epoch misses (documents decoded and cached), the later ones hit every
    document they read and miss none."""
    token_dataset(sqlite_engine, tmp_path / "tokens", n=40)
    url = sqlite_engine.url.render_as_string(hide_password=False)
    with serve(url, tmp_path, decode_cache_bytes=16 << 20) as srv:
        hits, misses = lookups("hit"), lookups("miss")
        uncached, _ = packed_epochs(srv.address, decode_cache=False)
        assert (lookups("hit"), lookups("miss")) == (hits, misses), "opted out: no lookups"
        cached, missed = packed_epochs(srv.address)
        assert missed[0] > 0, "the first epoch decodes the documents into the cache"
        assert missed[1:] == [0.0, 0.0], "every document was cached in the first epoch"
        assert lookups("hit") > hits, "the later epochs are read from the cache"
    for epoch in EPOCHS:
        assert len(cached[epoch]) == len(uncached[epoch]) > 0
        for got, want in zip(cached[epoch], uncached[epoch], strict=True):
            assert got.keys() == want.keys()
            for key in got:
                assert got[key].dtype == want[key].dtype, (epoch, key)
                np.testing.assert_array_equal(got[key], want[key], err_msg=f"{epoch} {key}")
