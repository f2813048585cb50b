"""Fixtures of the end-to-end tests: a catalog of small datasets and a real server on it."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy.engine import Engine

from batchd_server.api import RunningServer

from serving import image_dataset, record_dataset, serve, token_dataset

N_RECORDS = 203  # prime: no world size or batch size divides it


@pytest.fixture
def catalog(engine: Engine, tmp_path: Path) -> dict[str, Any]:
    """Records (203 of them), tokens and images in one catalog (once on Postgres, once on
    SQLite)."""
    return {
        "records": record_dataset(engine, tmp_path / "records", n=N_RECORDS),
        "tokens": token_dataset(engine, tmp_path / "tokens", n=50),
        "images": image_dataset(engine, tmp_path / "images", n=24),
        "url": engine.url.render_as_string(hide_password=False),
        "engine": engine,
    }


@pytest.fixture
def server(catalog: dict[str, Any], tmp_path: Path) -> Iterator[RunningServer]:
    """A real server (unix socket, worker processes, shared memory) on ``catalog``."""
    with serve(catalog["url"], tmp_path) as srv:
        yield srv
