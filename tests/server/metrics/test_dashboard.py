"""deploy/grafana/batchd.json: every query names a metric a live server exports, and the
dashboard has the panels an operator needs."""

from __future__ import annotations

import json
import re
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

from serving import serve

DASHBOARD = Path(__file__).resolve().parents[3] / "deploy" / "grafana" / "batchd.json"
_METRIC = re.compile(r"\bbatchd_[a-zA-Z0-9_]+")
# The series each metric type exposes, by the suffix on its family's name.
_SERIES = {
    "counter": ("_total", "_created"),
    "gauge": ("",),
    "histogram": ("_bucket", "_sum", "_count", "_created"),
    "summary": ("", "_sum", "_count", "_created"),
}


def queries(node: Any) -> Iterator[str]:
    """Every PromQL string in the dashboard: panel targets and template variable queries."""
    if isinstance(node, dict):
        for key, value in node.items():
            if (key in ("expr", "definition") and isinstance(value, str)) or (
                key == "query" and isinstance(value, str)
            ):
                yield value
            else:
                yield from queries(value)
    elif isinstance(node, list):
        for item in node:
            yield from queries(item)


def exported_series(address: str) -> set[str]:
    """The series names ``/metrics`` declares, whether or not a sample was recorded yet."""
    with urllib.request.urlopen(f"http://{address}/metrics", timeout=30) as response:
        text = response.read().decode()
    names = set()
    for family in text_string_to_metric_families(text):
        names.update(family.name + suffix for suffix in _SERIES.get(family.type, ("",)))
        names.update(s.name for s in family.samples)
    return names


def test_every_dashboard_query_names_a_metric_a_live_server_exports(
    sqlite_url: str, tmp_path: Path
) -> None:
    """Parse the dashboard, scrape a running server: no query refers to a missing series."""
    dashboard = json.loads(DASHBOARD.read_text())
    used = {m for q in queries(dashboard) for m in _METRIC.findall(q)}
    assert len(used) >= 15, sorted(used)
    with serve(sqlite_url, tmp_path, workers=1, metrics_listen="127.0.0.1:0") as server:
        assert server.metrics_address is not None
        exported = exported_series(server.metrics_address)
    missing = sorted(used - exported)
    assert not missing, f"the dashboard queries series the server does not export: {missing}"


def test_the_dashboard_shows_what_an_operator_asks_first() -> None:
    """Throughput, per-stage latency, stall ratio, time to first batch, sample errors, shm,
    workers, a mix's share per source (served against expected) and the node cache (hits,
    bytes fetched, GET latency, prefetch lead) each have a panel; panel ids and grid
    positions do not collide."""
    dashboard = json.loads(DASHBOARD.read_text())
    panels = [p for p in dashboard["panels"] if p["type"] != "row"]
    text = {p["title"]: " ".join(t["expr"] for t in p["targets"]) for p in panels}

    def panel_with(metric: str) -> str:
        found = [title for title, exprs in text.items() if metric in exprs]
        assert found, f"no panel queries {metric}"
        return found[0]

    for metric in (
        "batchd_batches_total",
        "batchd_stage_seconds_bucket",
        "batchd_data_stall_ratio",
        "batchd_first_batch_seconds_bucket",
        "batchd_sample_errors_total",
        "batchd_shm_reserved_bytes",
        "batchd_shm_free_bytes",
        "batchd_workers_alive",
        "batchd_worker_restarts_total",
        "batchd_mix_samples_total",
        "batchd_mix_expected_samples_total",
        "batchd_mix_tokens_total",
        "batchd_cache_hits_total",
        "batchd_cache_fetched_bytes_total",
        "batchd_object_get_seconds_bucket",
        "batchd_cache_prefetch_lead_batches",
    ):
        panel_with(metric)
    cells = set()
    for p in dashboard["panels"]:
        g = p["gridPos"]
        for x in range(g["x"], g["x"] + g["w"]):
            for y in range(g["y"], g["y"] + g["h"]):
                assert (x, y) not in cells, f"panel {p['title']!r} overlaps another"
                cells.add((x, y))
