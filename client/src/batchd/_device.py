"""From a received batch to the user's tensors: on the CPU, or onto a CUDA device.

A :class:`Delivery` turns each :class:`~batchd._transport.stream.ReceivedBatch` into the dict
the training loop gets and says when the batch's ring slot may be acknowledged (reused by the
server). See the NOTE below for when that is on each path.

NOTE [ Slot lifecycle on the client ]
The server writes batch k into slot s and announces it under a lease. The slot is the
client's until it acks that lease; an ack is also the credit for one more batch, so holding
slots back throttles the server. Leases belong to the session, not to one stream: a batch
the loop still holds when its epoch ends keeps its slot (the next StreamStart lists it in
``held_leases``; every slot not listed there is free again). When each path acks:

- CPU default, lend: the tensors are views of the slot and own it, the way a DataLoader's
  tensors own their shared memory: the slot is acked when the last of them dies (a
  ``weakref.finalize`` on the slot array every view points at), from whatever thread drops
  it. No byte is copied. While the loop already holds ``max_lent`` batches (it keeps them in
  a list, say), further batches are copied instead, so the server always keeps slots to
  work with and the stream can never starve.
- CPU copy (read-only mappings, or past ``max_lent``): copy the fields into memory of their
  own, ack at once. That memory is recycled once the loop has dropped every tensor of the
  batch (see ``_Recycler``).
- CPU ``zero_copy=True``: views of the slot, acked when batch k+1 is asked for (or the
  iteration ends or is abandoned). So a zero-copy batch is valid until the next one is
  requested; keep it longer only as a ``.clone()``.
- CUDA, ring registered with ``cudaHostRegister``: the host-to-device copy reads the slot
  itself, on a side stream; the slot is acknowledged once that copy's event has completed
  (polled at each next batch, waited for when the credits run out or the epoch ends).
- CUDA, pinned pool (inline transport, or when registering fails): copy the slot into a
  pinned buffer, ack at once, then copy to the device on the side stream; a pinned buffer
  is reused only after its device copy's event completed.
- Inline batches arrive in a buffer of their own: acknowledged on arrival on every path.

On CUDA the consumer's current stream waits on the copy's event, and every output tensor is
``record_stream``-ed on it, so the caching allocator never hands out memory the training
loop may still be reading. On an H200 (measured with ``bench/h2d_paths.py``) the copy from a
registered slot runs at about 50 GB/s for about 1 ms of host CPU per batch, the pinned copy at
6-10 GB/s; so registering is tried first and the pinned pool is the fallback.
"""

from __future__ import annotations

import functools
import importlib
import logging
import sys
import threading
import weakref
from abc import ABC, abstractmethod
from collections import deque
from collections.abc import Callable
from types import ModuleType
from typing import Any, Final, TypeVar

import numpy as np
import numpy.typing as npt

from batchd._transport.shm import ShmRing
from batchd._transport.stream import ReceivedBatch
from batchd._wire.share import BORROWED_HELD
from batchd.errors import InvalidArgument

__all__ = [
    "H2D_STRATEGIES",
    "CpuDelivery",
    "CudaDelivery",
    "Delivery",
    "make_delivery",
    "resolve_device",
    "torch_or_none",
]

logger = logging.getLogger(__name__)

H2D_STRATEGIES: Final = ("auto", "registered", "pinned")
Batch = dict[str, Any]
_T = TypeVar("_T")


@functools.cache
def torch_or_none() -> ModuleType | None:
    """torch, when installed; the client runs on NumPy alone without it."""
    try:
        return importlib.import_module("torch")
    except ImportError:
        return None


