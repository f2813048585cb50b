"""The server's one metrics registry, the histograms' buckets and the caps on label values.

The metrics live in a registry of their own (not prometheus_client's global one) so that
several servers in one process, as in the tests, do not collide; ``endpoint.serve`` exposes
it.

Labels are bounded by what an operator configures: ``dataset`` (a catalog name, or a mix's
names sorted and joined by ``+``), ``stage``, ``kind`` (of sample error), ``transport``.
Never a session, rank or sample id: those would make a new series per job and grow
Prometheus without bound. Clients choose which datasets they mix, so ``dataset`` is capped
besides (:func:`dataset_label`): past :data:`MAX_DATASET_LABELS` distinct values, a new one
is reported as :data:`OTHER_DATASET`.
"""

from __future__ import annotations

import threading
from typing import Final

from prometheus_client import CollectorRegistry

__all__ = [
    "CLIENT_BUCKETS",
    "MAX_DATASET_LABELS",
    "OTHER_DATASET",
    "REGISTRY",
    "SLOW_BUCKETS",
    "STAGE_BUCKETS",
    "LabelValues",
    "dataset_label",
]

REGISTRY = CollectorRegistry(auto_describe=True)

# A batch's stages take from tens of microseconds (a few raw records) to seconds (64 large
# JPEGs on a busy core); catalog loads and first batches take up to minutes (millions of rows).
STAGE_BUCKETS: Final = (
    0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05,
    0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0,
)  # fmt: skip
SLOW_BUCKETS: Final = (
    0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0,
)  # fmt: skip
CLIENT_BUCKETS: Final = (
    0.0001, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05,
    0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0,
)  # fmt: skip

MAX_DATASET_LABELS: Final = 128
"""Distinct values of the ``dataset`` label a process reports; each costs about 160 series
(the histograms' buckets), so the cap keeps a server under about 20,000 of them."""
OTHER_DATASET: Final = "other"
"""The ``dataset`` label of every dataset or mix served after :data:`MAX_DATASET_LABELS`."""


class LabelValues:
    """The values one label takes: the first ``limit`` distinct ones as they come, every
    later one as ``other``. A value once admitted stays (its series exist). Thread-safe."""

    def __init__(self, limit: int, other: str) -> None:
        if limit < 1:
            raise ValueError(f"limit={limit} must be >= 1")
        self.limit = limit
        self.other = other
        self._admitted: set[str] = set()
        self._lock = threading.Lock()

    def __call__(self, value: str) -> str:
        """``value`` as the label reports it."""
        with self._lock:
            if value in self._admitted:
                return value
            if len(self._admitted) < self.limit:
                self._admitted.add(value)
                return value
        return self.other


_DATASET_LABELS: Final = LabelValues(MAX_DATASET_LABELS, OTHER_DATASET)


def dataset_label(dataset: str) -> str:
    """``dataset`` (a catalog name or a mix's label) as the ``dataset`` label reports it:
    itself, or :data:`OTHER_DATASET` once :data:`MAX_DATASET_LABELS` others were seen."""
    return _DATASET_LABELS(dataset)
