"""The composition root: a server that cannot be built whole leaves nothing of itself."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest

from batchd_server.assembly import assemble
from batchd_server.config import ServerConfig
from batchd_server.errors import FailedPrecondition

from serving import child_pids


def test_a_build_that_fails_late_undoes_every_part_built_before(
    pg_url: str, tmp_path: Path
) -> None:
    """The doorbell is the last part built before the parts are whole: when its socket path
    cannot be made (an shm directory too long for a unix socket), the session manager, the
    decode cache, the workers and the shm registry built before it are taken down again, so
    no worker process, no thread and no file of the server is left (the shm directory is
    empty)."""
    shm_dir = tmp_path / ("shm-" + "d" * 100)
    shm_dir.mkdir()
    before, threads = child_pids(), set(threading.enumerate())
    config = ServerConfig(
        database_url=pg_url, workers=1, shm_dir=shm_dir, decode_cache_bytes=64 << 20
    )
    with pytest.raises(FailedPrecondition, match="too long a path for the doorbell socket"):
        assemble(config, on_health_change=lambda report: None)
    assert child_pids() <= before
    assert sorted(p.name for p in shm_dir.iterdir()) == []
    assert sorted(t.name for t in set(threading.enumerate()) - threads) == []
