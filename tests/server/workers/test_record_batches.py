"""Small records in shard files decode a batch at a time, equal to decoding each alone: .npy
headers parsed once per distinct bytes, tokens padded as before, and bad records reported per
sample under every on_error policy exactly as the sample-by-sample path reports them."""

from __future__ import annotations

import io
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from batchd_server.pipelines import ArrayPipeline, TokensPipeline, build_pipeline
from batchd_server.pipelines.base import BadSample, SampleInfo
from batchd_server.shm import ShmRegistry
from batchd_server.shm.arrays import pack_arrays
from batchd_server.workers.context import SessionContext
from batchd_server.workers.task import BatchResult, BatchTask, SessionSpec, SlotField, SourceSpec

I64 = np.int64


def npy(array: np.ndarray) -> bytes:
    out = io.BytesIO()
    np.save(out, array)
    return out.getvalue()


def info(i: int = 0) -> SampleInfo:
    return SampleInfo(sample_id=i, label=-1, path=f"r{i}", length=-1, seed=0, epoch=0)


def packed(blobs: list[bytes]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The blobs back to back, with a stray byte between each: (data, starts, lengths)."""
    data = b"".join(b"\xff" + b for b in blobs)
    lengths = np.array([len(b) for b in blobs], I64)
    starts = np.cumsum(lengths + 1) - lengths
    return np.frombuffer(data, np.uint8), starts.astype(I64), lengths


def test_npy_records_of_a_batch_decode_as_each_alone() -> None:
    """Mixed byte orders and memory orders in one batch: the same rows as decode_into."""
    values = np.arange(40 * 6, dtype=np.float64).reshape(40, 2, 3)
    stored = [
        [v, v.astype(">f8"), np.asfortranarray(v), np.asfortranarray(v.astype(">f8"))][i % 4]
        for i, v in enumerate(values)
    ]
    data, starts, lengths = packed([npy(a) for a in stored])
    pipeline = ArrayPipeline((2, 3), "float64")
    block = {"array": np.zeros((48, 2, 3))}
    assert pipeline.decode_batch(data, starts, lengths, block)
    np.testing.assert_array_equal(block["array"][:40], values)
    assert not block["array"][40:].any()


def test_a_npy_header_is_parsed_once_per_distinct_header_bytes(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Batches and single samples share the cache; two distinct headers, two parses."""
    parses: Counter[str] = Counter()
    real = np.lib.format.read_array_header_1_0

    def counting(*args: Any, **kwargs: Any) -> Any:
        parses["v1"] += 1
        return real(*args, **kwargs)

    monkeypatch.setattr(np.lib.format, "read_array_header_1_0", counting)
    pipeline = ArrayPipeline((32,), "float32")
    blobs = [npy(np.full(32, i, np.float32)) for i in range(256)]
    data, starts, lengths = packed(blobs)
    block = {"array": np.zeros((256, 32), np.float32)}
    for _ in range(3):
        assert pipeline.decode_batch(data, starts, lengths, block)
    for i, blob in enumerate(blobs[:50]):
        pipeline.decode_into(memoryview(blob), info(i), {"array": block["array"][i]})
    assert parses["v1"] == 1
    pipeline.decode_into(memoryview(npy(np.zeros(32, ">f4"))), info(), {"array": block["array"][0]})
    assert parses["v1"] == 2
    np.testing.assert_array_equal(block["array"][1:, 0], np.arange(1, 256))


def test_a_batch_with_a_record_that_is_not_right_is_declined() -> None:
    """Another shape, another length, a damaged header or an object array: False, not a raise."""
    good = npy(np.zeros(4, np.float32))
    pipeline = ArrayPipeline((4,), "float32")
    for bad in (
        npy(np.zeros(5, np.float32)),
        npy(np.zeros(4, np.float64)),
        good[:-1],
        good[:10] + b"{'descr': oops" + good[24:],
        npy(np.array([None] * 4, dtype=object)),
    ):
        data, starts, lengths = packed([good, bad, good])
        assert not pipeline.decode_batch(data, starts, lengths, {"array": np.zeros((3, 4))})
    raw = ArrayPipeline((4,), "float32", raw=True)
    data, starts, lengths = packed([bytes(16), bytes(12)])
    assert not raw.decode_batch(data, starts, lengths, {"array": np.zeros((2, 4), np.float32)})


def test_token_batches_decode_as_each_alone() -> None:
    """Truncation, empty and odd rows, the last row at the end of the data: same batch."""
    rng = np.random.default_rng(0)
    sequences = [rng.integers(1, 9999, n).astype("<u2") for n in (5, 0, 12, 9, 3, 12)]
    data, starts, lengths = packed([s.tobytes() for s in sequences])
    pipeline = TokensPipeline(max_len=10, dtype="uint16", pad_id=7)

    def fields() -> dict[str, np.ndarray]:
        return {f.name: np.full((8, *f.shape), 99, f.dtype) for f in pipeline.fields()}

    batch, alone = fields(), fields()
    assert pipeline.decode_batch(data, starts, lengths, batch)
    for i, s in enumerate(sequences):
        row = {name: field[i, ...] for name, field in alone.items()}
        pipeline.decode_into(memoryview(s.tobytes()), info(i), row)
    assert pipeline.finish(batch, 6) == pipeline.finish(alone, 6)
    for name in batch:
        np.testing.assert_array_equal(batch[name], alone[name])
    assert not pipeline.decode_batch(*packed([b"\x01\x00\x02"]), fields())


# --- the worker: SessionContext over a real catalog segment and ring in /dev/shm -------------


def slot_fields(fields: list[Any], batch_size: int) -> tuple[tuple[SlotField, ...], int]:
    every = [(f.name, f.dtype, f.shape) for f in fields]
    every += [("sample_id", np.dtype("<i8"), ()), ("label", np.dtype("<i8"), ())]
    placed, offset = [], 0
    for name, dtype, shape in every:
        capacity = batch_size * int(np.prod(shape, dtype=I64)) * dtype.itemsize
        placed.append(SlotField(name, dtype.str, tuple(shape), offset, capacity))
        offset += -(-capacity // 64) * 64
    return tuple(placed), -(-offset // 4096) * 4096


@contextmanager
def worker_session(
    root: Path,
    rows: list[tuple[str, int, int]],
    kind: str,
    options: dict[str, Any],
    *,
    batch_size: int,
    on_error: str = "skip",
) -> Iterator[SessionContext]:
    """What a worker holds for a session whose samples are ``rows`` of (path, offset, length)."""
    paths = [p.encode() for p, _, _ in rows]
    n = len(rows)
    arrays = {
        "ids": np.arange(100, 100 + n, dtype=I64),
        "labels": np.arange(n, dtype=I64) % 7,
        "lengths": np.full(n, -1, np.int32),
        "byte_offsets": np.array([o for _, o, _ in rows], I64),
        "byte_lengths": np.array([k for _, _, k in rows], I64),
        "path_bytes": np.frombuffer(b"".join(paths), np.uint8),
        "path_offsets": np.concatenate([[0], np.cumsum([len(p) for p in paths])]).astype(I64),
    }
    fields, slot_bytes = slot_fields(build_pipeline(kind, options).fields(), batch_size)
    with ShmRegistry(budget_bytes=64 << 20) as registry:
        catalog = pack_arrays(registry, arrays, purpose="test catalog")
        ring = registry.create("ring", 4096 + slot_bytes, purpose="test ring")
        spec = SessionSpec(
            session_id="s",
            pipeline_kind=kind,
            pipeline_options=options,
            ring_segment=ring.name,
            header_bytes=4096,
            slot_bytes=slot_bytes,
            fields=fields,
            batch_size=batch_size,
            seed=3,
            on_error=on_error,
            sources=(SourceSpec(catalog.name, str(root)),),
            shm_dir=str(registry.shm_dir),
        )
        context = SessionContext(spec)
        try:
            yield context
        finally:
            context.close()


def run(context: SessionContext, positions: list[int]) -> tuple[BatchResult, dict[str, Any]]:
    """Run one task into slot 0; the result and a copy of every field's final rows."""
    task = BatchTask(context.spec, 0, 0, 0, np.array(positions, I64).tobytes())
    result = context.run(task)
    block = context.slot_block(0)
    rows = {
        name: block[name].reshape(-1)[: int(np.prod(shape))].reshape(shape).copy()
        for name, shape in result.shapes.items()
    }
    return result, rows


def write_npy_shard(root: Path, n: int, bad: dict[int, bytes]) -> list[tuple[str, int, int]]:
    """``n`` .npy records of 8 float32 (value i) in one shard; ``bad`` replaces some."""
    blobs = [bad.get(i, npy(np.full(8, i, np.float32))) for i in range(n)]
    (root / "shard.bin").write_bytes(b"".join(blobs))
    offsets = np.cumsum([0, *map(len, blobs)])
    return [("shard.bin", int(offsets[i]), len(blobs[i])) for i in range(n)]


def test_a_worker_opens_a_shard_once_and_reads_an_ordered_batch_in_one_call(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Ten batches of 64 neighbouring .npy records: one open, one preadv per batch, right rows."""
    import os

    calls: Counter[str] = Counter()
    for name in ("open", "preadv"):
        real = getattr(os, name)
        monkeypatch.setattr(
            os, name, lambda *a, _r=real, _n=name, **k: (calls.update([_n]), _r(*a, **k))[1]
        )
    rows = write_npy_shard(tmp_path, 640, {})
    with worker_session(
        tmp_path, rows, "array", {"shape": [8], "dtype": "float32"}, batch_size=64
    ) as context:
        opens_before = calls["open"]
        for b in range(10):
            positions = list(range(b * 64, b * 64 + 64))[::-1]
            result, got = run(context, positions)
            assert result.rows == 64 and not result.failures
            np.testing.assert_array_equal(got["array"][:, 0], positions)
            np.testing.assert_array_equal(got["sample_id"], np.array(positions) + 100)
            np.testing.assert_array_equal(got["label"], np.array(positions) % 7)
        assert calls["open"] - opens_before == 1
        assert calls["preadv"] == 10


BAD = {
    3: b"not a npy at all",
    9: npy(np.zeros(8, np.float64)),
    17: npy(np.zeros(9, np.float32)),
}


@pytest.mark.parametrize("on_error", ["skip", "replace", "raise"])
@pytest.mark.parametrize("kind", ["npy", "raw", "tokens"])
def test_bad_records_are_reported_per_sample_exactly_as_one_by_one(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, on_error: str, kind: str
) -> None:
    """Good and bad batches, shuffled, give the same rows, failures and substitutes as the
    sample-by-sample path (the batch path switched off), under each on_error policy."""
    rng = np.random.default_rng(4)
    if kind == "npy":
        rows = write_npy_shard(tmp_path, 40, BAD)
        options: dict[str, Any] = {"shape": [8], "dtype": "float32"}
    else:
        blobs = [rng.integers(0, 99, 8, dtype=np.int32).tobytes() for _ in range(40)]
        blobs[5], blobs[21] = b"\x01\x02\x03", b"\x00" * 30
        (tmp_path / "shard.bin").write_bytes(b"".join(blobs))
        offsets = np.cumsum([0, *map(len, blobs)])
        rows = [("shard.bin", int(offsets[i]), len(blobs[i])) for i in range(40)]
        options = (
            {"max_len": 6} if kind == "tokens" else {"shape": [8], "dtype": "int32", "raw": True}
        )
    rows[30] = ("shard.bin", 10**6, 32)  # past the end of the file
    rows[31] = ("missing.bin", 0, 32)
    pipeline_kind = "tokens" if kind == "tokens" else "array"
    batches = [rng.permutation(40)[:16].tolist() for _ in range(6)] + [list(range(0, 40, 3))]
    batches.append(list(range(39, 31, -1)))  # a good batch
    results = {}
    for batch_path in (True, False):
        with worker_session(
            tmp_path, rows, pipeline_kind, options, batch_size=16, on_error=on_error
        ) as context:
            if not batch_path:
                monkeypatch.setattr(context.pipeline, "decode_batch", lambda *a: False)
            results[batch_path] = [run(context, b) for b in batches]
    for (fast, fast_rows), (slow, slow_rows) in zip(results[True], results[False], strict=True):
        assert fast == slow
        assert fast_rows.keys() == slow_rows.keys()
        for name in fast_rows:
            np.testing.assert_array_equal(fast_rows[name], slow_rows[name])
    assert any(r.failures for r, _ in results[True]) and any(
        not r.failures for r, _ in results[True]
    )


def test_a_batch_without_a_bad_record_never_decodes_one_by_one(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Good batches of .npy records never reach decode_into (the per-sample path)."""
    rows = write_npy_shard(tmp_path, 300, {})

    def per_sample(*args: Any) -> None:
        raise AssertionError("decoded one by one")

    with worker_session(
        tmp_path, rows, "array", {"shape": [8], "dtype": "float32"}, batch_size=256
    ) as context:
        monkeypatch.setattr(context.pipeline, "decode_into", per_sample)
        positions = np.random.default_rng(5).permutation(300)[:256].tolist()
        result, got = run(context, positions)
    assert result.rows == 256
    np.testing.assert_array_equal(got["array"][:, 7], positions)
    with pytest.raises(BadSample):
        ArrayPipeline((8,), "float32").decode_into(memoryview(b"x"), info(), {})
