"""Text in, tokens out: batchd tokenizing raw text in its decode workers and packing it,
beside Hugging Face ``datasets`` (``.map(tokenize)`` + packing + ``DataLoader``) and Grain's
tokenize + pack pipeline, with the same tokenizer and the same number of workers.

Generated documents (a Zipf-distributed synthetic vocabulary, lognormal lengths with a long
tail; ``_text_data.py``) are written as JSONL and as Parquet, and a byte-level BPE tokenizer
of ``--vocab`` tokens (32,000 by default) is trained on them in the run: nothing is
downloaded. Then:

- the tokenizer's own single-core rate on the same texts (``encode_batch`` with its thread
  pool off, in this process): the limit of one worker;
- ``batchd-server ingest jsonl|parquet --text text --tokenizer``: documents/s of the ingest
  that records each document's token count;
- batchd: ``Loader(pipeline=batchd.Text(tokenizer), pack=batchd.Pack(seq_len))`` over each
  format, ``batchd-server --workers W``: real tokens/s of an epoch, padding, the training
  process's CPU per batch, the server's; and per worker, tokens per second of server CPU
  beside the tokenizer's single-core rate;
- the peers (``_text_peers.py``), timed from reading the file to the last batch.

Timings are of one run; on a shared machine they are noisy. Run it on a quiet machine:

    .venv/bin/python bench/text.py              # 20,000 documents, vocab 32,000, seq_len 2048
    .venv/bin/python bench/text.py --quick      # 600 documents, vocab 2,000: a smoke run
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import numpy as np
import torch

import batchd
from batchd_server.catalog import migrate
from batchd_server.catalog.db import make_engine
from batchd_server.catalog.ingest import ingest_jsonl, ingest_parquet

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import batchd_server, cores, machine_lines, markdown_table, self_cpu_s
from _text_data import generate_documents, train_tokenizer, write_jsonl, write_parquet
from _text_peers import grain_epoch, hf_epoch
from plots import recorded

BATCH = 8
FORMATS = ("jsonl", "parquet")


def single_core_rate(tokenizer: str, texts: list[str]) -> float:
    """Tokens per second of the tokenizer alone on one core (its thread pool off)."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(tokenizer)
    start, tokens = time.process_time(), 0
    for i in range(0, len(texts), 256):
        tokens += sum(len(e.ids) for e in tok.encode_batch(texts[i : i + 256]))
    return tokens / (time.process_time() - start)


def ingest(url: str, data: Path, tokenizer: str, workers: int) -> list[list[str]]:
    engine = make_engine(url)
    migrate.upgrade(engine)
    rows = []
    for kind in FORMATS:
        common: dict[str, Any] = {"root": data, "split": "train", "text": "text"}
        common.update(tokenizer=tokenizer, workers=workers)
        start = time.perf_counter()
        if kind == "jsonl":
            report = ingest_jsonl(engine, dataset=kind, files=["docs.jsonl"], **common)
        else:
            report = ingest_parquet(engine, dataset=kind, files=["docs.parquet"], **common)
        took = time.perf_counter() - start
        rows.append(
            [kind, f"{report.inserted:,}", f"{took:.1f} s", f"{report.inserted / took:,.0f}"]
        )
    engine.dispose()
    return rows


def batchd_epoch(
    target: str, kind: str, tokenizer: str, seq_len: int, server_cpu: Any
) -> tuple[int, int, int, float, float, float]:
    loader = batchd.Loader(
        target,
        dataset=kind,
        batch_size=BATCH,
        pipeline=batchd.Text(tokenizer=tokenizer),
        pack=batchd.Pack(seq_len=seq_len),
        device="cpu",
        seed=0,
    )
    with loader:
        for _ in loader:  # a whole epoch first: every worker has loaded the tokenizer
            pass
        loader.set_epoch(1)
        cpu0, server0, start = self_cpu_s(), server_cpu(), time.perf_counter()
        real = slots = batches = 0
        for batch in loader:
            segments = batch["segment_ids"].numpy()
            real += int(np.count_nonzero(segments))
            slots += segments.size
            batches += 1
        wall = time.perf_counter() - start
        cpu, server = self_cpu_s() - cpu0, server_cpu() - server0
    return real, slots, batches, wall, cpu, server


