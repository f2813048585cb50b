"""Sequence packing: padding and tokens/s of batchd's packed Loader beside Grain's packers.

One set of document lengths (lognormal, seeded: a long tail of long documents), written as
uint16 tokens in one shard and ingested as byte-range records (the catalog knows every
length). For seq_len 2048 and 8192:

- batchd ``best_fit``, ``first_fit`` and ``concat``: the planner alone (padding fraction,
  planning time for the epoch), then a full epoch through the public client (a
  ``batchd-server`` process, ``Loader(..., pack=batchd.Pack(...))``, shm): padding fraction
  of the served rows, real tokens/s, and the training process's CPU per batch
  (``getrusage(SELF)``, every thread) beside the server's (its process tree);
- Grain 0.2.18's ``FirstFitPackIterDataset``, ``BestFitPackIterDataset`` (num_packing_bins
  = ``--grain-bins``, default the batch size, as Grain's docs suggest) and
  ``ConcatThenSplitIterDataset``, run in the training process as Grain is used, on the same
  documents read from the same shard (memory-mapped) and cut into the same seq_len pieces
  (Grain's bin packers would otherwise truncate a long document): padding fraction, real
  tokens/s and CPU per batch of ``batch_size`` rows.

Timings are of one run on a shared machine: noisy. Padding fractions are exact.

    .venv/bin/python bench/packing.py            # 20,000 documents
    .venv/bin/python bench/packing.py --quick    # 3,000: a smoke run
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch

import batchd
from batchd_server.catalog import migrate
from batchd_server.catalog.db import make_engine
from batchd_server.catalog.ingest import ingest_manifest
from batchd_server.planning.packing import PackOptions, pack_documents

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import batchd_server, cores, machine_lines, markdown_table, self_cpu_s
from plots import recorded

BATCH = 8
METHODS = ("best_fit", "first_fit", "concat")


def document_lengths(n: int, seed: int) -> np.ndarray:
    """Lognormal lengths (median ~400 tokens, mean ~830), 1 to 32,768 tokens."""
    rng = np.random.default_rng(seed)
    return np.clip(rng.lognormal(6.0, 1.2, n).astype(np.int64), 1, 32768)


def write_documents(root: Path, lengths: np.ndarray) -> Path:
    """The documents as uint16 tokens in one shard, ingested as "docs"; the shard's path."""
    root.mkdir(parents=True, exist_ok=True)
    shard = root / "docs.bin"
    rng = np.random.default_rng(1)
    ends = np.cumsum(lengths)
    shard.write_bytes(rng.integers(1, 50_000, int(ends[-1]), dtype=np.uint16).tobytes())
    manifest = root / "docs.jsonl"
    with manifest.open("w", encoding="utf-8") as out:
        for i, (end, n) in enumerate(zip(ends.tolist(), lengths.tolist(), strict=True)):
            row = {"key": f"d{i:07d}", "path": "docs.bin", "byte_offset": 2 * (end - n)}
            out.write(json.dumps({**row, "byte_length": 2 * n, "length": n}) + "\n")
    return manifest


def planner_rows(lengths: np.ndarray, seq_len: int) -> list[list[str]]:
    order = np.random.default_rng(0).permutation(lengths.size).astype(np.int64)
    table = []
    for method in METHODS:
        start = time.perf_counter()
        rows = pack_documents(order, lengths, PackOptions(seq_len=seq_len, method=method))
        took = time.perf_counter() - start
        padding = 1 - lengths.sum() / (rows.rows * seq_len)
        table.append(
            [f"batchd {method} (plan)", f"{rows.rows:,}", f"{padding:.3%}", f"{took * 1e3:.0f} ms"]
        )
    return table


def batchd_epoch(
    target: str, method: str, seq_len: int, server_cpu: Callable[[], float]
) -> list[str]:
    loader = batchd.Loader(
        target,
        dataset="docs",
        batch_size=BATCH,
        pipeline=batchd.Tokens(max_len=32768, dtype="uint16"),
        pack=batchd.Pack(seq_len=seq_len, method=method),
        device="cpu",
        seed=0,
    )
    with loader:
        next(iter(loader))  # the session, the plan and the workers warm
        loader.set_epoch(1)
        cpu0, server0, start = self_cpu_s(), server_cpu(), time.perf_counter()
        real = slots = batches = 0
        for batch in loader:
            segments = batch["segment_ids"].numpy()
            real += int(np.count_nonzero(segments))
            slots += segments.size
            batches += 1
        wall = time.perf_counter() - start
        cpu, server = self_cpu_s() - cpu0, server_cpu() - server0
    return [
        f"batchd {method}",
        f"{slots // seq_len:,}",
        f"{1 - real / slots:.3%}",
        f"{real / wall / 1e6:.1f} M",
        f"{cpu / batches * 1e3:.2f} ms",
        f"{server / batches * 1e3:.2f} ms",
    ]


