"""Test support: small datasets in a real catalog and a real server around them.

Every server started here is stopped by its context manager, which then asserts that no
``batchd`` segment is left in /dev/shm and that no worker process survives.
"""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
from sqlalchemy.engine import Engine

import batchd
from batchd_server.api import RunningServer, build_server
from batchd_server.catalog.ingest import ingest_imagefolder, ingest_manifest
from batchd_server.config import ServerConfig
from batchd_server.demo_data import write_demo_images

SHM = Path("/dev/shm")
RECORD_FLOATS = 32


def batchd_segments(instance: str = "") -> list[str]:
    """The batchd entries in /dev/shm (segments and lock files), of one server ``instance``
    or of all. Other servers may be running on the machine: tests look at their own."""
    prefix = f"batchd-{instance}"
    return sorted(p.name for p in SHM.iterdir() if p.name.startswith(prefix))


_NOT_THE_SERVERS = (b"resource_tracker", b"weed\x00server\x00", b"fake-gcs-server", b"azurite")


def child_pids() -> set[int]:
    """Live children of this process (zombies excluded), except multiprocessing's resource
    tracker (the ``spawn`` start method starts that helper once per process and it exits
    with its parent) and a test's own store (``s3server.py``, ``cloudservers.py``), which a
    test may restart while a server runs."""
    me = os.getpid()
    found: set[int] = set()
    for task in Path(f"/proc/{me}/task").iterdir():
        try:
            text = (task / "children").read_text()
        except OSError:
            continue
        found.update(int(p) for p in text.split())
    alive = set()
    for pid in found:
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
        if state == "Z" or any(name in cmdline for name in _NOT_THE_SERVERS):
            continue
        alive.add(pid)
    return alive


@contextlib.contextmanager
def serve(database_url: str, socket_dir: Path, **config: Any) -> Iterator[RunningServer]:
    """A real server on a unix socket in ``socket_dir``; checks for leaks when it stops."""
    before_children = child_pids()
    config.setdefault("workers", 2)
    server = build_server(
        ServerConfig(database_url=database_url, **config), f"unix://{socket_dir}/batchd.sock"
    )
    try:
        yield server
    finally:
        server.stop(grace_s=1.0)
    left = batchd_segments(server.registry.instance)
    assert not left, f"the server left shared memory behind: {left}"
    survivors = child_pids() - before_children
    assert not survivors, f"processes outlived the server: {survivors}"


@contextlib.contextmanager
def tcp_server(engine: Engine, **config: Any) -> Iterator[RunningServer]:
    """A real server on 127.0.0.1 (a free port); checks for leaks when it stops."""
    before = child_pids()
    url = engine.url.render_as_string(hide_password=False)
    server = build_server(ServerConfig(database_url=url, workers=1, **config), "127.0.0.1:0")
    try:
        yield server
    finally:
        server.stop(grace_s=1.0)
    assert batchd_segments(server.registry.instance) == []
    assert child_pids() - before == set()


def install_decoders(site: Path, source: str, entry_points: dict[str, str]) -> str:
    """A real distribution in ``site`` (put it on sys.path) whose module holds ``source`` and
    registers ``entry_points`` (name -> attribute, or ``module:attribute`` elsewhere) in the
    group ``batchd.decoders``. Returns the module's name, unique per ``site``."""
    module = "batchd_test_decoders_" + "".join(c if c.isalnum() else "_" for c in site.parent.name)
    dist_info = site / "batchd_test_decoders-0.dist-info"
    dist_info.mkdir(parents=True)
    (dist_info / "METADATA").write_text(
        "Metadata-Version: 2.1\nName: batchd-test-decoders\nVersion: 0\n"
    )
    lines = [
        f"{name} = {target if ':' in target else f'{module}:{target}'}"
        for name, target in entry_points.items()
    ]
    (dist_info / "entry_points.txt").write_text("[batchd.decoders]\n" + "\n".join(lines) + "\n")
    (site / f"{module}.py").write_text(source)
    return module


def image_dataset(
    engine: Engine, root: Path, *, n: int = 40, name: str = "images"
) -> dict[str, Any]:
    """``n`` synthetic JPEGs (160-640 px) ingested as ``name`` (splits train and val)."""
    info = write_demo_images(root, n, seed=1)
    ingest_imagefolder(engine, dataset=name, root=root)
    return info


def record_dataset(
    engine: Engine,
    root: Path,
    *,
    n: int = 1000,
    name: str = "records",
    bad: dict[int, str] | None = None,
    floats: int = RECORD_FLOATS,
) -> np.ndarray:
    """``n`` records of ``floats`` float32 in one shard file, read through byte ranges.

    Record ``i`` is ``i * 1000 + arange(floats)``, label ``i % 10``. ``bad`` maps record indices
    to a fault: "range" (a byte range past the end of the file) or "missing" (another file).

    Returns:
        The records, ``[n, floats]`` float32, in ingest order.
    """
    root.mkdir(parents=True, exist_ok=True)
    records = np.arange(n, dtype=np.float32)[:, None] * 1000 + np.arange(floats, dtype=np.float32)
    (root / "shard-000.bin").write_bytes(records.tobytes())
    record_bytes = floats * 4
    rows = []
    for i in range(n):
        row = {
            "key": f"r{i:06d}",
            "path": "shard-000.bin",
            "byte_offset": i * record_bytes,
            "byte_length": record_bytes,
            "label": i % 10,
            "split": "train",
        }
        fault = (bad or {}).get(i)
        if fault == "range":
            row["byte_offset"] = n * record_bytes
        elif fault == "missing":
            row["path"] = "missing.bin"
        rows.append(row)
    manifest = root.parent / f"{name}.jsonl"
    manifest.write_text("".join(json.dumps(r) + "\n" for r in rows))
    ingest_manifest(engine, dataset=name, root=root, manifest=manifest, verify=False)
    return records


def records_loader(server: RunningServer, **options: Any) -> batchd.Loader:
    """A Loader of ``server``'s "records" dataset (``record_dataset``), 16 raw records a batch
    unless ``options`` say otherwise."""
    options.setdefault("batch_size", 16)
    options.setdefault("pipeline", batchd.Array((RECORD_FLOATS,), "float32", raw=True))
    return batchd.Loader(server.address, dataset="records", **options)


def token_dataset(
    engine: Engine, root: Path, *, n: int = 50, name: str = "tokens"
) -> list[np.ndarray]:
    """``n`` int32 token files; sample ``i`` has ``i % 13 + 1`` tokens ``i*100 + arange``."""
    root.mkdir(parents=True, exist_ok=True)
    seqs = []
    rows = []
    for i in range(n):
        seq = (i * 100 + np.arange(i % 13 + 1)).astype("<i4")
        (root / f"t{i:04d}.bin").write_bytes(seq.tobytes())
        seqs.append(seq)
        rows.append({"path": f"t{i:04d}.bin", "split": "train", "label": i, "length": len(seq)})
    manifest = root.parent / f"{name}.jsonl"
    manifest.write_text("".join(json.dumps(r) + "\n" for r in rows))
    ingest_manifest(engine, dataset=name, root=root, manifest=manifest)
    return seqs
