"""A text session's worker keeps the encodings of documents it used only part of, least
recently used first out past its budget of tokens, and hands each back once."""

from __future__ import annotations

import numpy as np

from batchd_server.workers.packed import KeptDocuments


def _doc(n: int) -> tuple[np.ndarray, None]:
    return np.arange(n, dtype=np.int32), None


def test_kept_documents_stay_within_their_budget_oldest_out_first() -> None:
    kept = KeptDocuments(max_tokens=10)
    kept.keep(1, _doc(4))
    kept.keep(2, _doc(4))
    kept.keep(3, _doc(4))  # 12 > 10: document 1 goes
    assert kept.tokens == 8
    assert kept.pop(1) is None
    assert kept.pop(2)[0].size == 4 and kept.pop(2) is None
    kept.keep(4, _doc(11))  # larger than the whole budget: not kept
    assert kept.pop(4) is None and kept.tokens == 4
