"""A decode worker's own cost per batch, in one process: no server, no client, no other cores.

The gRPC server and the Loader add a roughly fixed cost per batch; what a worker spends per
*sample* decides how small records scale. This script builds real files, a real catalog
segment and a real ring in ``/dev/shm``, then calls ``SessionContext.run`` (exactly what a
worker process runs per task) on shuffled batches, and beside it, alternating in the same
process, what a ``torch.utils.data.DataLoader`` worker does for the same batch: one
``__getitem__`` per sample (``np.load`` of the record from a memmap of the shard, or an
``os.pread``) and ``default_collate``.

Workloads (``--only`` picks some):

- ``npy``: records that are each a ``.npy`` of ``--floats`` float32, concatenated in one shard
  file and read through byte ranges (``batchd.Array(shape, "float32")``);
- ``raw``: the same values as raw little-endian bytes (``batchd.Array(..., raw=True)``);
- ``tokens``: int32 token sequences of 16..``--max-len`` tokens in one shard
  (``batchd.Tokens(max_len)``; the DataLoader side pads with a collate function).

Prints per workload: microseconds per batch and per sample (median and min-max of
``--reps`` rounds of ``--batches`` batches), and the ratio of the DataLoader-style path to
batchd's, measured in the same rounds. One core does everything, so the numbers are the
single-core ceiling of a worker (samples/s = 1e6 / us per sample); a machine shared with
other work moves the absolute values, much less the ratios.

Run: ``python bench/worker_path.py`` (about 30 s), ``--quick`` (a few seconds).
"""

from __future__ import annotations

import argparse
import io
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np
import torch
from _common import machine_lines, markdown_table, spread
from torch.utils.data import default_collate

from batchd_server.pipelines.registry import build_pipeline
from batchd_server.sessions.options import slot_layout
from batchd_server.shm import ShmRegistry
from batchd_server.shm.arrays import pack_arrays
from batchd_server.workers.context import SessionContext
from batchd_server.workers.task import BatchTask, SessionSpec, SourceSpec

_HEADER_BYTES = 4096
_SLOTS = 2


@contextmanager
def session(
    root: Path,
    rows: list[tuple[str, int, int]],
    kind: str,
    options: dict[str, Any],
    batch_size: int,
) -> Iterator[SessionContext]:
    """A worker's SessionContext over ``rows`` of (path, byte offset, byte length)."""
    n = len(rows)
    paths = [p.encode() for p, _, _ in rows]
    arrays = {
        "ids": np.arange(n, dtype=np.int64),
        "labels": np.arange(n, dtype=np.int64) % 1000,
        "lengths": np.full(n, -1, np.int32),
        "byte_offsets": np.array([o for _, o, _ in rows], np.int64),
        "byte_lengths": np.array([length for _, _, length in rows], np.int64),
        "path_bytes": np.frombuffer(b"".join(paths), np.uint8),
        "path_offsets": np.concatenate([[0], np.cumsum([len(p) for p in paths])]).astype(np.int64),
    }
    fields, slot_bytes = slot_layout(build_pipeline(kind, options).fields(), batch_size)
    with ShmRegistry(budget_bytes=1 << 32) as registry:
        catalog = pack_arrays(registry, arrays, purpose="bench catalog")
        ring = registry.create("ring", _HEADER_BYTES + _SLOTS * slot_bytes, purpose="bench ring")
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
            sources=(SourceSpec(catalog.name, str(root)),),
            shm_dir=str(registry.shm_dir),
        )
        context = SessionContext(spec)
        try:
            yield context
        finally:
            context.close()


def npy_bytes(array: np.ndarray) -> bytes:
    out = io.BytesIO()
    np.save(out, array)
    return out.getvalue()


def write_shard(root: Path, workload: str, n: int, floats: int, max_len: int) -> list[Any]:
    """The shard file and its rows: (path, offset, length)."""
    rng = np.random.default_rng(0)
    if workload == "tokens":
        blobs = [
            rng.integers(0, 50_000, int(k), dtype=np.int32).astype("<i4").tobytes()
            for k in rng.integers(16, max_len + 1, n)
        ]
    else:
        values = rng.standard_normal((n, floats), dtype=np.float32)
        blobs = [npy_bytes(v) if workload == "npy" else v.tobytes() for v in values]
    name = f"{workload}.bin"
    (root / name).write_bytes(b"".join(blobs))
    offsets = np.concatenate([[0], np.cumsum([len(b) for b in blobs])])
    return [(name, int(offsets[i]), len(blobs[i])) for i in range(n)]