def grain_epoch(kind: str, shard: Path, lengths: np.ndarray, seq_len: int, bins: int) -> list[str]:
    import grain
    import grain.experimental as ge

    tokens = np.memmap(shard, np.uint16, "r")
    starts = np.cumsum(lengths) - lengths
    # The same seq_len pieces batchd packs: a long document's whole pieces and its remainder.
    pieces = [
        (int(s) + k, min(seq_len, int(n) - k))
        for s, n in zip(starts.tolist(), lengths.tolist(), strict=True)
        for k in range(0, int(n), seq_len)
    ]
    order = np.random.default_rng(0).permutation(len(pieces))
    source = grain.MapDataset.source([pieces[i] for i in order.tolist()])
    docs = source.map(lambda p: {"inputs": np.array(tokens[p[0] : p[0] + p[1]])})
    parent = docs.to_iter_dataset()
    lengths_struct = {"inputs": seq_len}
    if kind == "concat":
        packed: Any = ge.ConcatThenSplitIterDataset(parent, length_struct=lengths_struct)
        label = "Grain ConcatThenSplit"
    else:
        cls = ge.BestFitPackIterDataset if kind == "best_fit" else ge.FirstFitPackIterDataset
        packed = cls(parent, length_struct=lengths_struct, num_packing_bins=bins, seed=0)
        label = f"Grain {cls.__name__.removesuffix('PackIterDataset')} ({bins} bins)"
    batched = packed.batch(BATCH)
    cpu0, start = self_cpu_s(), time.perf_counter()
    real = slots = batches = 0
    for batch in _iterate(batched):
        segments = batch["inputs_segment_ids"]
        real += int(np.count_nonzero(segments))
        slots += segments.size
        batches += 1
    wall = time.perf_counter() - start
    cpu = self_cpu_s() - cpu0
    return [
        label,
        f"{slots // seq_len:,}",
        f"{1 - real / slots:.3%}",
        f"{real / wall / 1e6:.1f} M",
        f"{cpu / batches * 1e3:.2f} ms",
        "-",
    ]


def _fastest(reps: int, run: Callable[[], list[str]]) -> list[str]:
    """The row of the fastest of ``reps`` epochs (real tokens/s, the fourth column)."""
    rows = [run() for _ in range(reps)]
    return max(rows, key=lambda row: float(row[3].split()[0]))


def _batchd_run(*args: Any) -> Callable[[], list[str]]:
    return lambda: batchd_epoch(*args)


def _grain_run(*args: Any) -> Callable[[], list[str]]:
    return lambda: grain_epoch(*args)


def _iterate(dataset: Any) -> Iterator[dict[str, np.ndarray]]:
    yield from dataset


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add = parser.add_argument
    add("--quick", action="store_true", help="3,000 documents: a smoke run")
    add("--docs", type=int, default=20_000, help="documents in the epoch")
    add("--seed", type=int, default=0, help="seeds the document lengths")
    add("--seq-len", type=int, nargs="+", default=[2048, 8192])
    add("--grain-bins", type=int, default=BATCH, help="num_packing_bins of Grain's bin packers")
    add("--server-workers", type=int, default=cores(), help="batchd-server --workers")
    add("--reps", type=int, default=2, help="epochs per loader; the fastest is reported")
    args = parser.parse_args()
    # One thread: torch's intra-op pool would spin on both cores for the counting below.
    torch.set_num_threads(1)
    if args.quick:
        args.docs = 3_000
    import grain

    lengths = document_lengths(args.docs, args.seed)
    print("## Sequence packing: batchd beside Grain\n")
    print(f"command: {Path(sys.executable).name} {' '.join(sys.argv)}")
    for line in machine_lines():
        print(line)
    print(f"peers: grain {getattr(grain, '__version__', '0.2.18')}")
    print(
        f"settings: {args.docs:,} documents, lognormal(6.0, 1.2) lengths clipped to 1..32768 "
        f"(seed {args.seed}): {int(lengths.sum()):,} tokens, median {int(np.median(lengths))}, "
        f"mean {lengths.mean():.0f}, max {int(lengths.max())}; batch {BATCH} rows; per loader "
        f"the fastest of {args.reps} epochs (after a warm-up batch); batchd-server --workers "
        f"{args.server_workers}, shm; "
        f"Grain in the training process, num_packing_bins={args.grain_bins}, documents cut "
        "into seq_len pieces as batchd does. Timings: one run, shared machine, noisy"
    )
    with tempfile.TemporaryDirectory(prefix="batchd-packing-") as tmp:
        root = Path(tmp)
        url = f"sqlite:///{root / 'catalog.db'}"
        engine = make_engine(url)
        migrate.upgrade(engine)
        manifest = write_documents(root / "docs", lengths)
        ingest_manifest(
            engine,
            dataset="docs",
            root=root / "docs",
            manifest=manifest,
            split="train",
            verify=False,
        )
        engine.dispose()
        shard = root / "docs" / "docs.bin"
        with batchd_server(url, root, workers=args.server_workers, lease_timeout_s=30) as server:
            for seq_len in args.seq_len:
                print(f"\n### seq_len {seq_len}\n")
                print(
                    markdown_table(
                        ["planner", "rows", "padding", "plan time"], planner_rows(lengths, seq_len)
                    )
                )
                print()
                rows = [
                    _fastest(args.reps, _batchd_run(server.target, m, seq_len, server.cpu_s))
                    for m in METHODS
                ]
                rows += [
                    _fastest(args.reps, _grain_run(m, shard, lengths, seq_len, args.grain_bins))
                    for m in METHODS
                ]
                head = [
                    "loader",
                    "rows",
                    "padding",
                    "real tokens/s",
                    "train CPU/batch",
                    "server CPU/batch",
                ]
                print(markdown_table(head, rows))


if __name__ == "__main__":
    with recorded("packing"):
        main()
