"""Chaos with bad data: the scenarios of ``bench/chaos.py`` whose fault is in the bytes, not
in a process. Each dataset holds the same records as the other scenarios' (record ``i`` is
``i * 1000 + arange(32)``, float32) plus samples no decoder can use; the clients skip bad
samples (``on_error="skip"``, the Loader's default), so every epoch must deliver every other
sample exactly once while the server records each bad one in the catalog (``sample_errors``).

- ``bad-objects``: one object per record in a real S3-compatible store (SeaweedFS on
  loopback, ``tests/s3server.py``), ingested from a trusted manifest without sizes (so the
  server learns each object's size only when it reads it), plus a zero-length object and an
  object of ``HUGE_BYTES`` (the server runs with ``--max-sample-bytes`` of
  ``MAX_SAMPLE_BYTES``). The server reads through a node cache (``--cache-dir``), and the
  faults damage that cache while the clients stream: a block file is deleted, replaced by a
  directory or a FIFO, or overwritten with other bytes (every 1-3 s).
- ``hostile-parquet``: the records as a binary column of Parquet files, plus a file whose
  first page header is a hostile Thrift structure (a map of bools that claims 2^32 - 1
  entries) and a file whose one row is a ZSTD bomb (``BOMB_BYTES`` of zeros that compress to
  a few KiB); a decode worker is SIGKILLed every 2-5 s meanwhile.

A sample that must come out bad and is not recorded bad is a problem of the run, and so is a
bad sample delivered (it counts as duplicated: an id that is not in the split).
"""

from __future__ import annotations

import json
import os
import random
import signal
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import obstore
import pyarrow as pa
import pyarrow.parquet as pq
import sqlalchemy as sa
from sqlalchemy.engine import Engine

from batchd_server.catalog.ingest import ingest_manifest, ingest_parquet

TESTS_DIR = Path(__file__).resolve().parent.parent / "tests"
sys.path.insert(0, str(TESTS_DIR))

from s3server import ThrowawayS3, store_env, throwaway_s3  # noqa: E402

__all__ = [
    "DATA_SCENARIOS",
    "DATA_SETTINGS",
    "INTERVALS_S",
    "BadData",
    "damage_cache",
    "data_store",
    "inject",
    "prepare",
    "recorded_bad",
]

DATA_SCENARIOS = ("bad-objects", "hostile-parquet")
INTERVALS_S = {"bad-objects": (1.0, 3.0), "hostile-parquet": (2.0, 5.0)}
FLOATS = 32
BUCKET = "chaos"
MAX_SAMPLE_BYTES = 1 << 20
HUGE_BYTES = 64 << 20
"""bad-objects: the huge object, 64x the server's --max-sample-bytes."""
BOMB_BYTES = 256 << 20
"""hostile-parquet: what the bomb row decompresses to."""
HOSTILE_ROWS = 8
CACHE_BYTES = 256 << 20
HOSTILE_HEADER = bytes([0x1B, 0xFF, 0xFF, 0xFF, 0xFF, 0x0F, 0x11, 0x01, 0x00])
"""A Thrift compact struct whose field 1 is a map of bool to bool of 2^32 - 1 entries, in 9
bytes: what a page-header walker must refuse rather than walk."""


DATA_SETTINGS = {
    "bad-objects": (
        f"one S3 object per record (SeaweedFS on loopback), sizes unknown to the catalog, plus "
        f"a zero-length and a {HUGE_BYTES >> 20} MiB object; --max-sample-bytes "
        f"{MAX_SAMPLE_BYTES}, a node cache of {CACHE_BYTES >> 20} MiB whose block files are "
        "deleted, replaced by a directory or a FIFO, or overwritten"
    ),
    "hostile-parquet": (
        f"the records in a binary Parquet column, plus {HOSTILE_ROWS} rows behind a hostile "
        f"page header and a ZSTD bomb row of {BOMB_BYTES >> 20} MiB; --max-sample-bytes "
        f"{MAX_SAMPLE_BYTES}; a decode worker SIGKILLed per fault"
    ),
}


@dataclass
class BadData:
    """One scenario's dataset and what serving it needs."""

    dataset: str
    server_args: tuple[str, ...]
    must_be_bad: dict[int, str]
    """Sample ids that can only end as bad samples: the kind each must be recorded as, or ""
    for any kind."""
    cached: bool = False
    """Serve through a node cache (a fresh ``--cache-dir`` per run), which the faults damage."""

    def args(self, workdir: Path) -> tuple[str, ...]:
        """The ``serve`` options of one run in ``workdir``."""
        if not self.cached:
            return self.server_args
        cache = workdir / "cache"
        cache.mkdir(mode=0o700)
        return (*self.server_args, "--cache-dir", str(cache), "--cache-size", str(CACHE_BYTES))


def _record(i: int) -> bytes:
    return (np.float32(i * 1000) + np.arange(FLOATS, dtype=np.float32)).tobytes()


@contextmanager
def data_store(scenarios: list[str]) -> Iterator[ThrowawayS3 | None]:
    """A throwaway S3-compatible store, with this process's environment (which the servers
    inherit) pointing at it, if a scenario needs one."""
    if "bad-objects" not in scenarios:
        yield None
        return
    with throwaway_s3() as s3, store_env(s3):
        s3.create_bucket(BUCKET)
        yield s3


def prepare(
    scenario: str, engine: Engine, root: Path, records: int, s3: ThrowawayS3 | None
) -> BadData:
    """Write and ingest ``scenario``'s dataset under ``root``."""
    if scenario == "bad-objects":
        assert s3 is not None
        return _bad_objects(engine, root, records, s3)
    if scenario == "hostile-parquet":
        return _hostile_parquet(engine, root, records)
    raise ValueError(f"unknown data scenario {scenario!r}")


