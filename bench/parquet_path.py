"""Parquet rows in a decode worker: what a batch costs next to the same records as byte ranges
of a shard, and next to the Parquet ``__getitem__`` a DataLoader user writes.

One process, one core: this script writes the same records twice, as one raw shard file (the
catalog's byte ranges) and as Parquet files of ``--row-group`` rows a group, builds real
catalog segments and a real ring in ``/dev/shm`` as a session does (the Parquet rows with
their row group, row and payload chunk), and calls ``SessionContext.run`` (what a worker runs
per task) on batches, alternating in the same rounds with:

- ``naive``: a ``Dataset.__getitem__`` over Parquet as it is usually written, one
  ``ParquetFile.read_row_group(group, columns=[payload])`` per sample (file objects and
  their footers opened once, as a persistent worker keeps them), then ``default_collate``.

Workloads (``--only``): ``arrays`` (``fixed_size_list<float32>[--floats]`` vs raw records,
``batchd.Array``) and ``tokens`` (``list<int32>`` of 16..``--max-len`` vs raw token records,
``batchd.Tokens``). Orders (``--orders``): ``sequential`` batches (consecutive rows: a batch
reads one or two row groups) and ``shuffled`` (a batch touches a row group per sample
unless the groups are few).

Prints per (workload, order): microseconds per batch for the shard, batchd's Parquet path
and the naive reader (median and min-max over ``--reps`` rounds), and the ratios Parquet /
shard and naive / Parquet, measured in the same rounds. Files are in the page cache: this is
the CPU cost of the Parquet path, not of a disk or an object store.

Run: ``python bench/parquet_path.py`` (about a minute), ``--quick`` (a few seconds).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import torch
from _common import machine_lines, markdown_table, spread
from torch.utils.data import default_collate

from batchd_server.parquet.payload import chunk_range, resolve_payload
from batchd_server.pipelines.registry import build_pipeline
from batchd_server.sessions.options import slot_layout
from batchd_server.shm import ShmRegistry
from batchd_server.shm.arrays import pack_arrays
from batchd_server.workers.context import SessionContext
from batchd_server.workers.task import BatchTask, SessionSpec, SourceSpec

_HEADER_BYTES = 4096
_FILES = 4


Row = tuple[str, int, int, int, int]
"""(path, byte offset, byte length, row group, row): row group -1 for a shard's record."""


@contextmanager
def session(
    root: Path, rows: list[Row], kind: str, options: dict[str, Any], batch_size: int, payload: str
) -> Iterator[SessionContext]:
    """A worker's SessionContext over ``rows``."""
    n = len(rows)
    paths = [r[0].encode() for r in rows]
    arrays = {
        "ids": np.arange(n, dtype=np.int64),
        "labels": np.arange(n, dtype=np.int64) % 1000,
        "lengths": np.full(n, -1, np.int32),
        "byte_offsets": np.array([r[1] for r in rows], np.int64),
        "byte_lengths": np.array([r[2] for r in rows], np.int64),
        "path_bytes": np.frombuffer(b"".join(paths), np.uint8),
        "path_offsets": np.concatenate([[0], np.cumsum([len(p) for p in paths])]).astype(np.int64),
        "row_groups": np.array([r[3] for r in rows], np.int32),
        "row_indexes": np.array([r[4] for r in rows], np.int32),
    }
    fields, slot_bytes = slot_layout(build_pipeline(kind, options).fields(), batch_size)
    with ShmRegistry(budget_bytes=1 << 32) as registry:
        catalog = pack_arrays(registry, arrays, purpose="bench catalog")
        ring = registry.create("ring", _HEADER_BYTES + slot_bytes, purpose="bench ring")
        spec = SessionSpec(
            session_id="bench",
            pipeline_kind=kind,
            pipeline_options=options,
            ring_segment=ring.name,
            header_bytes=_HEADER_BYTES,
            slot_bytes=slot_bytes,
            fields=fields,
            batch_size=batch_size,
            seed=0,
            on_error="skip",
            sources=(SourceSpec(catalog.name, str(root), parquet_payload=payload),),
            shm_dir=str(registry.shm_dir),
        )
        context = SessionContext(spec)
        try:
            yield context
        finally:
            context.close()


