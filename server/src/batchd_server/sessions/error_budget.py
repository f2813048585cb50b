"""How many bad samples a session lets through before its stream fails.

A worker reports every sample it could not read or decode (``SampleFailure``); whatever the
policy, each one is logged, counted in ``batchd_sample_errors_total`` and recorded in the
catalog's ``sample_errors`` table. Under ``on_error="raise"`` the first one fails the stream;
under ``"skip"`` and ``"replace"`` an epoch may have up to ``max_error_fraction`` of its
samples fail, and the stream fails past that, since so many bad samples mean a broken
dataset or mount rather than a few damaged files.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass, field

from batchd_server.errors import DataLoss
from batchd_server.logs import session_log_id
from batchd_server.metrics.delivery import record_sample_error
from batchd_server.workers.task import BatchResult

__all__ = ["ErrorBudget"]

logger = logging.getLogger(__name__)


@dataclass(kw_only=True, eq=False)
class ErrorBudget:
    """One session's sample failures per epoch, against its ``max_error_fraction``.

    Thread-safe: the batches of a stream are accounted from the stream's thread, and a new
    stream of the same epoch (a reconnect) adds to the same count.

    Args:
        session_id: For the log.
        dataset: The metrics' label (a mix's label for a mix).
        max_error_fraction: Of an epoch's samples, those that may fail.
        epoch_samples: Samples of one epoch on this rank (padding included).
        record_errors: Writes (sample id, kind, message) rows to the catalog.
    """

    session_id: str
    dataset: str
    max_error_fraction: float
    epoch_samples: int
    record_errors: Callable[[list[tuple[int, str, str]]], object]
    _lock: threading.Lock = field(default_factory=threading.Lock, init=False, repr=False)
    _errors_by_epoch: dict[int, int] = field(default_factory=dict, init=False)

    def account(self, epoch: int, result: BatchResult, stride: int = 1) -> None:
        """Log, count and record ``result``'s failures, then check the budget.

        Args:
            stride: The stream serves every ``stride``-th batch (a client striping over
                replicas), and so sees that share of the epoch's errors.

        Raises:
            DataLoss: a sample failed under on_error="raise", or the epoch's failures
                passed ``max_error_fraction``.
        """
        for failure in result.failures:
            record_sample_error(self.dataset, failure.kind)
            logger.warning(
                "session %s: sample %d (%s) failed: %s: %s%s",
                session_log_id(self.session_id),
                failure.sample_id,
                failure.path,
                failure.kind,
                failure.message,
                "" if failure.replaced_by is None else f"; replaced by {failure.replaced_by}",
            )
        try:
            self.record_errors([(x.sample_id, x.kind, x.message) for x in result.failures])
        except Exception:  # the catalog being down must not stop training
            logger.exception("could not record sample errors in the catalog")
        first = result.failures[0]
        if result.fatal:
            raise DataLoss(
                f"sample {first.sample_id} ({first.path}) failed: {first.kind}: "
                f"{first.message} (on_error='raise'; use 'skip' or 'replace' to go on past "
                "bad samples)"
            )
        with self._lock:
            count = self._errors_by_epoch.get(epoch, 0) + len(result.failures)
            self._errors_by_epoch[epoch] = count
        limit = self.max_error_fraction * self.epoch_samples / stride
        if count > limit:
            raise DataLoss(
                f"{count} samples of epoch {epoch} failed, more than max_error_fraction="
                f"{self.max_error_fraction:g} of its {self.epoch_samples}; latest: "
                f"sample {first.sample_id} ({first.path}): {first.kind}: {first.message}. "
                "Fix or un-verify the bad samples (the catalog's sample_errors table lists "
                "them), or raise max_error_fraction"
            )
