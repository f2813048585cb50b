"""Decoder fuzz: truncated and byte-mutated JPEG, PNG, .npy and token files fed to the real
pipelines in real worker processes (a ``WorkerPool``, the code path a server runs), as whole
files and as byte ranges of a shard (the batch-at-a-time path). No file crashes or hangs a
worker; each one that cannot be served is a sample error naming its file; valid files in the
same batches still decode. A smaller run through a real server is in
``tests/e2e/test_served_decoder_fuzz.py``."""

from __future__ import annotations

from collections.abc import Iterator
from concurrent.futures import Future
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import pytest

from batchd_server.pipelines import build_pipeline
from batchd_server.pipelines.base import BadSample
from batchd_server.sessions.options import slot_layout
from batchd_server.shm import ShmRegistry
from batchd_server.shm.arrays import pack_arrays
from batchd_server.workers.pool import WorkerPool
from batchd_server.workers.task import BatchResult, BatchTask, SessionSpec, SourceSpec

from fuzzing import FORMATS, Fuzzed, write_fuzzed
from serving import child_pids

SEED = 20240611
PER_FORMAT = 320
BATCH = 32
FIRST_ID = 1000


@contextmanager
def _session(
    registry: ShmRegistry, fuzzed: Fuzzed, *, shard: bool
) -> Iterator[tuple[SessionSpec, list[str]]]:
    """A session over ``fuzzed``'s files (or one shard of them all) with a slot per batch;
    its spec and the path each sample's errors must name."""
    blobs = [(fuzzed.root / p).read_bytes() for p in fuzzed.paths]
    n = len(blobs)
    if shard:
        name = f"{fuzzed.fmt}-shard.bin"
        (fuzzed.root / name).write_bytes(b"".join(blobs))
        lengths = np.array([len(b) for b in blobs], np.int64)
        offsets = np.concatenate([[0], np.cumsum(lengths)[:-1]]).astype(np.int64)
        paths = [name] * n
    else:
        offsets = lengths = np.full(n, -1, np.int64)
        paths = list(fuzzed.paths)
    encoded = [p.encode() for p in paths]
    arrays = {
        "ids": np.arange(FIRST_ID, FIRST_ID + n, dtype=np.int64),
        "labels": np.zeros(n, np.int64),
        "lengths": np.full(n, -1, np.int32),
        "byte_offsets": offsets,
        "byte_lengths": lengths,
        "path_bytes": np.frombuffer(b"".join(encoded), np.uint8),
        "path_offsets": np.concatenate([[0], np.cumsum([len(p) for p in encoded])]).astype(
            np.int64
        ),
    }
    kind, options = fuzzed.pipeline
    fields, slot_bytes = slot_layout(build_pipeline(kind, options).fields(), BATCH)
    batches = -(-n // BATCH)
    catalog = pack_arrays(registry, arrays, purpose="fuzz catalog")
    ring = registry.create("ring", 4096 + batches * slot_bytes, purpose="fuzz ring")
    try:
        yield (
            SessionSpec(
                session_id=f"{fuzzed.fmt}-{'shard' if shard else 'files'}",
                pipeline_kind=kind,
                pipeline_options=options,
                ring_segment=ring.name,
                header_bytes=4096,
                slot_bytes=slot_bytes,
                fields=fields,
                batch_size=BATCH,
                seed=SEED,
                on_error="skip",
                sources=(SourceSpec(catalog.name, str(fuzzed.root)),),
                shm_dir=str(registry.shm_dir),
            ),
            paths,
        )
    finally:
        registry.release(ring)
        registry.release(catalog)


def test_mutated_files_never_crash_or_hang_a_worker_and_each_bad_one_is_named(
    tmp_path: Path,
) -> None:
    before = child_pids()
    fuzzed = [
        write_fuzzed(fmt, tmp_path / fmt, PER_FORMAT, SEED + i) for i, fmt in enumerate(FORMATS)
    ]
    pool = WorkerPool(2, task_timeout_s=30.0)
    pool.start()
    failed_mutants = mutants = 0
    try:
        with ShmRegistry(budget_bytes=256 << 20) as registry:
            for f in fuzzed:
                for shard in (False, True) if f.fmt in ("npy", "tokens") else (False,):
                    with _session(registry, f, shard=shard) as (spec, paths):
                        runs = _run(pool, spec, len(paths))
                        for positions, result in runs:
                            what = f"{spec.session_id} (seed {SEED})"
                            for failure in result.failures:
                                position = failure.sample_id - FIRST_ID
                                assert failure.kind in BadSample.KINDS, (what, failure)
                                assert failure.kind not in ("timeout", "transient"), (what, failure)
                                assert failure.path == paths[position], (what, failure)
                                assert paths[position] in failure.message, (what, failure)
                                assert position % 4, f"{what}: valid {paths[position]} failed"
                            assert result.rows + len(result.failures) == len(positions), what
                            if not shard:
                                mutants += sum(1 for p in positions if p % 4)
                                failed_mutants += len(result.failures)
                        pool.forget_session(spec.session_id)
        assert pool.restarts == 0, "a worker died or hung on a mutated file (see the log)"
    finally:
        pool.stop()
    assert child_pids() <= before, "a worker outlived the pool"
    # Not a real assertion on the decoders, a check on the fuzzing: most damage must show.
    assert failed_mutants > mutants / 3, f"only {failed_mutants} of {mutants} mutants failed"


def _run(pool: WorkerPool, spec: SessionSpec, n: int) -> list[tuple[list[int], BatchResult]]:
    """Every batch of the session through the pool, one slot each; (positions, result)."""
    submitted: list[tuple[list[int], Future[BatchResult]]] = []
    for k, start in enumerate(range(0, n, BATCH)):
        positions = list(range(start, min(start + BATCH, n)))
        task = BatchTask(spec, 0, k, k, np.array(positions, np.int64).tobytes())
        submitted.append((positions, pool.submit(task)))
    out = []
    for positions, future in submitted:
        try:
            out.append((positions, future.result(timeout=300)))
        except Exception as e:  # a bug in a pipeline: it must have been a BadSample
            pytest.fail(f"{spec.session_id}: batch of positions {positions[0]}.. failed: {e}")
    return out
