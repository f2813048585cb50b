"""The ``dataset`` label stays bounded: one value per mix whatever the order of its sources, at
most ``MAX_DATASET_LABELS`` values in all, and no stall window (nor its ratio series) for a
dataset no client reported on for a window.

Metrics are process-wide, so the tests that fill or age them run in a fresh interpreter."""

from __future__ import annotations

import json
import subprocess
import sys

from batchd_server.planning.mixing import MixOptions, MixSourceOptions


def _mix(*datasets: str) -> MixOptions:
    return MixOptions(sources=tuple(MixSourceOptions(dataset=d, weight=1.0) for d in datasets))


def _in_fresh_interpreter(script: str) -> dict[str, int]:
    """Run ``script`` (which prints one JSON object) in a new Python; its output."""
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    result: dict[str, int] = json.loads(done.stdout)
    return result


_FILL = """
import json
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client import generate_latest
from batchd_server.metrics import delivery, registry, stall

n = registry.MAX_DATASET_LABELS + 50
for i in range(n):
    name = f"dataset_{i}"
    delivery.record_delivery(name, 4, since_open_s=0.5)
    stall.record_client_timings(name, [0.1], [0.3], now=1.0)
values = set()
for family in text_string_to_metric_families(generate_latest(registry.REGISTRY).decode()):
    for sample in family.samples:
        if "dataset" in sample.labels:
            values.add(sample.labels["dataset"])
print(json.dumps({
    "cap": registry.MAX_DATASET_LABELS,
    "values": len(values),
    "other": int("other" in values),
    "windows": len(stall.STALL_RATIOS),
}))
"""


_AGE = """
import json
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families
from batchd_server.metrics import REGISTRY, stall

for name in ("gone_a", "gone_b", "gone_c"):
    stall.record_client_timings(name, [0.2], [0.2], now=100.0)
stall.record_client_timings("current", [0.1], [0.3], now=100.0 + 61.0)
ratios = [
    s.labels["dataset"]
    for f in text_string_to_metric_families(generate_latest(REGISTRY).decode())
    for s in f.samples
    if s.name == "batchd_data_stall_ratio"
]
print(json.dumps({"ratios": sorted(ratios), "windows": len(stall.STALL_RATIOS)}))
"""


def test_a_mix_has_one_label_whatever_the_order_of_its_sources() -> None:
    """{a, b} and {b, a} are the same mix to an operator: one series, names sorted."""
    assert _mix("b", "a").label == _mix("a", "b").label == "a+b"
    assert _mix("c", "a", "b").label == "a+b+c"


def test_beyond_the_cap_every_new_dataset_is_reported_as_other() -> None:
    """MAX_DATASET_LABELS + 50 distinct datasets make at most the cap plus "other" label
    values across every metric, and as many stall windows at most."""
    out = _in_fresh_interpreter(_FILL)
    assert out["values"] == out["cap"] + 1, out
    assert out["other"] == 1, out
    assert out["windows"] <= out["cap"] + 1, out


def test_the_stall_windows_of_datasets_nobody_reports_on_are_dropped() -> None:
    """A dataset no client reported on for a whole window loses its window and its
    batchd_data_stall_ratio series; the one still reported on keeps both."""
    out = _in_fresh_interpreter(_AGE)
    assert out == {"ratios": ["current"], "windows": 1}


_SOURCES = """
import json
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families
from batchd_server.metrics import REGISTRY, mixing

n = mixing.MAX_SOURCE_LABELS + 20
for i in range(n):
    mixing.record_mix_batch("a+b", [f"s{i}:train"], [3], [7], [2.5])
values = set()
for family in text_string_to_metric_families(generate_latest(REGISTRY).decode()):
    for sample in family.samples:
        if "source" in sample.labels:
            values.add(sample.labels["source"])
total = REGISTRY.get_sample_value(
    "batchd_mix_samples_total", {"dataset": "a+b", "source": "other"}
)
print(json.dumps({"cap": mixing.MAX_SOURCE_LABELS, "values": len(values), "other": total}))
"""


def test_the_source_label_of_the_mix_counters_is_capped_too() -> None:
    """Past ``MAX_SOURCE_LABELS`` distinct sources, the rest count under ``other``: no
    sample is lost and the series stay bounded."""
    got = _in_fresh_interpreter(_SOURCES)
    assert got["values"] == got["cap"] + 1
    assert got["other"] == 20 * 3
