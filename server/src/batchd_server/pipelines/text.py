"""The text pipeline: raw text tokenized in the decode workers, out as the Tokens fields.

A sample is a document's text: a JSON string literal (a JSONL file's field, its byte range
recorded by ``ingest jsonl --text``) or raw UTF-8 (a Parquet string column). Each worker
loads the ``tokenizer.json`` once (:func:`load_tokenizer`, never from a hub) and tokenizes a
batch of documents in one ``encode_batch``; the tokens are the tokenizer's encoding of the
text without its own special tokens, with the BOS and EOS tokens around them when asked.
The fields are :class:`~batchd_server.pipelines.tokens.TokensPipeline`'s (``input_ids``,
``attention_mask``, ``length``), so padding, packing, mixing and token accounting are the
Tokens pipeline's.

*Tokenizer identity.* Packing plans an epoch from each document's token count, which only
the catalog can give before the epoch: ``ingest ... --tokenizer`` records it with the
tokenizer's :attr:`TextPipeline.identity` (the kind of encoding and the SHA-256 of the
tokenizer file). A packed session whose tokenizer is another is refused
(:meth:`TextPipeline.packing_lengths`): its counts would not be the documents' tokens.
"""

from __future__ import annotations

import copy
import hashlib
import json
import os
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Final, Protocol

import numpy as np
import numpy.typing as npt

from batchd_server.errors import InvalidArgument
from batchd_server.pipelines.base import BadSample, Block, SampleInfo
from batchd_server.pipelines.tokens import MAX_LEN, TokensPipeline
from batchd_server.pipelines.types import Bytes, Offsets

# A worker is one core's work: the tokenizer's own thread pool in every worker process
# would only oversubscribe the CPUs (set before tokenizers is first imported).
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

__all__ = [
    "BOS_NAMES",
    "EOS_NAMES",
    "Encoded",
    "TextPipeline",
    "load_tokenizer",
    "special_tokens",
]

BOS_NAMES: Final = ("<s>", "<|begin_of_text|>", "<bos>", "<|startoftext|>", "<|endoftext|>")
"""Tokens taken as BOS, in this order, when ``tokenizer_config.json`` names none."""
EOS_NAMES: Final = ("</s>", "<|end_of_text|>", "<|endoftext|>", "<eos>", "<|eot_id|>")
"""Likewise for EOS."""

Encoded = tuple[npt.NDArray[Any], npt.NDArray[np.uint8] | None]
"""A document's tokens, and its loss mask (chat) or None."""

_LOADED: dict[tuple[str, int, int], tuple[Any, str]] = {}
_LOCK = threading.Lock()


def load_tokenizer(path: str) -> tuple[Any, str]:
    """The ``tokenizers.Tokenizer`` in the file ``path`` and the file's SHA-256 (hex),
    loaded once per process (again only when the file changed).

    Raises:
        InvalidArgument: no such file, or not a tokenizer.json.
    """
    file = Path(path).expanduser()
    try:
        stat = file.stat()
    except OSError as e:
        raise InvalidArgument(
            f"tokenizer {path!r} cannot be read on the server ({e.strerror or e}); give the "
            "path of a tokenizer.json on the server's machine (Hugging Face tokenizers' "
            "format: tokenizer.save(path), or the tokenizer.json of a model's files)"
        ) from None
    key = (str(file.resolve()), stat.st_mtime_ns, stat.st_size)
    with _LOCK:
        found = _LOADED.get(key)
        if found is not None:
            return found
        from tokenizers import Tokenizer

        data = file.read_bytes()
        try:
            tokenizer = Tokenizer.from_str(data.decode("utf-8"))
        except Exception as e:  # tokenizers raises Exception for a bad file
            raise InvalidArgument(
                f"tokenizer {path!r} is not a Hugging Face tokenizer.json ({e}); save one with "
                "tokenizers' Tokenizer.save(path)"
            ) from e
        found = (tokenizer, hashlib.sha256(data).hexdigest())
        _LOADED[key] = found
        return found


def tokenizer_config(path: str) -> dict[str, Any]:
    """The ``tokenizer_config.json`` beside the tokenizer file, or {} when there is none."""
    config = Path(path).expanduser().with_name("tokenizer_config.json")
    try:
        loaded = json.loads(config.read_text("utf-8"))
    except FileNotFoundError:
        return {}
    except (OSError, ValueError) as e:
        raise InvalidArgument(f"{config} cannot be read as JSON ({e})") from e
    return loaded if isinstance(loaded, dict) else {}


