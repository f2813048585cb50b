"""What a shared batch costs the server beside its decode when it is copied into a slot.

A share group decodes a batch once; a member whose client reads other rings reads it in the
decoding member's slot, and one that cannot (inline, a CUDA-registered ring, or past the
bound on what readers may hold) gets a copy in its own ring (NOTE [ Share groups ] in
``server/src/batchd_server/sessions/share.py``). This measures that copy alone, through the
real path (``ShareGroup.claim`` of a batch another member's slot holds), for ``[B, 3, 224,
224]`` uint8 images: two members, each a ring of ``--slots`` slots in ``/dev/shm`` (laid out
by the server's ``slot_layout``), the batches cycling through the slots so the copies run
out of cache as the server's do. The worker pool is a stand-in that reports each batch
decoded at once: only the copy is timed (wall and thread CPU per batch).

Run: ``python bench/share_copy.py`` (a few seconds); ``--batch-sizes 32 64 128``.
"""

from __future__ import annotations

import argparse
import mmap
import os
import statistics
import time
from concurrent.futures import Future

import numpy as np
from _common import machine_lines, markdown_table

from batchd_server.pipelines.base import FieldSpec
from batchd_server.sessions.options import slot_layout
from batchd_server.sessions.share import ShareGroup
from batchd_server.sessions.share_records import ShareCounts
from batchd_server.workers.task import BatchResult, BatchTask, SlotField


class _Member:
    """A session as its group sees it: an id, the layout, a ring of slots in /dev/shm."""

    def __init__(self, name: str, layout: tuple[SlotField, ...], slot_bytes: int, slots: int):
        self.id, self.layout, self._slot_bytes = name, layout, slot_bytes
        path = f"/dev/shm/batchd-bench-share-copy-{name}-{os.getpid()}"
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
        try:
            os.ftruncate(fd, slot_bytes * slots)
            self.buf = mmap.mmap(fd, slot_bytes * slots)
        finally:
            os.close(fd)
            os.unlink(path)
        np.frombuffer(self.buf, np.uint8)[:] = np.random.default_rng(0).integers(
            0, 256, len(self.buf), dtype=np.uint8
        )

    def slot_memory(self, slot: int) -> memoryview:
        return memoryview(self.buf)[slot * self._slot_bytes : (slot + 1) * self._slot_bytes]


class _DecodedAtOnce:
    def __init__(self, shapes: dict[str, tuple[int, ...]], rows: int) -> None:
        self._shapes, self._rows = shapes, rows

    def submit(self, task: BatchTask) -> Future[BatchResult]:
        done: Future[BatchResult] = Future()
        done.set_result(BatchResult(task.batch_index, task.slot, self._rows, self._shapes))
        return done


def measure(batch: int, slots: int, batches: int) -> list[str]:
    image = FieldSpec("image", np.dtype("uint8"), (3, 224, 224))
    layout, slot_bytes = slot_layout([image], batch)
    shapes = {"image": (batch, 3, 224, 224), "sample_id": (batch,), "label": (batch,)}
    one, two = (_Member(n, layout, slot_bytes, slots) for n in ("one", "two"))
    group = ShareGroup("k", "bench", "d", layout, _DecodedAtOnce(shapes, batch), ShareCounts())
    wall, cpu = [], []
    for k in range(batches):
        slot = k % slots
        positions = np.arange(k * batch, (k + 1) * batch, dtype=np.int64).tobytes()
        group.claim(one, BatchTask(None, 0, k, slot, positions))  # type: ignore[arg-type]
        t0, c0 = time.perf_counter(), time.thread_time()
        group.claim(two, BatchTask(None, 0, k, slot, positions)).result()  # type: ignore[arg-type]
        wall.append(time.perf_counter() - t0)
        cpu.append(time.thread_time() - c0)
        group.forget(one, slot)
        group.forget(two, slot)
    assert group.copied == batches and group.decoded == batches
    nbytes = sum(int(np.prod(s)) * (1 if n == "image" else 8) for n, s in shapes.items())
    wall, cpu = wall[slots:], cpu[slots:]  # after every slot was touched once
    median = statistics.median(wall)
    return [
        f"{batch}",
        f"{nbytes / 1e6:.2f}",
        f"{median * 1e3:.2f} ({min(wall) * 1e3:.2f}-{max(wall) * 1e3:.2f})",
        f"{statistics.median(cpu) * 1e3:.2f}",
        f"{nbytes / median / 1e9:.1f}",
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[32, 64])
    parser.add_argument("--slots", type=int, default=16, help="slots per member's ring")
    parser.add_argument("--batches", type=int, default=200, help="copies per batch size")
    args = parser.parse_args()
    print("## The copy behind a shared batch\n")
    print("\n".join(machine_lines()) + "\n")
    rows = [measure(b, args.slots, args.batches) for b in args.batch_sizes]
    header = ["batch", "MB a batch", "copy ms, median (min-max)", "CPU ms", "GB/s"]
    print(markdown_table(header, rows))


if __name__ == "__main__":
    main()
