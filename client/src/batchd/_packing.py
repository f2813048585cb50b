"""``batchd.Pack``: documents packed into rows of ``seq_len`` tokens, planned by the server.

``Loader(..., pipeline=batchd.Tokens(max_len=8192), pack=batchd.Pack(seq_len=2048))`` serves
rows instead of documents: the server knows every document's length from its catalog, packs
the whole epoch before it starts (NOTE [ Packed rows ] in
``batchd_server/planning/packing.py``) and deals rows to the ranks as it deals samples, so
``batch_size`` counts rows, every token of every document comes once per epoch across the
ranks, and resume (also at another world size, also inside a :class:`batchd.Mix`) is exact.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Final

from batchd._pipelines import Chat, Text, Tokens, check_choice, check_int
from batchd._proto.batchd.v1 import loader_pb2
from batchd._wire.pack import MAX_SEQ_LEN, MIN_SEQ_LEN, PACK_METHODS
from batchd.errors import InvalidArgument

__all__ = ["Pack", "check_pack"]

_METHODS: Final[Mapping[str, loader_pb2.PackMethod]] = {
    name: loader_pb2.PackMethod.Value(f"PACK_METHOD_{name.upper()}") for name in PACK_METHODS
}


@dataclass(frozen=True)
class Pack:
    """Pack a :class:`batchd.Tokens` pipeline's documents into rows of ``seq_len`` tokens.

    Args:
        seq_len: Tokens per row, 8 to 1048576.
        method: ``"best_fit"`` (default) or ``"first_fit"``: a document stays in one row (one
            longer than ``seq_len`` is cut into ``seq_len`` pieces whose ``position_ids``
            continue), the documents placed longest first into the fullest (best) or first
            opened (first) row they fit, over the whole epoch. ``"concat"``: the documents in
            the epoch's order, concatenated and cut every ``seq_len`` tokens.

    A packed batch has, for ``B`` rows: ``input_ids`` ``[B, seq_len]`` (the Tokens dtype,
    ``pad_id`` on padding); ``position_ids`` int32 (position within its document, 0 on
    padding); ``segment_ids`` int32 (1, 2, ... per document piece within a row, 0 on
    padding); ``document_id`` int64 (the catalog sample id of each token, -1 on padding);
    ``cu_seqlens`` int32 ``[segments + 1]``, the boundaries of every piece and every row's
    padding over the flattened ``[B * seq_len]`` batch (varlen attention); ``length`` int32
    ``[B]``, each row's tokens before its padding; and ``sample_id``/``label`` of each row's
    first document (and ``source`` over a mix).

    Raises:
        InvalidArgument: ``seq_len`` out of range or an unknown method.
    """

    seq_len: int
    method: str = "best_fit"

    def __post_init__(self) -> None:
        seq_len = check_int("Pack seq_len", self.seq_len, MIN_SEQ_LEN, MAX_SEQ_LEN)
        object.__setattr__(self, "seq_len", seq_len)
        check_choice("Pack method", self.method, PACK_METHODS)

    def _to_proto(self) -> loader_pb2.Pack:
        return loader_pb2.Pack(seq_len=self.seq_len, method=_METHODS[self.method])

    def _state(self) -> dict[str, Any]:
        """What a saved state records of the packing: plain values, compared on resume."""
        return {"seq_len": self.seq_len, "method": self.method}


def check_pack(pack: object, pipeline: object) -> None:
    """``pack`` is a :class:`Pack` (or None) over a Tokens pipeline.

    Raises:
        InvalidArgument: anything else, saying what to pass.
    """
    if pack is None:
        if isinstance(pipeline, Text | Chat) and pipeline.max_len is None:
            name = type(pipeline).__name__
            raise InvalidArgument(
                f"{name}(max_len=None) keeps whole documents, which only packed rows can hold; "
                f"pass pack=batchd.Pack(seq_len=...), or give {name}(max_len=...) for batches "
                "of documents"
            )
        return
    if not isinstance(pack, Pack):
        raise InvalidArgument(
            f"pack={pack!r} must be a batchd.Pack, e.g. batchd.Pack(seq_len=2048)"
        )
    if not isinstance(pipeline, Tokens | Text | Chat):
        raise InvalidArgument(
            f"pack=batchd.Pack(...) packs token documents, but the pipeline is {pipeline!r}; "
            "pass pipeline=batchd.Tokens(max_len=..., dtype=...), batchd.Text(...) or "
            "batchd.Chat(...) with it, or leave pack out"
        )
