"""What a Loader says about itself: its session, its position and its loop's waiting.

The read-only half of :class:`batchd.Loader`, kept apart so the Loader's own module is its
iteration, resume and lifetime.
"""

from __future__ import annotations

from typing import Any

from batchd._connection import Connection, SessionHandle
from batchd._options import LoaderOptions
from batchd._proto.batchd.v1 import loader_pb2
from batchd._state import Cursor
from batchd._stats import LoaderStats, LoopClock
from batchd._wire.lifetime import Closeable

__all__ = ["LoaderInfo"]


class LoaderInfo(Closeable):
    """Properties of a Loader; the Loader sets the attributes and the two methods."""

    _conn: Connection
    _options: LoaderOptions
    _clock: LoopClock
    _device: Any

    def _session(self) -> SessionHandle:
        raise NotImplementedError

    def _position(self) -> Cursor:
        raise NotImplementedError

    # -- what the loop waited for -----------------------------------------------------------

    def stats(self) -> LoaderStats:
        """The training loop's view of its data so far: batches and samples handed out, how
        long ``next()`` waited and the steps in between took (totals and percentiles), the
        stall ratio ``wait / (wait + step)``, and the time to the first batch. The server
        exports the same per-batch numbers as ``batchd_client_wait_seconds``,
        ``batchd_client_step_seconds`` and ``batchd_data_stall_ratio``."""
        return self._clock.stats()

    @property
    def wait_s(self) -> float:
        """Seconds the training loop spent blocked in ``next()``, in total."""
        return self._clock.wait_s

    @property
    def batches_served(self) -> int:
        """Batches handed to the training loop, in total."""
        return self._clock.batches

    # -- what the session is ---------------------------------------------------------------

    @property
    def target(self) -> str:
        return self._conn.target

    @property
    def epoch(self) -> int:
        """The epoch the next iteration serves."""
        return self._position().epoch

    @property
    def snapshot(self) -> str:
        """The catalog snapshot served; pass it as ``snapshot=`` to pin other ranks."""
        return self._session().reply.snapshot

    @property
    def version(self) -> str:
        """The dataset version served ("" for a mix: see :attr:`mix_sources`)."""
        return self._session().reply.version

    @property
    def sources(self) -> tuple[str, ...]:
        """A mix's source names in order, as the batches' ``source`` field numbers them
        (``loader.sources[batch["source"][i]]``); ``()`` without a mix."""
        mix = self._options.sources
        return () if mix is None else mix.names

    @property
    def mix_sources(self) -> list[dict[str, Any]]:
        """A mix's sources as the server resolved them, in order: ``dataset``, ``version``,
        ``split``, ``weight``, ``rows`` (in the snapshot served) and ``epoch_samples`` (in one
        epoch, all ranks together); ``[]`` without a mix."""
        return [
            {
                "dataset": s.dataset,
                "version": s.version,
                "split": s.split,
                "weight": s.weight,
                "rows": int(s.rows),
                "epoch_samples": int(s.epoch_samples),
            }
            for s in self._session().reply.sources
        ]

    @property
    def num_samples(self) -> int:
        """Samples per epoch on this rank, padding included."""
        return int(self._session().reply.num_samples)

    @property
    def transport(self) -> str:
        """``"shm"`` or ``"inline"``: what this session uses."""
        return "shm" if self._session().transport == loader_pb2.TRANSPORT_SHM else "inline"

    @property
    def device(self) -> Any:
        """``"cpu"`` or the ``torch.device`` batches are delivered to."""
        return self._device

    @property
    def fields(self) -> dict[str, tuple[str, tuple[int, ...]]]:
        """Field name → (dtype, one sample's largest shape), in slot order."""
        reply = self._session().reply
        return {f.name: (f.dtype, tuple(f.shape)) for f in reply.fields}
