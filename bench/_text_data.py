"""The text bench's data: generated documents (words of a Zipf-distributed synthetic
vocabulary, lognormal lengths), written as JSONL and Parquet, and a byte-level BPE tokenizer
trained on them in the run (nothing downloaded)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

__all__ = ["generate_documents", "train_tokenizer", "write_jsonl", "write_parquet"]

_LETTERS = np.array(list("abcdefghijklmnopqrstuvwxyz"))


def generate_documents(n: int, seed: int, *, median_words: float = 250.0) -> list[str]:
    """``n`` documents: lognormal word counts (median ``median_words``, a long tail), words
    drawn Zipf-wise from 50,000 synthetic ones, with punctuation and paragraph breaks."""
    rng = np.random.default_rng(seed)
    lengths = rng.integers(2, 12, 50_000)
    words = np.array(["".join(rng.choice(_LETTERS, k).tolist()) for k in lengths.tolist()])
    counts = np.clip(rng.lognormal(np.log(median_words), 1.0, n).astype(np.int64), 1, 40_000)
    draws = np.minimum(rng.zipf(1.2, int(counts.sum())) - 1, words.size - 1)
    marks = rng.choice(np.array([" ", " ", " ", " ", " ", ", ", ". ", ".\n\n"]), draws.size)
    tokens = np.char.add(words[draws], marks)
    ends = np.cumsum(counts)
    return ["".join(tokens[e - c : e].tolist()).strip() for e, c in zip(ends, counts, strict=True)]


def write_jsonl(path: Path, documents: list[str]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", encoding="utf-8") as out:
        for i, text in enumerate(documents):
            out.write(json.dumps({"id": i, "text": text}, ensure_ascii=False) + "\n")


def write_parquet(path: Path, documents: list[str]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    table = pa.table({"id": list(range(len(documents))), "text": documents})
    pq.write_table(table, path, row_group_size=1024)


def train_tokenizer(path: Path, documents: list[str], vocab_size: int) -> None:
    """A byte-level BPE tokenizer of ``vocab_size`` trained on ``documents`` (at most
    20,000 of them), saved at ``path`` with a tokenizer_config.json naming BOS and EOS."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["<pad>", "<s>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(documents[:20_000], trainer=trainer)
    path.parent.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(path))
    config = {"bos_token": "<s>", "eos_token": "</s>"}
    (path.parent / "tokenizer_config.json").write_text(json.dumps(config))