def _bad_objects(engine: Engine, root: Path, records: int, s3: ThrowawayS3) -> BadData:
    store = s3.store(BUCKET)
    rows = []
    for i in range(records):
        obstore.put(store, f"objs/r{i:06d}.bin", _record(i))
        rows.append({"key": f"r{i:06d}", "path": f"r{i:06d}.bin", "label": i % 10})
    obstore.put(store, "objs/empty.bin", b"")
    obstore.put(store, "objs/huge.bin", bytes(HUGE_BYTES))
    rows += [{"key": "empty", "path": "empty.bin"}, {"key": "huge", "path": "huge.bin"}]
    root.mkdir(parents=True, exist_ok=True)
    manifest = root / "objects.jsonl"
    manifest.write_text("".join(json.dumps({**r, "split": "train"}) + "\n" for r in rows))
    ingest_manifest(
        engine, dataset="objects", root=f"s3://{BUCKET}/objs", manifest=manifest, verify=False
    )
    args = ("--max-sample-bytes", str(MAX_SAMPLE_BYTES))
    bad = _ids(engine, "objects", {"empty": "", "huge": "too_large"})
    return BadData("objects", args, bad, cached=True)


def _hostile_parquet(engine: Engine, root: Path, records: int) -> BadData:
    root.mkdir(parents=True, exist_ok=True)
    for part, rows in enumerate(np.array_split(np.arange(records), 3)):
        _write(root / f"records-{part}.parquet", [int(i) for i in rows], [_record(i) for i in rows])
    hostile = list(range(records, records + HOSTILE_ROWS))
    path = root / "hostile.parquet"
    _write(path, hostile, [_record(i) for i in hostile], compression="none")
    column = pq.ParquetFile(path).metadata.row_group(0).column(0)
    start = column.dictionary_page_offset if column.has_dictionary_page else None
    start = column.data_page_offset if start is None else start
    with path.open("r+b") as f:  # the footer stays valid: ingest accepts the file
        f.seek(start)
        f.write(HOSTILE_HEADER)
    _write(root / "bomb.parquet", [records + HOSTILE_ROWS], [bytes(BOMB_BYTES)], compression="zstd")
    ingest_parquet(
        engine, dataset="pq", root=root, files=["*.parquet"], payload="record",
        split="train", label="label", key="key",
    )  # fmt: skip
    bad = {f"r{i:06d}": "" for i in hostile} | {f"r{records + HOSTILE_ROWS:06d}": "too_large"}
    args = ("--max-sample-bytes", str(MAX_SAMPLE_BYTES))
    return BadData("pq", args, _ids(engine, "pq", bad))


def _write(path: Path, ids: list[int], payloads: list[bytes], compression: str = "snappy") -> None:
    table = pa.table(
        {
            "record": pa.array(payloads, pa.binary()),
            "label": pa.array([i % 10 for i in ids], pa.int32()),
            "key": pa.array([f"r{i:06d}" for i in ids]),
        }
    )
    pq.write_table(table, path, row_group_size=16, compression=compression)


def _ids(engine: Engine, dataset: str, kinds: dict[str, str]) -> dict[int, str]:
    """``kinds`` (sample key -> kind) by sample id."""
    query = sa.text(
        "SELECT s.key, s.id FROM samples s JOIN datasets d ON d.id = s.dataset_id "
        "WHERE d.name = :name AND s.key IN :keys"
    ).bindparams(sa.bindparam("keys", expanding=True))
    with engine.connect() as conn:
        rows = conn.execute(query, {"name": dataset, "keys": list(kinds)}).tuples().all()
        found: dict[str, int] = {str(key): int(id_) for key, id_ in rows}
    if len(found) != len(kinds):
        raise RuntimeError(f"{dataset}: ingest kept {len(found)} of the bad samples {kinds}")
    return {int(found[key]): kind for key, kind in kinds.items()}


def recorded_bad(engine: Engine, dataset: str) -> dict[int, str]:
    """The samples of ``dataset`` the server recorded bad, and the kind of each."""
    query = sa.text(
        "SELECT e.sample_id, e.kind FROM sample_errors e JOIN samples s ON s.id = e.sample_id "
        "JOIN datasets d ON d.id = s.dataset_id WHERE d.name = :name"
    )
    with engine.connect() as conn:
        return {int(sample): kind for sample, kind in conn.execute(query, {"name": dataset})}


def damage_cache(rng: random.Random, cache_dir: Path) -> str:
    """Damage one block file of the node cache in ``cache_dir``; says how (or that there
    was none yet)."""
    blocks = [p for p in (cache_dir / "blocks").rglob("*") if p.is_file() and not p.is_symlink()]
    if not blocks:
        return "no block yet"
    victim = rng.choice(blocks)
    how = rng.choice(["deleted", "a directory", "a FIFO", "other bytes"])
    try:
        if how == "other bytes":
            size = victim.stat().st_size
            with victim.open("r+b") as f:
                f.write(rng.randbytes(max(1, min(size, 4096))))
            return how
        victim.unlink()
        if how == "a directory":
            victim.mkdir()
        elif how == "a FIFO":
            os.mkfifo(victim)
    except FileNotFoundError:  # evicted or replaced meanwhile: a race the cache has too
        return "gone before the damage"
    return how


def inject(rng: random.Random, data: BadData, workdir: Path, worker_pids: list[int]) -> str:
    """One fault of a data scenario: damage the node cache if there is one, else SIGKILL a
    decode worker. Says what it did."""
    if data.cached:
        return damage_cache(rng, workdir / "cache")
    if not worker_pids:
        return "no worker"
    try:
        os.kill(rng.choice(worker_pids), signal.SIGKILL)
    except ProcessLookupError:
        return "the worker had exited"
    return "a worker killed"
