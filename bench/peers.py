"""batchd against the loaders a user would pick instead, on small records, full epochs, one run.

Workloads (``--only`` picks some), each ``--records`` samples (default 50,000) in one shard
file, read through byte ranges, batch 256, whole epochs timed from ``iter()`` so that each
loader's per-epoch start cost counts:

- ``raw``: 32 float32 as raw bytes (``batchd.Array((32,), "float32", raw=True)``);
- ``npy``: each record a ``.npy`` of 32 float32 (256 bytes with its header), the issue's case
  (``batchd.Array((32,), "float32")``);
- ``tokens``: int32 sequences of 16..128 tokens (``batchd.Tokens(128)``).

Peers, all given the same ``Records.__getitem__`` (``np.load`` of the record from a memmap of
the shard opened once per process for ``npy``, ``os.pread`` otherwise) and the same collate:

- ``torch.utils.data.DataLoader`` at every ``num_workers`` in 0..cores (prefetch 2, persistent
  workers); its best median is the reference, its 2-worker row the issue's other reference;
- torchdata 0.11 ``StatefulDataLoader`` (cores workers) and ``torchdata.nodes``:
  ``SamplerWrapper -> ParallelMapper(threads | processes) -> Batcher -> Mapper(collate) ->
  Prefetcher -> Loader``;
- SPDL 0.8 ``spdl.pipeline`` (a thread pool, ``pipe(getitem) -> aggregate -> pipe(collate)``);
  SPDL's own media decoders (``spdl.io``) need FFmpeg's shared libraries: the settings line
  says whether this machine has them (they are not used for these records either way);
- batchd: ``batchd-server serve --workers <cores>`` as its own process, ``batchd.Loader`` at
  its defaults.

Every configuration warms up for one epoch, then ``--reps`` rounds run each once, the order
rotating. Columns: samples/s, the training process's CPU per batch (all its threads: a
thread-pool peer decodes there), the loader processes' CPU per batch (worker processes, or
batchd's server and workers; "-" when the loader has none), the training process's resident
memory after the run.

Needs the bench extras: ``pip install -r requirements/bench.txt``.
Run: ``python bench/peers.py`` (several minutes on 2 cores), ``--quick`` (about a minute).
"""

from __future__ import annotations

import argparse
import io
import json
import os
import resource
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch
from _common import (
    Contender,
    ServerProcess,
    batchd_server,
    best,
    closing_line,
    compete,
    cores,
    descendants,
    machine_busy_s,
    machine_lines,
    markdown_table,
    own_cpu_s,
    pids_cpu_s,
    ratio,
    spread,
)
from plots import recorded
from torch.utils.data import DataLoader, Dataset, RandomSampler, default_collate
from worker_path import write_shard

import batchd
from batchd_server.catalog import migrate
from batchd_server.catalog.db import make_engine
from batchd_server.catalog.ingest import ingest_manifest

BATCH = 256
FLOATS = 32
MAX_LEN = 128
LEASE_TIMEOUT_S = 3600
RATE, CPU = "samples_per_s", "train_cpu_ms_per_batch"


class Records(Dataset[dict[str, Any]]):
    """One record per ``__getitem__``; files open lazily once per process (fork-safe)."""

    def __init__(self, path: Path, rows: list[tuple[str, int, int]], workload: str) -> None:
        self.path, self.workload = str(path), workload
        self.offsets = [o for _, o, _ in rows]
        self.lengths = [n for _, _, n in rows]
        self._pid = -1
        self._fd = -1
        self._map: np.ndarray | None = None

    def __len__(self) -> int:
        return len(self.offsets)

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_pid": -1, "_fd": -1, "_map": None}

    def __getitem__(self, i: int) -> dict[str, Any]:
        if self._pid != os.getpid():
            self._fd, self._pid = os.open(self.path, os.O_RDONLY), os.getpid()
            self._map = np.memmap(self.path, np.uint8, mode="r")
        offset, length = self.offsets[i], self.lengths[i]
        if self.workload == "npy":
            assert self._map is not None
            array = torch.from_numpy(np.load(io.BytesIO(self._map[offset : offset + length])))
        else:
            data = bytearray(os.pread(self._fd, length, offset))
            dtype = torch.int32 if self.workload == "tokens" else torch.float32
            array = torch.frombuffer(data, dtype=dtype)
        return {"array": array, "label": i % 1000, "sample_id": i}


