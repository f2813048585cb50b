"""Test support: a BPE tokenizer trained in the test on generated text (nothing downloaded),
documents of long-tailed lengths with the characters JSON escapes, and chat transcripts."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np

__all__ = [
    "CHAT_TEMPLATE",
    "SPECIAL",
    "chats",
    "documents",
    "train_tokenizer",
    "write_jsonl",
]

SPECIAL = ["<pad>", "<s>", "</s>", "<|user|>", "<|assistant|>", "<|system|>", "<|end|>"]
CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m.role }}|>\n{{ m.content }}<|end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)
_WORDS = [
    *[
        "the",
        "data",
        "loader",
        "packs",
        "tokens",
        "into",
        "rows",
        "of",
        "sequence",
        "length",
        "while",
        "workers",
        "decode",
    ],
    *[
        "text",
        "from",
        "jsonl",
        "and",
        "parquet",
        "files",
        "on",
        "local",
        "disk",
        "or",
        "object",
        "stores",
    ],
    *["café", "naïve", "東京", "😀", 'quote"', "back\\slash", "tab\t", "newline\n"],
]


def documents(n: int, seed: int, *, mean_words: float = 40.0) -> list[str]:
    """``n`` non-empty documents of long-tailed lengths (a few far past a short row)."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        words = max(1, int(rng.lognormal(np.log(mean_words), 0.9)))
        out.append(" ".join(rng.choice(_WORDS, words).tolist()))
    return out


def chats(n: int, seed: int) -> list[list[dict[str, str]]]:
    """``n`` conversations: an optional system message, then user/assistant turns."""
    rng = np.random.default_rng(seed)
    texts = documents(4 * n, seed + 1, mean_words=8.0)
    out = []
    for i in range(n):
        messages = []
        if rng.random() < 0.3:
            messages.append({"role": "system", "content": "be brief"})
        for turn in range(int(rng.integers(1, 4))):
            messages.append({"role": "user", "content": texts[(4 * i + 2 * turn) % len(texts)]})
            reply = texts[(4 * i + 2 * turn + 1) % len(texts)]
            messages.append({"role": "assistant", "content": reply})
        out.append(messages)
    return out


def train_tokenizer(path: Path, *, vocab_size: int = 400, seed: int = 0) -> Any:
    """A byte-level BPE tokenizer trained on generated text, saved at ``path`` (a
    tokenizer.json) with a tokenizer_config.json beside it naming BOS/EOS and the chat
    template; returns the tokenizer."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(documents(300, seed), trainer=trainer)
    path.parent.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(path))
    config = {"bos_token": "<s>", "eos_token": "</s>", "chat_template": CHAT_TEMPLATE}
    (path.parent / "tokenizer_config.json").write_text(json.dumps(config))
    return tokenizer


def write_jsonl(path: Path, rows: list[dict[str, Any]]) -> None:
    """One JSON object a line (non-ASCII as is, as most JSONL writers do)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows), "utf-8")
