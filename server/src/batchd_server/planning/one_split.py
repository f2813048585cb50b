"""A session on one split, planned as a mix of that one source.

Every session serves a tuple of sources (``mixing.Mixing``); one that asked for a split
rather than a ``Mix`` serves that split as its only source. Only what its client sees is
its own: the order is the sampler's (``sampling.plan_epoch``, with every sampling mode;
not a mix's round robin, which would change every such session's batches), the snapshot
token is the split's (``s1.<max_sample_id>.<row_count>``), and its batches have no
``source`` field.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from batchd_server.planning.mixing import MixSourceOptions
from batchd_server.planning.sampling import EpochPlan, EpochStart, SamplerOptions, plan_epoch

if TYPE_CHECKING:
    from batchd_server.catalog.types import SplitArrays

__all__ = ["OneSplit"]


@dataclass(frozen=True)
class OneSplit:
    """The one split of a session, as a ``Mixing`` of one source."""

    source: MixSourceOptions

    @property
    def sources(self) -> tuple[MixSourceOptions, ...]:
        return (self.source,)

    @property
    def labels_rows(self) -> bool:
        return False

    def counts(self, sizes: Sequence[int]) -> tuple[int, ...]:
        """The split's rows: one epoch serves each once (padding aside)."""
        return tuple(sizes)

    def plan(
        self, splits: Sequence[SplitArrays], options: SamplerOptions, at: EpochStart
    ) -> EpochPlan:
        """``sampling.plan_epoch`` of the split, given the column its mode draws by."""
        (split,) = splits
        return plan_epoch(
            len(split),
            options,
            at,
            weights=split.weights,
            labels=split.labels,
            lengths=split.lengths,
        )

    def pins(self, token: str | None) -> Sequence[tuple[str | None, str | None]]:
        """The split's snapshot token, at the version the session asks for."""
        return [(None, token)]

    def token(self, pins: Sequence[tuple[str, str]]) -> str:
        ((_, snapshot),) = pins
        return snapshot