def write(root: Path, workload: str, args: argparse.Namespace) -> tuple[list[Row], list[Row]]:
    """The records as one shard and as Parquet files; each one's rows."""
    rng = np.random.default_rng(0)
    n = args.records
    if workload == "tokens":
        seqs = [
            rng.integers(0, 50_000, int(k), dtype=np.int32)
            for k in rng.integers(16, args.max_len + 1, n)
        ]
        column = pa.array([s.tolist() for s in seqs], pa.list_(pa.int32()))
        blobs = [s.astype("<i4").tobytes() for s in seqs]
    else:
        values = rng.standard_normal((n, args.floats), dtype=np.float32)
        column = pa.FixedSizeListArray.from_arrays(pa.array(values.reshape(-1)), args.floats)
        blobs = [v.tobytes() for v in values]
    (root / f"{workload}.bin").write_bytes(b"".join(blobs))
    ends = np.cumsum([len(b) for b in blobs])
    shard = [
        (f"{workload}.bin", int(e - len(b)), len(b), -1, -1)
        for e, b in zip(ends, blobs, strict=True)
    ]
    parquet: list[Row] = []
    for part, rows in enumerate(np.array_split(np.arange(n), _FILES)):
        name = f"{workload}-{part}.parquet"
        pq.write_table(
            pa.table({"payload": column.take(pa.array(rows))}),
            root / name,
            row_group_size=args.row_group,
        )
        pf = pq.ParquetFile(root / name)
        leaves = resolve_payload(pf, "payload", name).leaves
        for group in range(pf.metadata.num_row_groups):
            offset, length = chunk_range(pf.metadata.row_group(group), leaves)
            count = pf.metadata.row_group(group).num_rows
            parquet += [(name, offset, length, group, r) for r in range(count)]
    return shard, parquet


def naive(root: Path, rows: list[Row], workload: str, max_len: int) -> Callable[[np.ndarray], Any]:
    """A DataLoader worker's Parquet ``__getitem__``: the row group per sample, then collate."""
    files = {name: pq.ParquetFile(root / name) for name in {r[0] for r in rows}}

    def item(i: int) -> dict[str, Any]:
        name, _, _, group, row = rows[i]
        value = files[name].read_row_group(group, columns=["payload"]).column(0)[row].values
        array = torch.from_numpy(value.to_numpy(zero_copy_only=False, writable=True))
        return {"array": array, "label": i % 1000, "sample_id": i}

    def collate(items: list[dict[str, Any]]) -> Any:
        if workload != "tokens":
            return default_collate(items)
        longest = min(max(len(x["array"]) for x in items), max_len)
        ids = torch.zeros((len(items), longest), dtype=torch.int32)
        for r, x in enumerate(items):
            kept = x["array"][:max_len]
            ids[r, : len(kept)] = kept
        return ids

    return lambda positions: collate([item(int(i)) for i in positions])


