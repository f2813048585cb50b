"""Configurations, rounds and the report of ``bench/object_store.py``.

A :class:`Config` is one row of the result: a :class:`~_common.Contender` (its loader and
timed runs) plus what the store saw during each run. :func:`rounds` warms every
configuration up once and then runs each once per round, the order rotating, each at its own
added latency; the report is a markdown table, the targets and a JSON file of every run.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from _common import Contender, markdown_table, pids_cpu_s, quiesce, spread
from _objstore_s3 import Store

__all__ = [
    "Config",
    "loader_cpu_table",
    "results_table",
    "rounds",
    "shutdown_dataloader",
    "targets",
    "workers_cpu",
    "write_json",
]

# ------------------------------------------------------------------------ configurations


@dataclass
class Config:
    """One column of the result: a loader, the state of its cache, the store's latency."""

    label: str
    family: str
    """"batchd files", "batchd S3", "batchd tar", "batchd Parquet", "Mosaic", "LitData",
    "LitData raw" (its ``StreamingRawDataset`` on the objects batchd's "S3" rows read)."""
    state: str
    """"local", "cold" or "warm"."""
    latency_ms: float
    contender: Contender
    prepare: Callable[[Config], None] | None = None
    """Run before every epoch, untimed: a cold configuration's fresh cache and loader."""
    finish: Callable[[Config], None] | None = None
    """Run after every epoch, untimed (after the CPU has been read)."""
    fetched_bytes: list[int] = field(default_factory=list)
    requests: list[int] = field(default_factory=list)
    request_types: list[dict[str, int]] = field(default_factory=list)
    failures: list[str] = field(default_factory=list)
    """Epochs of a peer that raised (the error's last line), warm-ups included."""
    store_cpu_s: list[float] = field(default_factory=list)


def workers_cpu(loader: Any) -> Callable[[], float]:
    # A DataLoader's worker processes (torch keeps them in a private attribute).
    return lambda: pids_cpu_s(w.pid for w in getattr(loader._iterator, "_workers", ()) or ())


def shutdown_dataloader(loader: Any) -> None:
    """Stop a DataLoader's persistent workers now (not at garbage collection)."""
    iterator = getattr(loader, "_iterator", None)
    if iterator is not None and hasattr(iterator, "_shutdown_workers"):
        iterator._shutdown_workers()


# ---------------------------------------------------------------------------- the rounds


def run_once(cfg: Config, store: Store, *, record: bool) -> None:
    """One epoch of ``cfg`` at its latency; kept when ``record``."""
    store.set_delay(cfg.latency_ms)
    if cfg.prepare is not None:
        cfg.prepare(cfg)
    quiesce()
    bytes0, requests0, cpu0 = store.bytes_down(), store.requests(), store.cpu_s()
    try:
        run = cfg.contender.run(batches=None, warmup_batches=0)
    except Exception as e:  # a peer's epoch that fails is reported, the run goes on
        if cfg.family.startswith("batchd"):
            raise
        cfg.failures.append(f"{type(e).__name__}: {str(e).strip().splitlines()[-1][:160]}")
        print(f"  {cfg.label}: FAILED {cfg.failures[-1]}", file=sys.stderr)
        if cfg.finish is not None:
            cfg.finish(cfg)
        if cfg.contender.loader is not None:  # the next epoch starts on a new loader
            shutdown_dataloader(cfg.contender.loader)
            cfg.contender.loader = None
        return
    fetched, counts = store.bytes_down() - bytes0, store.requests()
    by_type = {k: n - requests0.get(k, 0) for k, n in counts.items() if n - requests0.get(k, 0)}
    requests = sum(by_type.values())
    store_cpu = store.cpu_s() - cpu0
    if cfg.finish is not None:
        cfg.finish(cfg)
    print(
        f"  {cfg.label}: {run.samples_per_s:,.0f} samples/s, {fetched / 1e6:,.1f} MB, "
        f"{requests:,} requests {by_type}{'' if record else ' (warm-up)'}",
        file=sys.stderr,
    )
    if record:
        cfg.contender.runs.append(run)
        cfg.fetched_bytes.append(fetched)
        cfg.requests.append(requests)
        cfg.request_types.append(by_type)
        cfg.store_cpu_s.append(store_cpu)


