"""Operations settings: where metrics listen, the default free-shm need, JSON log lines."""

from __future__ import annotations

import json
import logging
import sys

import pytest

from batchd._wire.ring import HEADER_BYTES
from batchd_server.config import DEFAULT_MIN_FREE_SHM_BYTES, ServerConfig
from batchd_server.logs import JsonFormatter
from batchd_server.pipelines.registry import build_pipeline
from batchd_server.sessions import ring_slots, slot_layout


def test_metrics_listen_on_the_given_address_and_metrics_port_on_the_listen_host() -> None:
    """--metrics-listen wins; --metrics-port alone binds the --listen host, never every
    interface behind the operator's back (127.0.0.1 for a unix socket)."""
    url = "sqlite:///x.db"
    assert ServerConfig(database_url=url).metrics_address() is None
    assert ServerConfig(
        database_url=url, metrics_listen="0.0.0.0:9400", metrics_port=1
    ).metrics_address() == ("0.0.0.0", 9400)
    assert ServerConfig(database_url=url, metrics_listen="[::1]:9400").metrics_address() == (
        "::1",
        9400,
    )
    assert ServerConfig(
        database_url=url, listen="10.0.0.5:50051", metrics_port=9400
    ).metrics_address() == ("10.0.0.5", 9400)
    assert ServerConfig(
        database_url=url, listen="unix:///run/b.sock", metrics_port=9400
    ).metrics_address() == ("127.0.0.1", 9400)
    with pytest.raises(ValueError, match="is not HOST:PORT"):
        ServerConfig(database_url=url, metrics_listen="9400")
    env = {"BATCHD_METRICS_LISTEN": "127.0.0.1:9500", "BATCHD_GRACE_S": "12"}
    config = ServerConfig.from_env(env, database_url=url)
    assert config.metrics_address() == ("127.0.0.1", 9500) and config.grace_s == 12.0


def test_the_default_free_shm_need_is_one_default_image_session() -> None:
    """56 MiB holds the ring of a 224x224 image session of batch 64 at prefetch 4, barely."""
    pipeline = build_pipeline("image", {"size": 224})
    _, slot_bytes = slot_layout(pipeline.fields(), 64)
    ring_bytes = HEADER_BYTES + ring_slots(4, slot_bytes) * slot_bytes
    assert ring_bytes <= DEFAULT_MIN_FREE_SHM_BYTES < ring_bytes + (2 << 20)


def test_json_log_lines_are_one_object_each_with_the_traceback_inside() -> None:
    """--log-format json: a record with a multi-line message and an exception stays one line."""
    try:
        raise RuntimeError("boom")
    except RuntimeError:
        record = logging.LogRecord(
            "batchd_server.x", logging.ERROR, __file__, 1, "two\nlines %d", (2,), None
        )
        record.exc_info = sys.exc_info()
    line = JsonFormatter().format(record)
    assert "\n" not in line
    entry = json.loads(line)
    assert entry["message"] == "two\nlines 2" and entry["level"] == "ERROR"
    assert entry["logger"] == "batchd_server.x" and "RuntimeError: boom" in entry["exception"]
    assert entry["time"].endswith("+00:00")
