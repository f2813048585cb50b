"""Host-to-device paths for a batch that sits in a shared-memory slot (needs CUDA).

Measures, for one batch size, the three ways the client can get a slot's bytes onto the GPU:

- ``pageable``: ``dev.copy_(slot_tensor)`` straight from the shm mapping (no pinning);
- ``pinned-copy``: memcpy the slot into a pinned buffer from a pool of 2, then
  ``copy_(non_blocking=True)`` on a side stream, the consumer stream waiting on an event;
- ``registered``: ``cudaHostRegister`` the whole shm ring once, then ``copy_(non_blocking=True)``
  from the slot on a side stream (no host copy at all).

It prints GB/s (wall, over all batches) and the host process's CPU ms per batch, which is
what the training process pays. Run: ``python bench/h2d_paths.py --mib 9.63 --batches 200``.
"""

from __future__ import annotations

import argparse
import mmap
import os
import time

import numpy as np
import torch
from plots import recorded


def make_ring(slots: int, slot_bytes: int) -> tuple[mmap.mmap, np.ndarray, str]:
    name = f"/dev/shm/batchd-h2d-probe-{os.getpid()}"
    fd = os.open(name, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
    try:
        os.posix_fallocate(fd, 0, slots * slot_bytes)
        mm = mmap.mmap(fd, slots * slot_bytes)
    finally:
        os.close(fd)
    arr = np.frombuffer(mm, dtype=np.uint8).reshape(slots, slot_bytes)
    arr[:] = np.random.default_rng(0).integers(0, 255, size=slot_bytes, dtype=np.uint8)
    return mm, arr, name


def run(path: str, ring: np.ndarray, batches: int, dev: torch.device) -> tuple[float, float]:
    slots, slot_bytes = ring.shape
    out = [torch.empty(slot_bytes, dtype=torch.uint8, device=dev) for _ in range(2)]
    side = torch.cuda.Stream(device=dev)
    main = torch.cuda.current_stream(dev)
    pinned = [torch.empty(slot_bytes, dtype=torch.uint8).pin_memory() for _ in range(2)]
    pinned_free = [torch.cuda.Event() for _ in range(2)]
    for e in pinned_free:
        e.record(side)
    views = [torch.from_numpy(ring[s]) for s in range(slots)]
    torch.cuda.synchronize()
    cpu0, t0 = time.process_time(), time.perf_counter()
    for k in range(batches):
        src = views[k % slots]
        dst = out[k % 2]
        if path == "pageable":
            dst.copy_(src)
        elif path == "pinned-copy":
            buf = pinned[k % 2]
            pinned_free[k % 2].synchronize()  # recycle a pinned buffer only after its copy
            np.copyto(buf.numpy(), ring[k % slots])
            with torch.cuda.stream(side):
                dst.copy_(buf, non_blocking=True)
                pinned_free[k % 2].record(side)
            main.wait_stream(side)
        elif path == "registered":
            with torch.cuda.stream(side):
                dst.copy_(src, non_blocking=True)
                done = torch.cuda.Event()
                done.record(side)
            main.wait_stream(side)
            done.synchronize()  # the slot may be acknowledged (reused) only after this
        else:
            raise ValueError(path)
    torch.cuda.synchronize()
    wall = time.perf_counter() - t0
    cpu = time.process_time() - cpu0
    return batches * slot_bytes / wall / 1e9, cpu / batches * 1e3


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--mib", type=float, nargs="+", default=[9.63, 38.5])
    p.add_argument("--batches", type=int, default=200)
    p.add_argument("--slots", type=int, default=4)
    args = p.parse_args()
    dev = torch.device("cuda")
    print(f"torch {torch.__version__}, {torch.cuda.get_device_name(dev)}, slots={args.slots}")
    print("| batch MB | path | GB/s | host CPU ms/batch | one-time register ms |")
    print("|---|---|---|---|---|")
    for mib in args.mib:
        slot_bytes = int(mib * 1e6)
        mm, ring, name = make_ring(args.slots, slot_bytes)
        try:
            cudart = torch.cuda.cudart()
            t0 = time.perf_counter()
            rc = cudart.cudaHostRegister(ring.ctypes.data, ring.nbytes, 0)
            reg_ms = (time.perf_counter() - t0) * 1e3
            registered = int(rc) == 0
            for path in ("pageable", "pinned-copy", "registered"):
                if path == "registered" and not registered:
                    print(f"| {mib} | registered | failed rc={rc} | | |")
                    continue
                if path == "pageable" and registered:
                    # measure pageable on an unregistered copy of the ring
                    plain = np.array(ring)
                    gbs, cpu = run(path, plain, args.batches, dev)
                else:
                    run(path, ring, 10, dev)
                    gbs, cpu = run(path, ring, args.batches, dev)
                extra = f"{reg_ms:.1f}" if path == "registered" else ""
                print(f"| {mib} | {path} | {gbs:.2f} | {cpu:.2f} | {extra} |")
            if registered:
                cudart.cudaHostUnregister(ring.ctypes.data)
        finally:
            del ring
            mm.close()
            os.unlink(name)


if __name__ == "__main__":
    with recorded("h2d_paths"):
        main()
