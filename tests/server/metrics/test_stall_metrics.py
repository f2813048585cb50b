"""Stall attribution in Prometheus: what a live server's /metrics says after real epochs, and
the pure helpers behind the trainer-starvation numbers."""

from __future__ import annotations

import math
import urllib.request
from collections import defaultdict
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families
from sqlalchemy.engine import Engine

import batchd
from batchd_server.metrics.stall import MAX_CLIENT_SECONDS, StallWindow, clamp_client_seconds

from serving import RECORD_FLOATS, record_dataset, serve

Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]


def scrape(address: str) -> Samples:
    """Every sample of ``http://address/metrics``, keyed by name and labels."""
    with urllib.request.urlopen(f"http://{address}/metrics", timeout=30) as response:
        text = response.read().decode()
    samples: Samples = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            samples[(s.name, frozenset(s.labels.items()))] = s.value
    return samples


def total(samples: Samples, name: str, **labels: str) -> float:
    """The sum of ``name``'s samples whose labels include ``labels``."""
    want = set(labels.items())
    return sum(v for (n, ls), v in samples.items() if n == name and want <= ls)


def by_label(samples: Samples, name: str, label: str, **labels: str) -> dict[str, float]:
    want = set(labels.items())
    out: dict[str, float] = defaultdict(float)
    for (n, ls), v in samples.items():
        if n == name and want <= ls:
            out[dict(ls).get(label, "")] += v
    return dict(out)


@pytest.mark.parametrize("transport", ["inline", "shm"])
def test_after_one_epoch_the_metrics_match_what_the_client_received(
    engine: Engine, tmp_path: Path, transport: str
) -> None:
    """Counters equal the batches and samples the client got; every stage, the queue wait,
    the batch latency and the time to first batch have observations under the dataset's
    name; workers alive equals the configured count."""
    n, batch_size = 203, 16
    name = f"stall_{transport}"
    record_dataset(engine, tmp_path / "r", n=n, name=name)
    url = engine.url.render_as_string(hide_password=False)
    spec = batchd.Array((RECORD_FLOATS,), "float32", raw=True)
    with serve(url, tmp_path, workers=2, metrics_listen="127.0.0.1:0") as server:
        assert server.metrics_address is not None
        assert server.metrics_address.startswith("127.0.0.1:")
        before = scrape(server.metrics_address)
        with batchd.Loader(
            server.address, dataset=name, batch_size=batch_size, pipeline=spec, transport=transport
        ) as loader:
            got = [len(b["sample_id"]) for b in loader]
        after = scrape(server.metrics_address)

    batches = math.ceil(n / batch_size)
    assert (len(got), sum(got)) == (batches, n)

    def delta(metric: str, **labels: str) -> float:
        return total(after, metric, **labels) - total(before, metric, **labels)

    assert delta("batchd_batches_total", dataset=name) == batches
    assert delta("batchd_samples_total", dataset=name) == n
    assert delta("batchd_served_bytes_total", transport=transport) >= n * RECORD_FLOATS * 4
    # Metrics belong to the process, which ran other tests first: compare differences.
    stages = by_label(after, "batchd_stage_seconds_count", "stage", dataset=name)
    assert stages.keys() == {"read", "decode", "collate"}
    for stage in stages:
        # Each batch is decoded exactly once here (no worker dies, no stream restarts).
        assert delta("batchd_stage_seconds_count", dataset=name, stage=stage) == batches
    assert delta("batchd_stage_seconds_sum", dataset=name, stage="decode") > 0
    assert delta("batchd_queue_wait_seconds_count", dataset=name) == batches
    assert delta("batchd_batch_seconds_count", dataset=name) == batches
    assert delta("batchd_first_batch_seconds_count", dataset=name) == 1
    assert delta("batchd_catalog_load_seconds_count", dataset=name) == 1
    assert total(after, "batchd_workers_alive") == total(after, "batchd_workers_configured") == 2
    assert total(after, "batchd_ready") == 1
    assert total(after, "batchd_shm_free_bytes") > 0 and total(after, "batchd_shm_budget_bytes") > 0
    for key in after:
        assert not {"session", "session_id", "rank", "sample_id"} & {k for k, _ in key[1]}, key


def test_the_stall_ratio_is_wait_over_wait_plus_step_in_a_sliding_window() -> None:
    """Batches older than the window stop counting; an empty window has no ratio."""
    window = StallWindow(window_s=10.0)
    assert window.ratio(now=0.0) is None
    window.add(0.0, wait_s=3.0, step_s=1.0)
    window.add(5.0, wait_s=0.0, step_s=4.0)
    assert window.ratio(now=5.0) == pytest.approx(3.0 / 8.0)
    assert window.ratio(now=10.5) == pytest.approx(0.0)  # the first batch left the window
    assert window.ratio(now=16.0) is None
    window.add(20.0, wait_s=0.0, step_s=0.0)
    assert window.ratio(now=20.0) is None, "no time at all is no ratio, not 0/0"


def test_absurd_client_values_are_clamped_before_they_count() -> None:
    """Negative, NaN and infinite durations from a client never reach a metric as such."""
    assert clamp_client_seconds(-1.0) == 0.0
    assert clamp_client_seconds(float("nan")) == 0.0
    assert clamp_client_seconds(float("inf")) == MAX_CLIENT_SECONDS
    assert clamp_client_seconds(1e12) == MAX_CLIENT_SECONDS
    assert clamp_client_seconds(0.25) == 0.25
    window = StallWindow(window_s=60.0)
    window.add(0.0, wait_s=float("nan"), step_s=float("inf"))
    window.add(1.0, wait_s=-5.0, step_s=1.0)
    assert window.ratio(now=1.0) == 0.0
