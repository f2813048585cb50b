"""A Loader started where no server listens yet -- a pool scaled to zero that starts on
demand -- waits for one (``wait_for_server_s``) and says so; once a real server starts there,
it serves the epoch as a Loader that never waited would, and ``stats()`` reports the wait."""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy.engine import Engine

import batchd

from serving import RECORD_FLOATS, record_dataset, serve

WAITING = "waiting for the batchd server at"


class _Said(logging.Handler):
    """The batchd log's messages; ``event`` is set once one contains ``words``."""

    def __init__(self, words: str) -> None:
        super().__init__(logging.DEBUG)
        self.words = words
        self.event = threading.Event()
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        message = record.getMessage()
        self.messages.append(message)
        if self.words in message:
            self.event.set()


@pytest.fixture
def said() -> Iterator[_Said]:
    handler = _Said(WAITING)
    logger = logging.getLogger("batchd")
    logger.addHandler(handler)
    try:
        yield handler
    finally:
        logger.removeHandler(handler)


def _loader(target: str, **options: Any) -> batchd.Loader:
    return batchd.Loader(
        target,
        dataset="records",
        batch_size=10,
        seed=5,
        device="cpu",
        pipeline=batchd.Array((RECORD_FLOATS,), "float32", raw=True),
        **options,
    )


@pytest.mark.timeout(600)
def test_a_loader_waits_for_a_server_that_starts_later_and_serves_the_epoch(
    engine: Engine, tmp_path: Path, said: _Said
) -> None:
    """The Loader is built (in a thread) on a unix socket nobody listens on; once its log says
    it waits for the server there, a real server is started on that socket: the constructor
    returns, the epoch is a non-waiting Loader's, batch for batch, and stats() counts the
    seconds waited."""
    record_dataset(engine, tmp_path / "records", n=57)
    url = engine.url.render_as_string(hide_password=False)
    run = tmp_path / "run"
    run.mkdir()
    target = f"unix://{run}/batchd.sock"
    built: dict[str, Any] = {}

    def build() -> None:
        try:
            built["loader"] = _loader(target, wait_for_server_s=300)
        except BaseException as e:  # the test thread reports it
            built["error"] = e

    thread = threading.Thread(target=build, name="loader-waits")
    thread.start()
    try:
        assert said.event.wait(120), f"the Loader never said it waits: {said.messages}"
        assert thread.is_alive() and not built, f"it should still wait: {built}"
        (first,) = [m for m in said.messages if WAITING in m]
        assert repr(target) in first and "a pool scaled to zero starts on demand" in first
        assert "s so far" in first and "wait_for_server_s=300" in first
        with serve(url, run):
            thread.join(300)
            assert not thread.is_alive(), "the Loader kept waiting with a server up"
            assert "error" not in built, built.get("error")
            with built.pop("loader") as waited, _loader(target) as reference:
                want = [b["sample_id"].tolist() for b in reference]
                got = [b["sample_id"].tolist() for b in waited]
                stats = waited.stats()
                assert reference.stats().server_wait_s == 0.0
        assert got == want and sum(map(len, got)) == 57
        assert stats.server_wait_s > 0 and stats.batches == len(want)
        assert any("answered after" in m and repr(target) in m for m in said.messages)
    finally:
        thread.join(300)
        loader = built.get("loader")
        if loader is not None:
            loader.close()
