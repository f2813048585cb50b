"""What a session is asked for, and the ring it needs: slots and where each field goes."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Final

import numpy as np

from batchd._wire.ring import pack, slot_size
from batchd._wire.share import share_key_problem
from batchd._wire.specs import ON_ERROR_CHOICES
from batchd_server.errors import InvalidArgument
from batchd_server.limits import MAX_PREFETCH
from batchd_server.pipelines.base import FieldSpec
from batchd_server.planning.mixing import Mixing, MixOptions, MixSourceOptions
from batchd_server.planning.one_split import OneSplit
from batchd_server.planning.packing import PackOptions
from batchd_server.planning.sampling import SamplerOptions
from batchd_server.workers.task import ROW_FIELDS, SOURCE_FIELD, SlotField

__all__ = ["SessionOptions", "ring_slots", "slot_layout"]

_LOOP_SLOTS: Final = 2
"""Slots for the batches in the training loop's hands (see ``ring_slots``)."""
_EXTRA_SLOTS_MAX: Final = 12
_EXTRA_SLOTS_BYTES: Final = 8 << 20


@dataclass(frozen=True, kw_only=True)
class SessionOptions:
    """An OpenSession request as validated domain options.

    Raises:
        InvalidArgument: (when built) a value out of range, named with the range.
    """

    dataset: str
    version: str | None
    split: str
    sampler: SamplerOptions
    pipeline_kind: str
    pipeline_options: dict[str, Any]
    prefetch: int = 4
    snapshot: str | None = None
    on_error: str = "skip"
    max_error_fraction: float = 0.01
    mix: MixOptions | None = None
    """A weighted mix of splits; ``dataset`` is then the mix's label and ``split`` empty,
    and ``snapshot`` a mix's token. None: the session serves ``dataset``'s ``split``."""
    decode_cache: bool = True
    """Use the server's decode cache (if it has one); False: decode every sample afresh."""
    pack: PackOptions | None = None
    """Sequence packing (``planning/packing.py``): the session serves rows of packed
    documents. None: one sample a row."""
    share: str = ""
    """The share group's key (``sessions/share.py``); "" shares nothing."""

    def __post_init__(self) -> None:
        if not self.dataset:
            raise InvalidArgument("OpenSession needs a dataset name; got an empty one")
        if not 1 <= self.prefetch <= MAX_PREFETCH:
            raise InvalidArgument(f"prefetch={self.prefetch} must be between 1 and {MAX_PREFETCH}")
        if self.on_error not in ON_ERROR_CHOICES:
            raise InvalidArgument(
                f"on_error={self.on_error!r} must be one of {', '.join(ON_ERROR_CHOICES)}"
            )
        problem = share_key_problem(self.share)
        if problem is not None:
            raise InvalidArgument(problem)
        if not 0.0 <= self.max_error_fraction <= 1.0:
            raise InvalidArgument(
                f"max_error_fraction={self.max_error_fraction} must be between 0 and 1"
            )

    @property
    def mixing(self) -> Mixing:
        """The session's sources and how they make its epochs: the mix asked for, or the
        split asked for as a mix of one (weight 1, decoded with the session's pipeline)."""
        if self.mix is not None:
            return self.mix
        split = MixSourceOptions(
            dataset=self.dataset, version=self.version, split=self.split, weight=1.0
        )
        return OneSplit(split)


def ring_slots(prefetch: int, slot_bytes: int) -> int:
    """Slots for a ring: ``prefetch``, 2 for the training loop, and up to 12 more in 8 MiB.

    ``prefetch`` batches are ahead of the loop; the loop itself holds one or two more (a
    client's default CPU tensors are views of their slot, and the batch just used is still
    referenced while the next is handed over), which must not come out of the prefetch.
    A batch's round trip (ack, dispatch, decode, notice) also caps a stream at roughly
    ``slots`` batches per round trip, whatever the batch costs to decode; small batches
    (records, tokens) hit that cap long before the CPUs are busy, and a deeper ring of them
    costs a few MiB.
    """
    return prefetch + _LOOP_SLOTS + min(_EXTRA_SLOTS_MAX, _EXTRA_SLOTS_BYTES // slot_bytes)


def slot_layout(
    fields: list[FieldSpec], batch_size: int, *, labels_rows: bool = False
) -> tuple[tuple[SlotField, ...], int]:
    """Place every field (plus ``sample_id`` and ``label``, and ``source`` where the batches
    say each row's source: ``Mixing.labels_rows``) in a slot, as ``batchd._wire.ring`` lays
    slots out; return the fields' places and the slot's size."""
    ours = [*ROW_FIELDS, *((SOURCE_FIELD,) if labels_rows else ())]
    every = [*fields, *(FieldSpec(name, np.dtype("<i8"), ()) for name in ours)]
    names = [f.name for f in every]
    if len(set(names)) != len(names):
        raise InvalidArgument(
            f"the pipeline's fields {names[: len(fields)]} clash with {' or '.join(ours)}"
        )
    capacities = [batch_size * f.sample_bytes() for f in every]
    offsets, fields_bytes = pack(capacities)
    placed = tuple(
        SlotField(f.name, f.dtype.newbyteorder("<").str, f.shape, offset, capacity)
        for f, offset, capacity in zip(every, offsets, capacities, strict=True)
    )
    return placed, slot_size(fields_bytes)