def rounds(configs: list[Config], store: Store, reps: int) -> None:
    """Every configuration once (warm-up: fills the warm caches), then ``reps`` rounds, the
    order rotating by one each round."""
    for cfg in configs:
        run_once(cfg, store, record=False)
    for r in range(reps):
        print(f"round {r + 1}/{reps}", file=sys.stderr)
        for cfg in configs[r % len(configs) :] + configs[: r % len(configs)]:
            run_once(cfg, store, record=True)


# -------------------------------------------------------------------------------- output


def _median(values: Sequence[float]) -> float:
    return statistics.median(values) if values else float("nan")


def loader_ms_per_sample(cfg: Config) -> float:
    """Median CPU milliseconds per sample of the processes that load for ``cfg`` (batchd's
    server, its threads and its decode workers; a peer's DataLoader workers); NaN when not
    measured."""
    values = [
        1e3 * r.loader_cpu_s / r.samples
        for r in cfg.contender.runs
        if r.loader_cpu_s is not None and r.samples
    ]
    return _median(values)


def store_ms_per_sample(cfg: Config) -> float:
    """Median CPU milliseconds per sample of the store and the delay proxy."""
    samples = _median([r.samples for r in cfg.contender.runs])
    return 1e3 * _median(cfg.store_cpu_s) / samples if samples else float("nan")


def rate(cfg: Config) -> float:
    """Median samples/s; NaN when every epoch failed."""
    return cfg.contender.median("samples_per_s") if cfg.contender.runs else float("nan")


def peer_of(configs: list[Config], cfg: Config, family: str) -> Config | None:
    """The ``family`` configuration in ``cfg``'s state at ``cfg``'s latency."""
    for other in configs:
        if (other.family, other.state, other.latency_ms) == (family, cfg.state, cfg.latency_ms):
            return other
    return None


def results_table(configs: list[Config], local: Config) -> str:
    header = ["config", "samples/s median (min-max)", "vs local files", "vs Mosaic"]
    header += ["vs LitData", "vs LitData raw", "MB fetched/epoch", "requests/epoch"]
    header += ["train CPU ms/batch"]
    header += ["loader CPU ms/sample", "store+proxy CPU ms/sample"]
    rows = []
    for cfg in configs:
        runs = cfg.contender.runs
        if not runs:
            rows.append([cfg.label, f"every epoch failed ({len(cfg.failures)})"] + [""] * 9)
            continue
        loader = [1e3 * r.loader_cpu_s / r.samples for r in runs if r.loader_cpu_s is not None]
        row = [f"**{cfg.label}**" if cfg is local else cfg.label]
        row += [spread([r.samples_per_s for r in runs]), f"{rate(cfg) / rate(local):.2f}x"]
        for family in ("Mosaic", "LitData", "LitData raw"):
            peer = peer_of(configs, cfg, family)
            mine = cfg.family.startswith("batchd") and cfg.state != "local"
            same = family != "LitData raw" or cfg.family == "batchd S3"
            ran = peer is not None and bool(peer.contender.runs)  # else every epoch failed
            row.append(f"{rate(cfg) / rate(peer):.2f}x" if peer and ran and mine and same else "")
        local_row = cfg.state == "local"
        row.append("-" if local_row else f"{_median(cfg.fetched_bytes) / 1e6:,.1f}")
        row.append("-" if local_row else f"{_median(cfg.requests):,.0f}")
        row.append(spread([r.train_cpu_ms_per_batch for r in runs], ".2f"))
        row.append(spread(loader, ".2f") if loader else "-")
        row.append("-" if local_row else f"{store_ms_per_sample(cfg):.2f}")
        rows.append(row)
    failed = [
        f"{c.label}: {len(c.failures)} epoch(s) failed, {c.failures[0]}"
        for c in configs
        if c.failures
    ]
    notes = "".join(f"\n- {line}" for line in failed)
    return (
        markdown_table(header, rows)
        + f"\n\nReference (bold): {local.label}."
        + (f"\n\nEpochs that failed (left out of the medians):{notes}" if failed else "")
    )