def resolve_device(device: object) -> Any:
    """``"cpu"`` or a ``torch.device`` of CUDA with its index, from the user's ``device``.

    None means CUDA (the current device) when torch sees one, else the CPU.

    Raises:
        InvalidArgument: not a device, CUDA asked for where there is none, or a device type
            the client does not deliver to.
    """
    torch = torch_or_none()
    if torch is None:
        if device is None or device == "cpu":
            return "cpu"
        raise InvalidArgument(
            f"device={device!r} needs torch, which is not installed; install batchd[torch] "
            "or pass device='cpu' (batches are then dicts of NumPy arrays)"
        )
    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    try:
        parsed = torch.device(device)
    except (RuntimeError, TypeError) as e:
        raise InvalidArgument(f"device={device!r} is not a device: {e}") from e
    if parsed.type == "cpu":
        return "cpu"
    if parsed.type != "cuda":
        raise InvalidArgument(f"device={device!r}: batchd delivers to 'cpu' or 'cuda[:N]' only")
    if not torch.cuda.is_available():
        why = "torch was built without CUDA" if torch.version.cuda is None else "no GPU is visible"
        raise InvalidArgument(
            f"device={device!r} but CUDA is not available here ({why}, torch "
            f"{torch.__version__}); pass device='cpu' or leave device=None"
        )
    index = torch.cuda.current_device() if parsed.index is None else parsed.index
    count = torch.cuda.device_count()
    if not 0 <= index < count:
        raise InvalidArgument(f"device={device!r}: this machine has CUDA devices 0..{count - 1}")
    return torch.device("cuda", index)


def _as_tensors(torch: ModuleType | None, arrays: dict[str, npt.NDArray[Any]]) -> Batch:
    if torch is None:
        return dict(arrays)
    return {name: torch.from_numpy(arr) for name, arr in arrays.items()}


class Delivery(ABC):
    """What the Loader asks of a delivery path; see NOTE [ Slot lifecycle on the client ]."""

    @abstractmethod
    def deliver(self, batch: ReceivedBatch) -> tuple[Batch, list[int]]:
        """The user's dict for ``batch``, and the ack keys (``ack_key``) that may go now."""

    @abstractmethod
    def advance(self, *, wait: bool) -> list[int]:
        """The consumer asked for the next batch: ack keys that may go now.

        With ``wait``, block until at least one held batch can go (the server is out of
        credits), if any is held.
        """

    @abstractmethod
    def held_count(self) -> int:
        """Batches delivered and not yet acknowledgeable."""

    @abstractmethod
    def drain(self) -> list[int]:
        """Wait until every held batch can go (end of a stream) and return their keys."""

    def lent(self) -> list[int]:
        """Leases of batches the training loop still owns (see the NOTE); they outlive streams."""
        return []

    @property
    def reads_shared(self) -> bool:
        """A batch may be in another session's ring (a share group's loan,
        ``StreamStart.read_shared``): true unless the path wants its own registered ring."""
        return True

    def close(self) -> None:  # noqa: B027 (only the CUDA path has something to free)
        """Free what the path holds; the ring is unmapped after this. Idempotent."""


class _Recycler:
    """Host buffers for copied batches, reused once the training loop has let go of them.

    Copying into fresh memory costs a page fault per 4 KiB (glibc maps large blocks anew
    and unmaps them on free): about 3.7 GB/s here against about 7 GB/s into memory already
    mapped. A buffer handed out lives on in the views (and torch tensors) made from it;
    when nothing but this pool refers to it, its batch is gone and the memory is reused.
    """

    def __init__(self, keep: int) -> None:
        self._keep = keep
        self._buffers: list[npt.NDArray[np.uint8]] = []

    def take(self, nbytes: int) -> npt.NDArray[np.uint8]:
        for i in range(len(self._buffers)):
            # References: the list, and getrefcount's argument. Nothing else: unused.
            if sys.getrefcount(self._buffers[i]) == 2 and self._buffers[i].nbytes >= nbytes:
                return self._buffers[i]
        buffer = np.empty(max(nbytes, 1), np.uint8)
        if len(self._buffers) < self._keep:
            self._buffers.append(buffer)
        return buffer