def _token_text(value: object) -> str | None:
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def special_tokens(tokenizer: Any, path: str) -> tuple[int | None, int | None]:
    """The tokenizer's BOS and EOS ids (None where it has none): ``bos_token`` and
    ``eos_token`` of ``tokenizer_config.json`` beside it, else the first of
    :data:`BOS_NAMES` / :data:`EOS_NAMES` in its vocabulary."""
    config = tokenizer_config(path)
    ids = []
    for key, names in (("bos_token", BOS_NAMES), ("eos_token", EOS_NAMES)):
        named = _token_text(config.get(key))
        candidates = (named,) if named is not None else names
        found = None
        for name in candidates:
            found = tokenizer.token_to_id(name)
            if found is not None:
                break
        ids.append(found)
    return ids[0], ids[1]


class _Split(Protocol):
    """What planning knows of a split (``catalog.types.SplitArrays``)."""

    lengths: npt.NDArray[np.int32]

    @property
    def dataset(self) -> Any: ...


class TextPipeline(TokensPipeline):
    """Documents' text tokenized with a tokenizer.json (see the module docs).

    Args:
        tokenizer: The tokenizer.json's path on this machine.
        add_bos, add_eos: Put the tokenizer's BOS / EOS token around each document.
        max_len: Longer documents are truncated; 0 or None: whole documents (packing).
        dtype, pad_id: As :class:`TokensPipeline`'s.
        raw: The samples are raw UTF-8 (a Parquet string column), not JSON values.

    Raises:
        InvalidArgument: the tokenizer cannot be loaded, lacks a BOS/EOS token that was
            asked for, or has ids that ``dtype`` cannot hold.
    """

    def __init__(
        self,
        tokenizer: str,
        add_bos: bool = True,
        add_eos: bool = True,
        max_len: int | None = None,
        dtype: str = "int32",
        pad_id: int = 0,
        raw: bool = False,
    ) -> None:
        super().__init__(max_len or MAX_LEN, dtype, pad_id)
        self.whole = not max_len
        """No max_len: documents are kept whole (only packing can hold them)."""
        self.path = str(tokenizer)
        self.raw = bool(raw)
        self.tokenizer, self.sha256 = load_tokenizer(self.path)
        vocab = self.tokenizer.get_vocab_size(with_added_tokens=True)
        if vocab - 1 > np.iinfo(self.dtype).max:
            raise InvalidArgument(
                f"tokenizer {self.path!r} has {vocab} tokens, more than dtype {dtype!r} holds; "
                "use dtype='int32'"
            )
        bos, eos = special_tokens(self.tokenizer, self.path)
        for asked, found, name in ((add_bos, bos, "BOS"), (add_eos, eos, "EOS")):
            if asked and found is None:
                flag = f"add_{name.lower()}"
                raise InvalidArgument(
                    f"tokenizer {self.path!r} has no {name} token (none named in a "
                    f"tokenizer_config.json beside it, none of "
                    f"{BOS_NAMES if name == 'BOS' else EOS_NAMES} "
                    f"in its vocabulary); pass {flag}=False, or name it as "
                    f"{flag[4:]}_token in tokenizer_config.json"
                )
        self.before = [bos] if add_bos and bos is not None else []
        self.after = [eos] if add_eos and eos is not None else []

    def utf8(self) -> TextPipeline:
        """This pipeline over samples of raw UTF-8 text (a Parquet string column's values)."""
        copied = copy.copy(self)
        copied.raw = True
        return copied

    @property
    def identity(self) -> str:
        """What the catalog's token counts must have been made with: the kind of encoding and
        the tokenizer file's SHA-256."""
        return f"text:sha256:{self.sha256}"

    def extra_tokens(self) -> int:
        """Tokens this pipeline adds to the catalog's count of a document (BOS, EOS)."""
        return len(self.before) + len(self.after)

    # -- planning ------------------------------------------------------------------------

    def packing_lengths(self, split: _Split) -> npt.NDArray[np.int64]:
        """Each document's tokens as this pipeline will make them, from the catalog's counts
        (-1 where there is none); empty documents (count 0) stay 0: they are never served.

        Raises:
            InvalidArgument: the counts were made with another tokenizer, or none at all.
        """
        recorded = getattr(split.dataset, "text_identity", "")
        name = f"{split.dataset.name}:{getattr(split, 'split', '')}"
        if recorded and recorded != self.identity:
            raise InvalidArgument(
                f"{name} was ingested with token counts of {recorded}, but this Loader's "
                f"tokenizer {self.path!r} is {self.identity}: packing would plan from counts "
                "that are not this tokenizer's. Pass the tokenizer it was ingested with, or "
                "re-ingest the text into a new --version with --tokenizer "
                f"{self.path} (batchd-server ingest jsonl|parquet ... --tokenizer PATH)"
            )
        counts = split.lengths.astype(np.int64)
        if not recorded or (counts < 0).any():
            raise InvalidArgument(
                f"{name} has no token counts from this tokenizer, and Pack plans the whole "
                "epoch from every document's count before it starts; re-ingest the text with "
                f"--tokenizer {self.path} (batchd-server ingest jsonl|parquet ... --tokenizer "
                "PATH) into a new --version"
            )
        lengths = np.where(counts > 0, counts + self.extra_tokens(), 0)
        return np.minimum(lengths, self.max_len)

    # -- decoding ------------------------------------------------------------------------

    def value(self, data: Bytes | memoryview | bytes) -> Any:
        """A sample's value: its text (or a chat's messages).

        Raises:
            BadSample: not UTF-8 / JSON, not a string, or empty (the message says which).
        """
        try:
            if self.raw:
                value: Any = bytes(data).decode("utf-8")
            else:
                value = json.loads(bytes(data))
        except (UnicodeDecodeError, ValueError) as e:
            what = "UTF-8 text" if self.raw else "a JSON value"
            raise BadSample("corrupt", f"is not {what} ({e})") from None
        return self.check(value)

    def check(self, value: Any) -> Any:
        """``value`` if it is a document this pipeline encodes, else BadSample."""
        if not isinstance(value, str):
            raise BadSample(
                "shape", f"holds {type(value).__name__} {_clip(value)}, where text is a string"
            )
        if not value:
            raise BadSample("corrupt", "is an empty document: there is no text to tokenize")
        return value

    def prepare(self, value: Any) -> tuple[str, Any]:
        """The text to tokenize of a checked value, and what :meth:`encode` needs beside it
        (a chat's assistant spans).

        Raises:
            BadSample: it cannot be rendered.
        """
        return value, None

    def encode(self, prepared: Sequence[tuple[str, Any]]) -> list[Encoded]:
        """The tokens of prepared documents, in one ``encode_batch``."""
        encodings = self.tokenizer.encode_batch([t for t, _ in prepared], add_special_tokens=False)
        before, after = self.before, self.after
        out: list[Encoded] = []
        for e in encodings:
            ids = np.array(before + e.ids + after if before or after else e.ids, self.dtype)
            out.append((ids, None))
        return out

    def encode_documents(
        self, datas: Sequence[Bytes | memoryview | bytes]
    ) -> list[Encoded | BadSample]:
        """Each sample's tokens, or the BadSample that says why it has none (its message
        without the sample's path)."""
        prepared: list[tuple[str, Any]] = []
        good: list[int] = []
        out: list[Encoded | BadSample] = []
        for i, data in enumerate(datas):
            try:
                prepared.append(self.prepare(self.value(data)))
                good.append(i)
                out.append(_PENDING)
            except BadSample as e:
                out.append(e)
        for i, encoded in zip(good, self.encode(prepared), strict=True):
            out[i] = encoded
        return out

    def _write(self, row: Block, encoded: Encoded) -> None:
        """Write a document into ``row``: one row's fields, or a block's one row (``[1, ...]``)."""
        ids = encoded[0][: self.max_len]
        row["input_ids"][..., : ids.size] = ids
        row["length"][...] = ids.size

    def decode_into(self, data: memoryview, sample: SampleInfo, row: Block) -> None:
        (found,) = self.encode_documents([data])
        if isinstance(found, BadSample):
            raise BadSample(found.kind, f"{sample.path}: {found}")
        self._write(row, found)

    def decode_batch(self, data: Bytes, starts: Offsets, lengths: Offsets, block: Block) -> bool:
        ends = (starts + lengths).tolist()
        found = self.encode_documents(
            [data[s:e] for s, e in zip(starts.tolist(), ends, strict=True)]
        )
        if any(isinstance(f, BadSample) for f in found):
            return False  # decoded one by one, which names each bad sample
        for i, encoded in enumerate(found):
            assert not isinstance(encoded, BadSample)
            # Rows of the block: a 0-d field's row would be a copy, not a view.
            self._write({name: array[i : i + 1] for name, array in block.items()}, encoded)
        return True


_PENDING: Final = BadSample("corrupt", "not encoded")


def _clip(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."