def measure(args: argparse.Namespace, workload: str, root: Path) -> list[list[str]]:
    shard, parquet = write(root, workload, args)
    if workload == "tokens":
        kind, options = "tokens", {"max_len": args.max_len}
    else:
        kind, options = "array", {"shape": [args.floats], "dtype": "float32", "raw": True}
    table = []
    for order in args.orders:
        rng = np.random.default_rng(1)
        times: dict[str, list[float]] = {"shard": [], "parquet": [], "naive": []}
        with (
            session(root, shard, kind, options, args.batch_size, "") as on_shard,
            session(root, parquet, kind, options, args.batch_size, "payload") as on_parquet,
        ):
            failures = 0

            def run(context: SessionContext) -> Callable[[np.ndarray], None]:
                def batch(rows: np.ndarray) -> None:
                    nonlocal failures
                    task = BatchTask(context.spec, 0, 0, 0, rows.astype(np.int64).tobytes())
                    failures += len(context.run(task).failures)

                return batch

            sides = {"shard": run(on_shard), "parquet": run(on_parquet)}
            sides["naive"] = naive(root, parquet, workload, args.max_len)
            for r in range(args.reps + 1):  # round 0 warms up
                for side in list(sides) if r % 2 else list(sides)[::-1]:
                    if order == "shuffled":
                        batches = [
                            rng.permutation(args.records)[: args.batch_size]
                            for _ in range(args.batches)
                        ]
                    else:
                        first = rng.integers(0, args.records - args.batch_size * args.batches)
                        batches = [
                            np.arange(args.batch_size) + first + k * args.batch_size
                            for k in range(args.batches)
                        ]
                    batch_count = args.batches if side != "naive" else max(1, args.batches // 10)
                    start = time.perf_counter()
                    for chosen in batches[:batch_count]:
                        sides[side](chosen)
                    if r:
                        times[side].append(1e6 * (time.perf_counter() - start) / batch_count)
            if failures:
                raise RuntimeError(f"{workload}: {failures} samples failed; the bench data is bad")
        median = {s: statistics.median(t) for s, t in times.items()}
        table.append(
            [
                workload,
                order,
                spread(times["shard"], ",.0f"),
                spread(times["parquet"], ",.0f"),
                spread(times["naive"], ",.0f"),
                f"{median['parquet'] / median['shard']:.2f}x",
                f"{median['naive'] / median['parquet']:.1f}x",
            ]
        )
    return table


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add = parser.add_argument
    add("--quick", action="store_true", help="fewer records, batches and rounds")
    add("--only", nargs="+", choices=("arrays", "tokens"), default=["arrays", "tokens"])
    add(
        "--orders",
        nargs="+",
        choices=("sequential", "shuffled"),
        default=["sequential", "shuffled"],
    )
    add("--records", type=int, default=100_000)
    add("--row-group", type=int, default=1000, help="rows per Parquet row group")
    add("--floats", type=int, default=32, help="float32 per array record")
    add("--max-len", type=int, default=128, help="tokens: longest sequence (and max_len)")
    add("--batch-size", type=int, default=256)
    add("--batches", type=int, default=40, help="batches per timed round (naive: a tenth)")
    add("--reps", type=int, default=3, help="timed rounds (after one warm-up round)")
    args = parser.parse_args()
    if args.quick:
        args.records, args.batches, args.reps = 20_000, 10, 2
    torch.set_num_threads(1)
    print("## Parquet rows in one worker: batchd's Parquet path vs a shard and a naive reader\n")
    print(f"command: {Path(sys.executable).name} {' '.join(sys.argv)}")
    for line in machine_lines():
        print(line)
    print(
        f"settings: {args.records:,} records in {_FILES} Parquet files of {args.row_group}-row "
        f"groups and in one raw shard; batch {args.batch_size}; {args.batches} batches x "
        f"{args.reps} rounds per side (naive: {max(1, args.batches // 10)}) after a warm-up "
        f"round, sides alternating; arrays of {args.floats} float32; tokens "
        f"16..{args.max_len} int32; one process, torch 1 thread; files in the page cache"
    )
    header = ["workload", "order", "shard us/batch", "Parquet us/batch", "naive us/batch"]
    header += ["Parquet / shard", "naive / Parquet"]
    table = []
    with tempfile.TemporaryDirectory(prefix="batchd-parquet-path-") as tmp:
        for workload in args.only:
            print(f"{workload} ...", file=sys.stderr)
            table += measure(args, workload, Path(tmp))
    print()
    print(markdown_table(header, table))


if __name__ == "__main__":
    main()