def loader_cpu_table(configs: list[Config], local: Config) -> str:
    """batchd's own CPU per sample (its server, the node cache's prefetch threads in it, and
    its decode workers; not the store or the proxy) in every cold and warm epoch, against
    local files: what reading from the store adds on the loader's node. A Parquet row is
    also set against the Parquet export on the local disk, when that ran."""
    parquet_local = next(
        (c for c in configs if c.family == "batchd Parquet" and c.state == "local"), None
    )
    header = ["config", "loader CPU ms/sample", "vs local files", "vs same layout local"]
    header += ["store+proxy CPU ms/sample"]
    base = loader_ms_per_sample(local)
    rows = []
    for cfg in configs:
        if not cfg.family.startswith("batchd") or not cfg.contender.runs:
            continue
        mine = loader_ms_per_sample(cfg)
        same = parquet_local if cfg.family == "batchd Parquet" else None
        rows.append(
            [
                f"**{cfg.label}**" if cfg is local else cfg.label,
                f"{mine:.2f}",
                f"{mine / base:.2f}x",
                f"{mine / loader_ms_per_sample(same):.2f}x" if same and same is not cfg else "",
                "-" if cfg.state == "local" else f"{store_ms_per_sample(cfg):.2f}",
            ]
        )
    return markdown_table(header, rows)


def targets(configs: list[Config], local: Config, latency: float) -> list[list[str]]:
    """The acceptance ratios at ``latency`` ms: cold >= 0.9x and warm >= 0.95x local files,
    and ahead of Mosaic Streaming and LitData in the same state."""
    rows = []
    for cfg in configs:
        if cfg.state == "local" or not cfg.family.startswith("batchd"):
            continue
        if cfg.latency_ms != latency:
            continue
        goal = 0.9 if cfg.state == "cold" else 0.95
        value = rate(cfg) / rate(local)
        rows.append(
            [
                f"{cfg.label} vs local files",
                f"{value:.2f}x",
                f">= {goal}x",
                _met(value >= goal),
                f"{ceiling(cfg, local):.2f}x" if cfg.state == "cold" else "",
            ]
        )
        peers = ("Mosaic", "LitData") + (("LitData raw",) if cfg.family == "batchd S3" else ())
        for family in peers:
            peer = peer_of(configs, cfg, family)
            if peer is not None and peer.contender.runs:
                value = rate(cfg) / rate(peer)
                rows.append(
                    [f"{cfg.label} vs {peer.label}", f"{value:.2f}x", "> 1x", _met(value > 1), ""]
                )
    return rows


def ceiling(cfg: Config, local: Config) -> float:
    """The best ratio to local files a cold epoch of ``cfg`` could reach on this machine: the
    store and the proxy spent ``S`` CPU seconds an epoch on the same cores, so even a loader
    whose fetches cost nothing needs ``(cores * W + S) / cores`` seconds where local files
    take ``W`` (generous: as if local files kept every core busy)."""
    store_s = _median(cfg.store_cpu_s)
    wall = _median([r.wall_s for r in local.contender.runs])
    cores = os.cpu_count() or 1
    return cores * wall / (cores * wall + store_s)


def _met(ok: bool) -> str:
    return "yes" if ok else "**no**"


def write_json(
    path: Path, settings: list[str], configs: list[Config], target_rows: list[list[str]]
) -> None:
    """Every run of every configuration, the settings and the targets, for later analysis."""
    out = {
        "benchmark": "bench/object_store.py",
        "when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "settings": settings,
        "configs": [
            {
                "label": c.label,
                "family": c.family,
                "state": c.state,
                "latency_ms": c.latency_ms,
                "failures": c.failures,
                "runs": [
                    {
                        "samples": r.samples,
                        "batches": r.batches,
                        "wall_s": r.wall_s,
                        "samples_per_s": r.samples_per_s,
                        "train_cpu_s": r.train_cpu_s,
                        "loader_cpu_s": r.loader_cpu_s,
                        "loader_cpu_ms_per_sample": (
                            None
                            if r.loader_cpu_s is None or not r.samples
                            else 1e3 * r.loader_cpu_s / r.samples
                        ),
                        "fetched_bytes": b,
                        "requests": q,
                        "requests_by_type": t,
                        "store_cpu_s": s,
                    }
                    for r, b, q, t, s in zip(
                        c.contender.runs,
                        c.fetched_bytes,
                        c.requests,
                        c.request_types,
                        c.store_cpu_s,
                        strict=True,
                    )
                ],
            }
            for c in configs
        ],
        "targets": [
            dict(zip(("target", "measured", "goal", "met", "ceiling"), t, strict=True))
            for t in target_rows
        ],
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(out, indent=1) + "\n")
