"""A mix's sources (``batchd_mix_*_total``): served samples and tokens per source beside the
samples its weights (and schedule) expected (:func:`record_mix_batch`).

They are labelled ``dataset`` (the mix's label) and ``source`` (a source's
``dataset:split``, ``@version`` when pinned), capped like ``dataset``
(:data:`MAX_SOURCE_LABELS`, then ``registry.OTHER_DATASET``)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Final

from prometheus_client import Counter

from batchd_server.metrics.registry import OTHER_DATASET, REGISTRY, LabelValues, dataset_label

__all__ = [
    "MAX_SOURCE_LABELS",
    "MIX_EXPECTED_SAMPLES",
    "MIX_SAMPLES",
    "MIX_TOKENS",
    "record_mix_batch",
]

MIX_SAMPLES = Counter(
    "batchd_mix_samples",
    "Samples of each source of a mix delivered to clients.",
    ["dataset", "source"],
    registry=REGISTRY,
)
MIX_TOKENS = Counter(
    "batchd_mix_tokens",
    "Tokens (before padding) of each source of a mix delivered to clients; token pipelines.",
    ["dataset", "source"],
    registry=REGISTRY,
)
MIX_EXPECTED_SAMPLES = Counter(
    "batchd_mix_expected_samples",
    "Samples of each source of a mix that its weights in force expected of the batches "
    "delivered (rows times the source's share at each batch's step).",
    ["dataset", "source"],
    registry=REGISTRY,
)
MAX_SOURCE_LABELS: Final = 256
"""Distinct values of the ``source`` label a process reports (3 plain counters each)."""
_SOURCE_LABELS: Final = LabelValues(MAX_SOURCE_LABELS, OTHER_DATASET)


def record_mix_batch(
    dataset: str,
    sources: Sequence[str],
    samples: Sequence[int],
    tokens: Sequence[int] | None,
    expected: Sequence[float],
) -> None:
    """Count one delivered batch of the mix ``dataset``: each source's ``samples`` (and
    ``tokens``, for token pipelines) and the samples its share ``expected``."""
    dataset = dataset_label(dataset)
    for i, source in enumerate(sources):
        label = _SOURCE_LABELS(source)
        MIX_SAMPLES.labels(dataset=dataset, source=label).inc(samples[i])
        MIX_EXPECTED_SAMPLES.labels(dataset=dataset, source=label).inc(max(0.0, expected[i]))
        if tokens is not None:
            MIX_TOKENS.labels(dataset=dataset, source=label).inc(tokens[i])