def collate(items: list[dict[str, Any]]) -> dict[str, Any]:
    """default_collate, or for token rows: padded to the longest, with a mask."""
    if items[0]["array"].dtype != torch.int32:
        return default_collate(items)
    rows = [x["array"][:MAX_LEN] for x in items]
    longest = max(len(r) for r in rows)
    ids = torch.zeros((len(rows), longest), dtype=torch.int32)
    mask = torch.zeros((len(rows), longest), dtype=torch.uint8)
    for k, r in enumerate(rows):
        ids[k, : len(r)] = r
        mask[k, : len(r)] = 1
    return {
        "input_ids": ids,
        "attention_mask": mask,
        "label": torch.tensor([x["label"] for x in items]),
        "sample_id": torch.tensor([x["sample_id"] for x in items]),
    }


class SpdlRecords:
    """An epoch of SPDL 0.8's ``spdl.pipeline``: shuffled indices -> getitem on a thread pool
    of ``threads`` -> aggregate -> collate, a new pipeline per epoch as its docs build them."""

    def __init__(self, dataset: Records, threads: int) -> None:
        self.dataset, self.threads, self.epoch = dataset, threads, 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __iter__(self) -> Iterator[dict[str, Any]]:
        from spdl.pipeline import PipelineBuilder

        order = np.random.default_rng(self.epoch).permutation(len(self.dataset)).tolist()
        pipeline = (
            PipelineBuilder()
            .add_source(order)
            .pipe(self.dataset.__getitem__, concurrency=self.threads, output_order="input")
            .aggregate(BATCH)
            .pipe(collate)
            .add_sink(4)
            .build(num_threads=self.threads)
        )
        with pipeline.auto_stop():
            yield from pipeline.get_iterator(timeout=600)


def nodes_loader(dataset: Records, method: str) -> Any:
    """torchdata 0.11 nodes: the graph its docs recommend in place of a DataLoader."""
    from torchdata.nodes import Batcher, Loader, Mapper, ParallelMapper, Prefetcher, SamplerWrapper

    node: Any = SamplerWrapper(RandomSampler(dataset))
    node = ParallelMapper(node, map_fn=dataset.__getitem__, num_workers=cores(), method=method)
    node = Batcher(node, batch_size=BATCH, drop_last=False)
    node = Mapper(node, collate)
    return Loader(Prefetcher(node, prefetch_factor=4))


def child_cpu(exclude: Callable[[], list[int]]) -> Callable[[], float]:
    """CPU of this process's live descendants not in ``exclude()`` plus reaped children."""

    def read() -> float:
        skip = set(exclude())
        live = [p for p in descendants(os.getpid()) if p not in skip]
        gone = resource.getrusage(resource.RUSAGE_CHILDREN)
        return pids_cpu_s(live) + gone.ru_utime + gone.ru_stime

    return read


def peers(dataset: Records, server: ServerProcess) -> tuple[list[Contender], Any]:
    """(first, make_second): processes that fork start before any gRPC channel exists."""
    from torchdata.stateful_dataloader import StatefulDataLoader

    pid = server.process.pid

    def server_tree() -> list[int]:
        return [pid, *descendants(pid)]

    first = []
    for workers in sorted({*range(min(cores(), 4) + 1), 2}):
        loader = DataLoader(
            dataset,
            batch_size=BATCH,
            shuffle=True,
            num_workers=workers,
            persistent_workers=workers > 0,
            prefetch_factor=2 if workers else None,
            collate_fn=collate,
        )
        cpu = child_cpu(server_tree) if workers else None
        first.append(Contender(f"DataLoader, {workers} workers", "DataLoader", loader, cpu))
    stateful = StatefulDataLoader(
        dataset,
        batch_size=BATCH,
        shuffle=True,
        num_workers=cores(),
        persistent_workers=True,
        collate_fn=collate,
    )
    label = f"StatefulDataLoader, {cores()} workers"
    first.append(Contender(label, "torchdata", stateful, child_cpu(server_tree)))
    label = f"torchdata.nodes, {cores()} processes"
    first.append(
        Contender(label, "torchdata", nodes_loader(dataset, "process"), child_cpu(server_tree))
    )

    def make_second() -> list[Contender]:
        threads = nodes_loader(dataset, "thread")
        return [
            Contender(f"torchdata.nodes, {cores()} threads", "torchdata", threads, None),
            Contender(
                f"SPDL pipeline, {cores()} threads", "spdl", SpdlRecords(dataset, cores()), None
            ),
        ]

    return first, make_second


