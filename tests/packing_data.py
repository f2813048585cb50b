"""Token documents of long-tailed lengths for the packing tests."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
from sqlalchemy.engine import Engine

from batchd_server.catalog.ingest import ingest_manifest


def token_at(doc: int, position: int) -> int:
    """Token ``position`` of document ``doc`` (as ``doc_tokens`` writes it)."""
    return (doc * 131 + position) % 65521


def doc_tokens(doc: int, length: int) -> np.ndarray:
    """Document ``doc``'s tokens: a function of (document, position), so every served token
    says where it came from."""
    return ((doc * 131 + np.arange(length)) % 65521).astype("<u2")


def documents_dataset(engine: Engine, root: Path, *, name: str, n: int, seed: int) -> list[int]:
    """``n`` uint16 documents of lognormal lengths (1 to 3,000 tokens) in one shard, as byte
    ranges; every other one without a ``length`` (the server counts its byte range)."""
    root.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    lengths = np.minimum(rng.lognormal(5.0, 1.1, n).astype(int) + 1, 3000).tolist()
    rows, blobs, offset = [], [], 0
    for i, length in enumerate(lengths):
        data = doc_tokens(i, length).tobytes()
        row: dict[str, Any] = {
            "key": f"d{i:05d}",
            "path": "shard.bin",
            "byte_offset": offset,
            "byte_length": len(data),
            "split": "train",
            "label": i,
        }
        if i % 2 == 0:
            row["length"] = length
        rows.append(row)
        blobs.append(data)
        offset += len(data)
    (root / "shard.bin").write_bytes(b"".join(blobs))
    manifest = root.parent / f"{name}.jsonl"
    manifest.write_text("".join(json.dumps(r) + "\n" for r in rows))
    ingest_manifest(engine, dataset=name, root=root, manifest=manifest)
    return lengths
