"""Per-source accounting of a mix: what each source served, against what its weights expect.

Every batch of a mix says which source each row came from (its ``source`` field), and a
``Tokens`` batch how long each row is (its ``length`` field, the tokens before padding). As
batches reach the training loop, the Loader counts each source's samples and tokens, and
adds to each source's *expected* samples the batch's rows times the source's share in force
at the batch's global step (the mix's weights, or its schedule's: ``batchd._wire.schedule``).
:meth:`batchd.Loader.stats` reports both (:class:`SourceStats`), so a job can see that its
mix is what it asked for; the server exports the same counts as
``batchd_mix_samples_total``, ``batchd_mix_tokens_total`` and
``batchd_mix_expected_samples_total``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Final

import numpy as np
import numpy.typing as npt

__all__ = ["SOURCE_FIELD", "TOKENS_FIELD", "SourceAccount", "SourceStats"]

SOURCE_FIELD: Final = "source"
TOKENS_FIELD: Final = "length"
"""The field whose sum over a batch's rows is its tokens (``batchd.Tokens``)."""


@dataclass(frozen=True)
class SourceStats:
    """One source of a mix in :attr:`batchd.LoaderStats.sources`: what the training loop got
    of it so far."""

    name: str
    """As the Mix names it (:attr:`batchd.Loader.sources`)."""
    samples: int
    """Samples of this source handed to the training loop."""
    tokens: int | None
    """Their tokens before padding (the ``length`` field's sum); None without one."""
    expected_samples: float
    """Each batch's rows times this source's share at the batch's step, summed."""
    share: float | None
    """``samples`` over all sources' samples; None before the first batch."""
    expected_share: float | None
    """``expected_samples`` over all rows served; None before the first batch."""


class SourceAccount:
    """Counts of each source of a mix; not thread-safe (the iterating thread owns it).

    Args:
        names: The sources' names, in the order the ``source`` field numbers them.
        shares_at: Each source's share (summing to 1) at a global step.
    """

    def __init__(self, names: Sequence[str], shares_at: Callable[[int], Sequence[float]]) -> None:
        self._names = tuple(names)
        self._shares_at = shares_at
        count = len(self._names)
        self._samples = np.zeros(count, np.int64)
        self._tokens = np.zeros(count, np.int64)
        self._has_tokens = False
        self._expected = np.zeros(count, np.float64)
        self._rows = 0
        self._last: tuple[int, npt.NDArray[np.float64]] | None = None

    def record(self, arrays: Mapping[str, npt.NDArray[Any]], step: int) -> None:
        """Count one batch (its fields, as they arrived) served at global ``step``."""
        source = arrays.get(SOURCE_FIELD)
        if source is None or not self._names:
            return
        count = len(self._names)
        rows = int(source.shape[0])
        # A corrupt index must not raise in the training loop; it is not counted.
        valid = (source >= 0) & (source < count)
        index = source[valid]
        self._samples += np.bincount(index, minlength=count)[:count]
        lengths = arrays.get(TOKENS_FIELD)
        if lengths is not None and lengths.shape[:1] == source.shape[:1]:
            self._has_tokens = True
            weights = lengths[valid].astype(np.int64)
            self._tokens += np.bincount(index, weights=weights, minlength=count)[:count].astype(
                np.int64
            )
        if self._last is None or self._last[0] != step:
            self._last = (step, np.asarray(self._shares_at(step), np.float64))
        self._expected += rows * self._last[1]
        self._rows += rows

    def stats(self) -> tuple[SourceStats, ...]:
        """Each source's counts so far; ``()`` when the Loader serves no mix."""
        served = int(self._samples.sum())
        return tuple(
            SourceStats(
                name=name,
                samples=int(self._samples[i]),
                tokens=int(self._tokens[i]) if self._has_tokens else None,
                expected_samples=float(self._expected[i]),
                share=int(self._samples[i]) / served if served else None,
                expected_share=float(self._expected[i]) / self._rows if self._rows else None,
            )
            for i, name in enumerate(self._names)
        )