def workload_section(args: argparse.Namespace, workload: str, root: Path, url: str) -> list[Any]:
    rows = write_shard(root, workload, args.records, FLOATS, MAX_LEN)
    manifest = root / f"{workload}.jsonl"
    with manifest.open("w", encoding="utf-8") as out:
        for i, (path, offset, length) in enumerate(rows):
            entry = {"key": f"r{i:07d}", "path": path, "byte_offset": offset}
            out.write(json.dumps({**entry, "byte_length": length, "label": i % 1000}) + "\n")
    engine = make_engine(url)
    ingest_manifest(
        engine,
        dataset=f"bench-{workload}",
        root=root,
        manifest=manifest,
        split="train",
        verify=False,
    )
    engine.dispose()
    dataset = Records(root / rows[0][0], rows, workload)
    spec: Any = {
        "raw": batchd.Array((FLOATS,), "float32", raw=True),
        "npy": batchd.Array((FLOATS,), "float32"),
        "tokens": batchd.Tokens(MAX_LEN),
    }[workload]
    with batchd_server(
        url, root, workers=args.server_workers, lease_timeout_s=LEASE_TIMEOUT_S
    ) as server:
        first, make_peers = peers(dataset, server)

        def make_second() -> list[Contender]:
            loader = batchd.Loader(
                server.target,
                dataset=f"bench-{workload}",
                batch_size=BATCH,
                pipeline=spec,
                shuffle=True,
                seed=0,
                device="cpu",
            )
            return [*make_peers(), Contender("batchd, defaults", "batchd", loader, server.cpu_s)]

        print(f"{workload} ...", file=sys.stderr)
        return compete(first, make_second, args.reps)


def table(done: list[Contender]) -> str:
    ref = best(done, "DataLoader")
    two = next(c for c in done if c.label == "DataLoader, 2 workers")
    header = ["config", "samples/s median (min-max)", "vs DataLoader best", "vs DataLoader 2w"]
    header += ["train-process CPU ms/batch", "CPU vs best", "loader CPU ms/batch"]
    header += ["train-process RSS MiB"]
    rows = []
    for c in done:
        loader = [v for r in c.runs if (v := r.loader_cpu_ms_per_batch) is not None]
        rows.append(
            [
                f"**{c.label}**" if c is ref else c.label,
                spread([r.samples_per_s for r in c.runs]),
                f"{ratio(c, ref, RATE):.2f}x",
                f"{ratio(c, two, RATE):.2f}x",
                spread([r.train_cpu_ms_per_batch for r in c.runs], ".2f"),
                f"{ratio(c, ref, CPU):.2f}x",
                spread(loader, ".1f") if loader else "-",
                f"{c.median('rss_bytes') / 2**20:,.0f}",
            ]
        )
    return markdown_table(header, rows) + f"\n\nReference (bold): best DataLoader = {ref.label}."


def ffmpeg_line() -> str:
    try:
        import spdl.io

        spdl.io.load_image(b"not an image")
    except RuntimeError as e:
        if "libav" in str(e):
            return "SPDL media decoders: unavailable here (FFmpeg shared libraries missing)"
        return "SPDL media decoders: FFmpeg libraries load"
    except Exception:
        return "SPDL media decoders: FFmpeg libraries load"
    return "SPDL media decoders: FFmpeg libraries load"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add = parser.add_argument
    add("--quick", action="store_true", help="5,000 records, 1 round: a smoke run")
    add("--only", nargs="+", choices=("raw", "npy", "tokens"), default=["raw", "npy", "tokens"])
    add("--records", type=int, default=50_000, help="records per workload (one epoch)")
    add("--reps", type=int, default=3, help="timed epochs per configuration")
    add("--server-workers", type=int, default=cores(), help="batchd-server --workers")
    args = parser.parse_args()
    if args.quick:
        args.records, args.reps = 5_000, 1
    import spdl
    import torchdata

    print("## batchd vs its peers on small records\n")
    print(f"command: {Path(sys.executable).name} {' '.join(sys.argv)}")
    for line in machine_lines():
        print(line)
    print(f"peers: torchdata {torchdata.__version__}, spdl {getattr(spdl, '__version__', '?')}")
    print(ffmpeg_line())
    print(
        f"settings: {args.records:,} records per workload in one shard, batch {BATCH}, shuffle, "
        f"whole epochs timed from iter(), 1 warm-up epoch + {args.reps} per config, order "
        f"rotating; batchd-server --workers {args.server_workers}, Loader defaults (prefetch 4, "
        "shm); DataLoaders prefetch 2, persistent workers; torchdata/SPDL pools of "
        f"{cores()}; CPU: train = getrusage(SELF), loader = /proc of worker processes or of "
        "batchd-server and its workers (reaped children included)"
    )
    started, busy0, own0 = time.perf_counter(), machine_busy_s(), own_cpu_s()
    with tempfile.TemporaryDirectory(prefix="batchd-peers-") as tmp:
        root = Path(tmp)
        url = f"sqlite:///{root / 'catalog.db'}"
        engine = make_engine(url)
        migrate.upgrade(engine)
        engine.dispose()
        for workload in args.only:
            done = workload_section(args, workload, root, url)
            print(f"\n### {workload}: {args.records:,} records, batch {BATCH}, full epochs\n")
            print(table(done))
    print(closing_line(started, busy0, own0))


if __name__ == "__main__":
    with recorded("peers"):
        main()