def _row(name: str, result: tuple[Any, ...], server: float | None = None) -> list[str]:
    real, slots, batches, wall, cpu = result[:5]
    return [
        name,
        f"{real / wall / 1e6:.2f} M",
        f"{1 - real / slots:.3%}",
        f"{cpu / batches * 1e3:.2f} ms",
        "-" if server is None else f"{server / batches * 1e3:.2f} ms",
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add = parser.add_argument
    add("--quick", action="store_true", help="600 documents, vocab 2,000: a smoke run")
    add("--docs", type=int, default=20_000, help="documents")
    add("--vocab", type=int, default=32_000, help="the BPE tokenizer's vocabulary")
    add("--seq-len", type=int, default=2048)
    add("--workers", type=int, default=cores(), help="batchd-server --workers, and the peers'")
    add("--seed", type=int, default=0)
    args = parser.parse_args()
    torch.set_num_threads(1)
    if args.quick:
        args.docs, args.vocab = 600, 2_000
    import datasets
    import grain
    import tokenizers

    print("## Text in, tokens out: batchd beside HF datasets and Grain\n")
    print(f"command: {Path(sys.executable).name} {' '.join(sys.argv)}")
    for line in machine_lines():
        print(line)
    print(
        f"peers: datasets {datasets.__version__}, grain {getattr(grain, '__version__', '0.2.18')}"
        f", tokenizers {tokenizers.__version__}"
    )
    with tempfile.TemporaryDirectory(prefix="batchd-text-") as tmp:
        root = Path(tmp)
        texts = generate_documents(args.docs, args.seed)
        data = root / "data"
        write_jsonl(data / "docs.jsonl", texts)
        write_parquet(data / "docs.parquet", texts)
        tokenizer = str(root / "tok" / "tokenizer.json")
        start = time.perf_counter()
        train_tokenizer(Path(tokenizer), texts, args.vocab)
        trained = time.perf_counter() - start
        limit = single_core_rate(tokenizer, texts)
        words = sum(t.count(" ") + 1 for t in texts)
        print(
            f"settings: {args.docs:,} documents ({words:,} words, "
            f"{(data / 'docs.jsonl').stat().st_size / 2**20:.1f} MiB of JSONL), a byte-level "
            f"BPE tokenizer of {args.vocab:,} tokens trained in {trained:.1f} s; "
            f"Pack(seq_len={args.seq_len}) best_fit, batch {BATCH} rows; {args.workers} "
            "workers for every loader (batchd-server --workers, datasets num_proc and "
            "DataLoader num_workers, Grain mp_prefetch); one epoch each, batchd's after a "
            "warm-up epoch (its workers load the tokenizer once, at their first batch); the "
            "peers' from reading the files, their tokenization being the epoch's work. "
            "Timings: one run"
        )
        print(f"tokenizer alone, one core: {limit / 1e6:.2f} M tokens/s\n")
        url = f"sqlite:///{root / 'catalog.db'}"
        head = ["format", "documents", "ingest time", "documents/s"]
        print("### Ingest with --tokenizer (token counts for Pack)\n")
        print(markdown_table(head, ingest(url, data, tokenizer, args.workers)))
        rows, per_worker = [], []
        with batchd_server(url, root, workers=args.workers, lease_timeout_s=30) as server:
            for kind in FORMATS:
                result = batchd_epoch(server.target, kind, tokenizer, args.seq_len, server.cpu_s)
                rows.append(_row(f"batchd Text + Pack ({kind})", result, result[5]))
                per_cpu = result[0] / result[5] if result[5] else 0.0
                per_worker.append(
                    [
                        f"batchd ({kind})",
                        f"{result[0] / result[3] / args.workers / 1e6:.2f} M",
                        f"{per_cpu / 1e6:.2f} M",
                        f"{limit / 1e6:.2f} M",
                        f"{per_cpu / limit:.2f}x",
                    ]
                )
        for kind in FORMATS:
            path = data / f"docs.{kind}"
            result = hf_epoch(path, kind, tokenizer, args.seq_len, BATCH, args.workers)
            rows.append(_row(f"HF datasets map + group_texts + DataLoader ({kind})", result))
        result = grain_epoch(texts, tokenizer, args.seq_len, BATCH, args.workers)
        rows.append(_row("Grain tokenize + BestFitPack + mp_prefetch", result))
        print(f"\n### One epoch, seq_len {args.seq_len}\n")
        print(
            markdown_table(
                ["loader", "real tokens/s", "padding", "train CPU/batch", "server CPU/batch"],
                rows,
            )
        )
        print("\n### batchd per worker against the tokenizer alone\n")
        head = ["loader", "tokens/s per worker", "tokens per server CPU-s", "tokenizer, 1 core"]
        print(markdown_table([*head, "ratio (CPU)"], per_worker))


if __name__ == "__main__":
    with recorded("text"):
        main()
