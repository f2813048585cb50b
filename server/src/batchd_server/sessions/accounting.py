"""A mixed session's per-source counts of each delivered batch, for ``batchd_mix_*_total``.

A mix's batch says which source each row came from (its ``source`` field, which the workers
write) and, for token pipelines, each row's tokens before padding (its ``length`` field).
When a batch is ready, the session reads those two columns from its slot and counts them
per source, beside the samples the weights in force at the batch's step expected
(``metrics.mixing.record_mix_batch``); the step is ``batchd._wire.schedule.global_step``'s, as the
client counts it.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Final

import numpy as np

from batchd._wire.schedule import global_step
from batchd_server.metrics.mixing import record_mix_batch
from batchd_server.planning.mixing import MixOptions
from batchd_server.planning.sampling import SamplerOptions
from batchd_server.sessions.ready import FieldView
from batchd_server.sessions.streams import Stream

__all__ = ["MixAccount"]

_SOURCE: Final = "source"
_TOKENS: Final = "length"


class MixAccount:
    """Counts a mixed session's batches per source into the metrics."""

    def __init__(self, mix: MixOptions, sampler: SamplerOptions, rows: int) -> None:
        """``rows``: the samples of one epoch (all ranks), as ``Session.num_rows``."""
        self._label = mix.label
        self._names = tuple(s.name for s in mix.sources)
        weights = [s.weight for s in mix.sources]
        total = sum(weights)
        self._fixed = tuple(w / total for w in weights)
        self._schedule = mix.schedule
        self._step = functools.partial(
            global_step,
            rows=rows,
            batch_size=sampler.batch_size,
            world_size=sampler.world_size,
            drop_last=sampler.drop_last,
        )

    def shares_at(self, step: int) -> Sequence[float]:
        """Each source's share at global ``step``."""
        if self._schedule is None:
            return self._fixed
        return self._schedule.shares_at(step)

    def record(
        self, slot: memoryview, views: Sequence[FieldView], rows: int, stream: Stream, batch: int
    ) -> None:
        """Count the batch of ``rows`` whose fields ``views`` place in ``slot``: ``stream``'s
        plan's ``batch``, at its global step (``global_step``)."""
        step = self._step(
            stream.epoch, batch, start=stream.start_sample, order_world_size=stream.order_world_size
        )
        count = len(self._names)
        by_name = {v.name: v for v in views}
        source_view = by_name.get(_SOURCE)
        if source_view is None or rows <= 0:
            return
        source = np.frombuffer(slot, np.dtype("<i8"), count=rows, offset=source_view.offset)
        valid = (source >= 0) & (source < count)
        index = source[valid]
        samples = np.bincount(index, minlength=count)[:count].tolist()
        tokens = None
        length_view = by_name.get(_TOKENS)
        if length_view is not None:
            lengths = np.frombuffer(
                slot, np.dtype(length_view.dtype), count=rows, offset=length_view.offset
            )
            weights = lengths[valid].astype(np.int64)
            summed = np.bincount(index, weights=weights, minlength=count)[:count]
            tokens = [int(x) for x in summed]
            del lengths
        # No view of the ring may outlive the call (the ring's buffer is released on close).
        del source, valid, index
        shares = self.shares_at(step)
        record_mix_batch(
            self._label, self._names, samples, tokens, [rows * share for share in shares]
        )
