"""The text bench's peers, each tokenizing the same documents with the same tokenizer (BOS
and EOS around each) and packing them into rows of ``seq_len``:

- Hugging Face ``datasets``: ``load_dataset`` of the JSONL or Parquet, ``.map(tokenize,
  batched=True, num_proc=W)``, then the packing recipe of its language-modelling examples
  (``group_texts``: concatenate and cut every ``seq_len``, the remainder dropped) in a second
  ``.map``, served by ``torch.utils.data.DataLoader(num_workers=W)``; timed from the load to
  the last batch (nothing cached: the map is the tokenization);
- Grain 0.2.18: documents read from the same file, ``.map(tokenize)``, long documents cut
  into ``seq_len`` pieces (``FlatMapTransform``; Grain's bin packers would truncate them),
  ``BestFitPackIterDataset`` (``num_packing_bins`` = the batch), ``.batch``,
  ``.mp_prefetch(W workers)``.

Each returns (real tokens, row slots, batches, wall s, training-process CPU s).
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import numpy as np
from _common import self_cpu_s

__all__ = ["grain_epoch", "hf_epoch"]


class _Tokenize:
    """Picklable: loads the tokenizer where it runs (a worker process)."""

    def __init__(self, path: str) -> None:
        self.path = path
        self._tokenizer: Any = None

    def tokenizer(self) -> Any:
        if self._tokenizer is None:
            from tokenizers import Tokenizer

            self._tokenizer = Tokenizer.from_file(self.path)
        return self._tokenizer

    def batch(self, texts: list[str]) -> list[list[int]]:
        tok = self.tokenizer()
        bos, eos = tok.token_to_id("<s>"), tok.token_to_id("</s>")
        return [[bos, *e.ids, eos] for e in tok.encode_batch(texts, add_special_tokens=False)]

    def __getstate__(self) -> dict[str, Any]:
        return {"path": self.path, "_tokenizer": None}


def hf_epoch(
    data: Path, kind: str, tokenizer: str, seq_len: int, batch: int, workers: int
) -> tuple[int, int, int, float, float]:
    import datasets
    import torch

    datasets.disable_caching()
    datasets.disable_progress_bars()
    tokenize = _Tokenize(tokenizer)

    def tok(rows: dict[str, list[Any]]) -> dict[str, list[Any]]:
        return {"input_ids": tokenize.batch(rows["text"])}

    def group(rows: dict[str, list[Any]]) -> dict[str, list[Any]]:
        flat = [t for ids in rows["input_ids"] for t in ids]
        whole = len(flat) // seq_len * seq_len
        return {"input_ids": [flat[i : i + seq_len] for i in range(0, whole, seq_len)]}

    cpu0, start = self_cpu_s(), time.perf_counter()
    loaded = datasets.load_dataset(
        "json" if kind == "jsonl" else "parquet", data_files=str(data), split="train"
    )
    tokens = loaded.map(tok, batched=True, num_proc=workers, remove_columns=loaded.column_names)
    packed = tokens.map(group, batched=True, batch_size=1000, num_proc=workers).with_format("torch")
    loader = torch.utils.data.DataLoader(packed, batch_size=batch, num_workers=workers)
    real = batches = 0
    for b in loader:
        real += int(b["input_ids"].numel())
        batches += 1
    return real, real, batches, time.perf_counter() - start, self_cpu_s() - cpu0


class _TokenizeOne:
    def __init__(self, tokenize: _Tokenize) -> None:
        self.tokenize = tokenize

    def __call__(self, text: str) -> list[int]:
        return self.tokenize.batch([text])[0]


def _split(seq_len: int) -> Any:
    """A Grain FlatMapTransform: a document's tokens as its ``seq_len`` pieces."""
    import grain.experimental as ge

    class Split(ge.FlatMapTransform):  # type: ignore[misc]
        max_fan_out = 1 << 10

        def flat_map(self, ids: list[int]) -> list[dict[str, np.ndarray]]:
            array = np.asarray(ids, np.int32)
            return [{"inputs": array[k : k + seq_len]} for k in range(0, array.size, seq_len)]

    return Split()


def grain_epoch(
    texts: list[str], tokenizer: str, seq_len: int, batch: int, workers: int
) -> tuple[int, int, int, float, float]:
    import grain
    import grain.experimental as ge

    cpu0, start = self_cpu_s(), time.perf_counter()
    docs = grain.MapDataset.source(texts).map(_TokenizeOne(_Tokenize(tokenizer)))
    # On the iterator: a MapDataset's flat map indexes every (document, fan-out) pair and
    # would tokenize each document max_fan_out times.
    pieces = ge.FlatMapIterDataset(docs.to_iter_dataset(), _split(seq_len))
    packed = ge.BestFitPackIterDataset(
        pieces, length_struct={"inputs": seq_len}, num_packing_bins=batch, seed=0
    ).batch(batch)
    if workers > 0:
        packed = packed.mp_prefetch(grain.MultiprocessingOptions(num_workers=workers))
    real = slots = batches = 0
    for b in packed:
        segments = b["inputs_segment_ids"]
        real += int(np.count_nonzero(segments))
        slots += segments.size
        batches += 1
    return real, slots, batches, time.perf_counter() - start, self_cpu_s() - cpu0
