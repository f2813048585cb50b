"""How fast a split goes from the catalog into arrays: ingest, then ``load_split``.

Writes a JSONL manifest of ``--rows`` samples stored as fixed-size records inside a few shard
files under a temporary root (so every row has a path, a byte range, a label and a split),
ingests it with ``ingest_manifest(verify=True)``, then times ``load_split`` of the split:
one warm-up, then ``--repeats`` timed loads, reporting the best and the median.

Without ``--database-url`` it starts a throwaway Postgres (``tests/pgserver.py``); with one
it uses that database, which must already be migrated (``batchd-server migrate``), and
removes the dataset it added when done.

Run: ``python bench/catalog_load.py --rows 1000000``
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import sqlalchemy as sa
from sqlalchemy.engine import Engine

from batchd_server.catalog import migrate
from batchd_server.catalog.db import describe_url, is_postgres, make_engine
from batchd_server.catalog.ingest import ingest_manifest
from batchd_server.catalog.reader import load_split, split_query
from batchd_server.catalog.schema import datasets
from batchd_server.catalog.types import SplitArrays

TESTS_DIR = Path(__file__).resolve().parent.parent / "tests"
DATASET = "bench-catalog-load"
SPLIT = "train"
RECORD_BYTES = 64
SHARDS = 8


def write_dataset(root: Path, rows: int) -> Path:
    """Shard files of fixed-size records under ``root`` and a JSONL manifest naming them."""
    shard_dir = root / "shards"
    shard_dir.mkdir()
    per_shard = -(-rows // SHARDS)
    manifest = root / "manifest.jsonl"
    with manifest.open("w", encoding="utf-8") as out:
        for shard in range(SHARDS):
            first, last = shard * per_shard, min(rows, (shard + 1) * per_shard)
            if first >= last:
                break
            records = np.zeros((last - first, RECORD_BYTES // 8), "<i8")
            records[:, 0] = np.arange(first, last)
            name = f"shards/shard-{shard:05d}.bin"
            records.tofile(root / name)
            out.writelines(
                json.dumps(
                    {
                        "path": name,
                        "byte_offset": (i - first) * RECORD_BYTES,
                        "byte_length": RECORD_BYTES,
                        "label": i % 1000,
                        "split": SPLIT,
                    }
                )
                + "\n"
                for i in range(first, last)
            )
    return manifest


@contextmanager
def database(url: str | None) -> Iterator[tuple[Engine, str]]:
    """An engine on a migrated catalog and a description of where it lives."""
    if url is not None:
        engine = make_engine(url)
        try:
            migrate.require_schema(engine)
            yield engine, f"given: {describe_url(url)}"
        finally:
            engine.dispose()
        return
    sys.path.insert(0, str(TESTS_DIR))
    from pgserver import ThrowawayPostgres

    server = ThrowawayPostgres.start()
    try:
        engine = make_engine(server.url("postgres"))
        try:
            migrate.upgrade(engine)
            yield engine, f"throwaway Postgres (tests/pgserver.py), unix socket in {server.workdir}"
        finally:
            engine.dispose()
    finally:
        server.stop()


def database_version(engine: Engine) -> str:
    with engine.connect() as conn:
        if is_postgres(engine):
            return "PostgreSQL " + str(conn.exec_driver_sql("SHOW server_version").scalar())
        return "SQLite " + str(conn.exec_driver_sql("SELECT sqlite_version()").scalar())


def plan_top(engine: Engine, arrays: SplitArrays) -> str:
    """The first line of the load query's plan (Postgres), to show which path it took."""
    if not is_postgres(engine):
        return "n/a"
    compiled = split_query(arrays.dataset.id, SPLIT, packed=True).compile(dialect=engine.dialect)
    with engine.connect() as conn:
        plan = conn.exec_driver_sql("EXPLAIN " + str(compiled), compiled.params).scalar()
    return str(plan).split("  (cost")[0]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=1_000_000, help="samples in the split")
    parser.add_argument(
        "--database-url", default=None, help="a migrated catalog (default: throwaway Postgres)"
    )
    parser.add_argument("--repeats", type=int, default=3, help="timed loads after a warm-up")
    args = parser.parse_args()

    with (
        tempfile.TemporaryDirectory(prefix="batchd-bench-") as tmp,
        database(args.database_url) as (engine, location),
    ):
        print(f"database: {location}", flush=True)
        root = Path(tmp)
        t0 = time.perf_counter()
        manifest = write_dataset(root, args.rows)
        print(f"wrote {args.rows:,} rows of manifest in {time.perf_counter() - t0:.1f} s")
        version = f"bench-{uuid.uuid4().hex[:8]}"
        report = ingest_manifest(
            engine,
            dataset=DATASET,
            version=version,
            root=root,
            manifest=manifest,
            split=None,
            verify=True,
        )
        print(report.summary())
        try:
            if is_postgres(engine):
                with engine.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
                    conn.exec_driver_sql("VACUUM ANALYZE samples")
            arrays = load_split(engine, DATASET, SPLIT, version=version)
            assert len(arrays) == args.rows, f"loaded {len(arrays)} rows, expected {args.rows}"
            seconds = []
            for _ in range(args.repeats):
                start = time.perf_counter()
                load_split(engine, DATASET, SPLIT, version=version)
                seconds.append(time.perf_counter() - start)
            pinned_start = time.perf_counter()
            load_split(engine, DATASET, SPLIT, version=version, snapshot=arrays.snapshot)
            pinned_seconds = time.perf_counter() - pinned_start
            plan = plan_top(engine, arrays)
            db_version = database_version(engine)
        finally:
            if args.database_url is not None:
                with engine.begin() as conn:
                    conn.execute(
                        sa.delete(datasets).where(
                            datasets.c.name == DATASET, datasets.c.version == version
                        )
                    )

    n = len(arrays)
    best, median = min(seconds), statistics.median(seconds)
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    table = [
        ("rows", f"{n:,}"),
        ("ingest rows/s", f"{report.rows_read / report.seconds:,.0f} ({report.seconds:.1f} s)"),
        ("load rows/s, best", f"{n / best:,.0f} ({best:.2f} s)"),
        ("load rows/s, median", f"{n / median:,.0f} ({median:.2f} s, {len(seconds)} runs)"),
        ("load rows/s, with snapshot", f"{n / pinned_seconds:,.0f} ({pinned_seconds:.2f} s)"),
        ("array bytes/sample beyond paths", f"{arrays.bytes_per_sample_beyond_paths():.2f}"),
        ("path bytes/sample", f"{arrays.path_bytes.nbytes / max(n, 1):.2f}"),
        ("query plan", plan),
        ("machine", f"{cores} cores, {platform.machine()}, Python {platform.python_version()}"),
        ("database", db_version),
        ("database location", location),
    ]
    width = max(len(k) for k, _ in table)
    print()
    for key, value in table:
        print(f"{key:<{width}}  {value}")


if __name__ == "__main__":
    main()