class CpuDelivery(Delivery):
    """Tensors (NumPy arrays without torch) on the CPU: lent slots, copies, or zero-copy views.

    Args:
        zero_copy: Views valid until the next batch is asked for.
        prefetch: The session's prefetch depth.
        slots: Slots in the session's ring.
        release: Gives leases back from any thread (the doorbell); None inline, where
            nothing is lent.
    """

    def __init__(
        self,
        *,
        zero_copy: bool,
        prefetch: int = 4,
        slots: int = 0,
        release: Callable[[list[int]], None] | None = None,
    ) -> None:
        self._torch = torch_or_none()
        self._zero_copy = zero_copy
        self._held: list[int] = []
        self._recycler = _Recycler(keep=prefetch + 2)
        self._release = release
        self.max_lent = 0 if release is None else max(0, slots - max(1, prefetch // 2))
        """Batches the loop may own as slots at once; the ones after that are copied."""
        self._lent: set[int] = set()
        self._borrowed: set[int] = set()
        """The lent batches that are in another session's ring (at most BORROWED_HELD)."""
        self._lent_lock = threading.Lock()
        self._closed = False
        self.copies = 0
        """Batches copied out of their slot (not lent) since the session opened."""

    def deliver(self, batch: ReceivedBatch) -> tuple[Batch, list[int]]:
        if batch.inline:
            # The batch's own buffer: no copy, except of a field the server packed at an
            # offset that is not a multiple of its itemsize (misaligned tensors are legal
            # but slow, and some kernels assume alignment).
            arrays = {n: a if a.flags.aligned else a.copy() for n, a in batch.arrays.items()}
            return _as_tensors(self._torch, arrays), [batch.ack_key]
        readonly = any(not a.flags.writeable for a in batch.arrays.values())
        # A torch tensor has no read-only flag: a view of a read-only mapping would turn the
        # user's first in-place op into a segfault, so such views are only handed out as
        # NumPy arrays (which do refuse writes).
        if not (readonly and self._torch is not None):
            key = batch.ack_key
            if self._zero_copy:
                self._held.append(key)
                return _as_tensors(self._torch, batch.arrays), []
            with self._lent_lock:
                lend = len(self._lent) < self.max_lent
                if batch.borrowed:  # another session's slot: a member waits for it back
                    lend = lend and len(self._borrowed) < BORROWED_HELD
                if lend:
                    self._lent.add(key)
                    if batch.borrowed:
                        self._borrowed.add(key)
            if lend:
                finalizer = weakref.finalize(batch.memory, self._returned, key)
                finalizer.atexit = False
                return _as_tensors(self._torch, batch.arrays), []
        self.copies += 1
        # np.copyto goes through glibc memcpy and is up to 2x faster than Tensor.copy_
        # (about 7 GB/s on one thread) for large copies out of shared memory.
        buffer = self._recycler.take(batch.extent_bytes)
        copied = {}
        for name, arr in batch.arrays.items():
            start = batch.offsets[name]
            copied[name] = buffer[start : start + arr.nbytes].view(arr.dtype).reshape(arr.shape)
            np.copyto(copied[name], arr)
        del buffer
        return _as_tensors(self._torch, copied), [batch.ack_key]

    def _returned(self, key: int) -> None:
        """The last view of lent batch ``key`` died (any thread): its slot goes back."""
        with self._lent_lock:
            if key not in self._lent:
                return
            self._lent.discard(key)
            self._borrowed.discard(key)
            closed = self._closed
        if not closed and self._release is not None:
            self._release([key])

    def lent(self) -> list[int]:
        with self._lent_lock:
            return sorted(self._lent)

    def advance(self, *, wait: bool) -> list[int]:
        released, self._held = self._held, []
        return released

    def held_count(self) -> int:
        return len(self._held)

    def drain(self) -> list[int]:
        return self.advance(wait=True)

    def close(self) -> None:
        # The loop may keep lent batches past close: their views keep the mapping alive,
        # and nothing is acked for them any more (the session is gone).
        with self._lent_lock:
            self._closed = True


def _in_fresh_thread(fn: Callable[[], _T]) -> _T:
    """``fn()`` run in a thread of its own; its exception re-raised here."""
    result: list[_T] = []
    error: list[BaseException] = []

    def run() -> None:
        try:
            result.append(fn())
        except BaseException as e:
            error.append(e)

    thread = threading.Thread(target=run, name="batchd-cudart", daemon=True)
    thread.start()
    thread.join()
    if error:
        raise error[0]
    return result[0]


def _cudart_call(torch: ModuleType, device: Any, name: str, *args: int) -> int:
    """A ``cudaHostRegister``-style runtime call; its cudaError as an int (0 = success).

    The runtime keeps a failed call's error as the calling thread's "last error", which
    torch's next kernel-launch check on that thread would report as its own failure. In a
    throwaway thread the stale error dies with the thread.
    """

    def call() -> int:
        torch.cuda.set_device(device)
        return int(getattr(torch.cuda.cudart(), name)(*args))

    try:
        return _in_fresh_thread(call)
    except RuntimeError as e:
        if "thread" not in str(e):
            raise
        # No new threads at interpreter shutdown (a finalizer unregistering the ring): then
        # there is no later kernel launch for a stale error to confuse.
        with torch.cuda.device(device):
            return int(getattr(torch.cuda.cudart(), name)(*args))


class _PinnedPool:
    """A few pinned host buffers, each reused only after its last device copy finished."""

    def __init__(self, torch: ModuleType, count: int) -> None:
        self._torch = torch
        self._buffers: list[Any] = [None] * count
        self._copied: list[Any] = [None] * count
        self._next = 0

    def take(self, nbytes: int) -> tuple[int, npt.NDArray[np.uint8]]:
        i = self._next
        self._next = (i + 1) % len(self._buffers)
        if self._copied[i] is not None:
            self._copied[i].synchronize()
            self._copied[i] = None
        if self._buffers[i] is None or self._buffers[i].numel() < nbytes:
            self._buffers[i] = self._torch.empty(
                max(nbytes, 1), dtype=self._torch.uint8, pin_memory=True
            )
        return i, self._buffers[i].numpy()

    def copied(self, i: int, event: Any) -> None:
        self._copied[i] = event

    def close(self) -> None:
        # Copies read these buffers through NumPy views, which torch's host allocator does
        # not track: free them only after the copies are done.
        for event in self._copied:
            if event is not None:
                event.synchronize()
        self._buffers = [None] * len(self._buffers)
        self._copied = [None] * len(self._copied)


class CudaDelivery(Delivery):
    """CUDA tensors, copied on a side stream the consumer's stream waits on.

    Args:
        device: A ``torch.device`` of type cuda with its index.
        ring: The session's mapped ring (shm), or None (inline).
        prefetch: The session's credits; the pinned pool has ``prefetch + 1`` buffers.
        h2d: ``"auto"`` (register the ring, else the pinned pool), ``"registered"`` (fail
            if registering fails) or ``"pinned"``.
    """

    def __init__(self, device: Any, *, ring: ShmRing | None, prefetch: int, h2d: str) -> None:
        torch = torch_or_none()
        assert torch is not None, "resolve_device returns a CUDA device only with torch"
        self._torch = torch
        self._device = device
        self._side = torch.cuda.Stream(device=device)
        self._pool = _PinnedPool(torch, prefetch + 1)
        self._in_flight: deque[tuple[int, Any]] = deque()
        self._registered: int | None = None
        """The address of the registered ring mapping, if registered."""
        if ring is not None and h2d != "pinned":
            self._registered = self._register(ring, required=h2d == "registered")
        self.strategy = "registered" if self._registered is not None else "pinned"
        """Which host-to-device path this session uses."""

    def _register(self, ring: ShmRing, *, required: bool) -> int | None:
        problem = "the segment is mapped read-only"
        if ring.writable:
            address = ring.bytes.ctypes.data
            rc = _cudart_call(
                self._torch, self._device, "cudaHostRegister", address, ring.bytes.nbytes, 0
            )
            if rc == 0:
                return address
            problem = f"cudaHostRegister returned cudaError {rc}"
        if required:
            raise InvalidArgument(f"h2d='registered' is not possible here: {problem}")
        logger.info("batchd: using pinned staging buffers for %s (%s)", self._device, problem)
        return None

    def deliver(self, batch: ReceivedBatch) -> tuple[Batch, list[int]]:
        torch = self._torch
        done = torch.cuda.Event()
        pinned = -1
        if self._registered is not None and not batch.inline and not batch.borrowed:
            sources = {name: torch.from_numpy(arr) for name, arr in batch.arrays.items()}
            acks: list[int] = []
        else:
            pinned, buffer = self._pool.take(batch.extent_bytes)
            sources = {}
            for name, arr in batch.arrays.items():
                start = batch.offsets[name]
                staged = buffer[start : start + arr.nbytes].view(arr.dtype).reshape(arr.shape)
                np.copyto(staged, arr)
                sources[name] = torch.from_numpy(staged)
            acks = [batch.ack_key]  # the bytes are out of the slot
        with torch.cuda.stream(self._side):
            out = {name: t.to(self._device, non_blocking=True) for name, t in sources.items()}
            done.record(self._side)
        if pinned >= 0:
            self._pool.copied(pinned, done)
        else:
            self._in_flight.append((batch.ack_key, done))
        consumer = torch.cuda.current_stream(self._device)
        consumer.wait_event(done)
        for tensor in out.values():
            # Allocated on the side stream, used on the consumer's: without this the caching
            # allocator could reuse the memory while the training loop still reads it.
            tensor.record_stream(consumer)
        return out, acks

    def advance(self, *, wait: bool) -> list[int]:
        acks = []
        while self._in_flight and self._in_flight[0][1].query():
            acks.append(self._in_flight.popleft()[0])
        if wait and not acks and self._in_flight:
            index, done = self._in_flight.popleft()
            done.synchronize()
            acks.append(index)
        return acks

    @property
    def reads_shared(self) -> bool:
        # A registered ring copies to the device straight from its slots; another member's
        # ring is not registered, so a share group copies into this one's slots instead.
        return self._registered is None

    def held_count(self) -> int:
        return len(self._in_flight)

    def drain(self) -> list[int]:
        acks = []
        while self._in_flight:
            index, done = self._in_flight.popleft()
            done.synchronize()
            acks.append(index)
        return acks

    def close(self) -> None:
        self.drain()
        self._pool.close()
        address, self._registered = self._registered, None
        if address is not None:
            rc = _cudart_call(self._torch, self._device, "cudaHostUnregister", address)
            if rc != 0:
                logger.warning("batchd: cudaHostUnregister of the ring failed (cudaError %d)", rc)


def make_delivery(
    device: Any,
    *,
    zero_copy: bool,
    ring: ShmRing | None,
    prefetch: int,
    h2d: str = "auto",
) -> Delivery:
    """The delivery path for a session: CPU for ``"cpu"``, else CUDA.

    ``zero_copy`` applies to the CPU path only; on CUDA the batch is copied to the device
    either way (and, with a registered ring, straight from the slot).
    """
    if device == "cpu":
        bell = ring.doorbell if ring is not None else None
        return CpuDelivery(
            zero_copy=zero_copy,
            prefetch=prefetch,
            slots=ring.layout.slots if ring is not None else 0,
            release=bell.release if bell is not None else None,
        )
    return CudaDelivery(device, ring=ring, prefetch=prefetch, h2d=h2d)