def dataloader_batch(
    workload: str, root: Path, rows: list[Any], max_len: int
) -> Callable[[np.ndarray], Any]:
    """What one DataLoader worker runs for a batch: __getitem__ per sample, then collate."""
    path = str(root / rows[0][0])
    memmap = np.memmap(path, np.uint8, mode="r")
    fd = os.open(path, os.O_RDONLY)

    def item(i: int) -> dict[str, Any]:
        _, offset, length = rows[i]
        if workload == "npy":
            array = np.load(io.BytesIO(memmap[offset : offset + length]))
            return {"array": torch.from_numpy(array), "label": i % 1000, "sample_id": i}
        data = bytearray(os.pread(fd, length, offset))
        dtype = torch.int32 if workload == "tokens" else torch.float32
        return {"array": torch.frombuffer(data, dtype=dtype), "label": i % 1000, "sample_id": i}

    def collate(items: list[dict[str, Any]]) -> Any:
        if workload != "tokens":
            return default_collate(items)
        longest = max(len(x["array"]) for x in items)
        ids = torch.zeros((len(items), min(longest, max_len)), dtype=torch.int32)
        for row, x in enumerate(items):
            kept = x["array"][:max_len]
            ids[row, : len(kept)] = kept
        return ids

    return lambda positions: collate([item(int(i)) for i in positions])


def measure(args: argparse.Namespace, workload: str, root: Path) -> list[str]:
    rows = write_shard(root, workload, args.records, args.floats, args.max_len)
    if workload == "tokens":
        kind, options = "tokens", {"max_len": args.max_len}
    else:
        kind = "array"
        options = {"shape": [args.floats], "dtype": "float32", "raw": workload == "raw"}
    rng = np.random.default_rng(1)
    dl_batch = dataloader_batch(workload, root, rows, args.max_len)
    times: dict[str, list[float]] = {"batchd": [], "DataLoader": []}
    with session(root, rows, kind, options, args.batch_size) as context:
        failures = 0

        def batchd_batch(positions: np.ndarray) -> None:
            nonlocal failures
            task = BatchTask(context.spec, 0, 0, 0, positions.astype(np.int64).tobytes())
            failures += len(context.run(task).failures)

        sides: dict[str, Callable[[np.ndarray], Any]] = {
            "batchd": batchd_batch,
            "DataLoader": dl_batch,
        }
        for r in range(args.reps + 1):  # round 0 warms up
            order = list(sides) if r % 2 else list(sides)[::-1]
            for side in order:
                batches = [
                    rng.permutation(args.records)[: args.batch_size] for _ in range(args.batches)
                ]
                start = time.perf_counter()
                for positions in batches:
                    sides[side](positions)
                elapsed = time.perf_counter() - start
                if r:
                    times[side].append(1e6 * elapsed / args.batches)
        if failures:
            raise RuntimeError(f"{workload}: {failures} samples failed; the bench data is bad")
    per_batch = {s: statistics.median(t) for s, t in times.items()}
    cells = [workload]
    for side in ("batchd", "DataLoader"):
        cells.append(spread(times[side], ",.0f"))
        cells.append(spread([t / args.batch_size for t in times[side]], ".2f"))
    cells.append(f"{per_batch['DataLoader'] / per_batch['batchd']:.1f}x")
    return cells


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add = parser.add_argument
    add("--quick", action="store_true", help="fewer records, batches and rounds")
    add("--only", nargs="+", choices=("npy", "raw", "tokens"), default=["npy", "raw", "tokens"])
    add("--records", type=int, default=50_000, help="records in each shard")
    add("--floats", type=int, default=32, help="float32 per array record")
    add("--max-len", type=int, default=128, help="tokens: longest sequence (and max_len)")
    add("--batch-size", type=int, default=256)
    add("--batches", type=int, default=100, help="batches per timed round and side")
    add("--reps", type=int, default=5, help="timed rounds (after one warm-up round)")
    args = parser.parse_args()
    if args.quick:
        args.records, args.batches, args.reps = 10_000, 20, 3
    torch.set_num_threads(1)
    print("## One worker's cost per batch: batchd's SessionContext.run vs a DataLoader worker\n")
    print(f"command: {Path(sys.executable).name} {' '.join(sys.argv)}")
    for line in machine_lines():
        print(line)
    print(
        f"settings: {args.records:,} records per shard, batch {args.batch_size}, shuffled, "
        f"{args.batches} batches x {args.reps} rounds per side after 1 warm-up round, sides "
        f"alternating; array records of {args.floats} float32; tokens 16..{args.max_len} int32; "
        "one process, torch 1 thread; files in the page cache"
    )
    header = ["workload", "batchd us/batch", "batchd us/sample", "DataLoader us/batch"]
    header += ["DataLoader us/sample", "DataLoader / batchd"]
    table = []
    with tempfile.TemporaryDirectory(prefix="batchd-worker-path-") as tmp:
        for workload in args.only:
            print(f"{workload} ...", file=sys.stderr)
            table.append(measure(args, workload, Path(tmp)))
    print()
    print(markdown_table(header, table))


if __name__ == "__main__":
    main()
