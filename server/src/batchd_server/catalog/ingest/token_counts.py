"""Token counts at ingest: each text document's tokens, counted in parallel worker processes
with the tokenizer the Loader will use, and recorded with that tokenizer's identity.

``Pack`` plans an epoch from every document's token count before the epoch starts, which for
raw text only the catalog can give. An ingest with ``--tokenizer`` hands its documents to
:class:`TokenCounter` in chunks; worker processes (each with the tokenizer loaded once)
tokenize them exactly as the decode workers will (``pipelines/text.py``, ``chat.py``) and
send back the counts, without BOS/EOS (the Loader's ``Text`` adds those). The dataset's
``attrs["text"]`` records what the counts are of (:func:`text_attrs`); a packed session
refuses a tokenizer with another identity.
"""

from __future__ import annotations

import multiprocessing
import os
from collections import deque
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any, Final, TypeVar

from batchd_server.catalog.types import DatasetRef
from batchd_server.errors import DataError, InvalidArgument
from batchd_server.pipelines.base import BadSample
from batchd_server.pipelines.chat import ChatPipeline
from batchd_server.pipelines.text import TextPipeline

__all__ = ["CHUNK_DOCUMENTS", "TextSpec", "TokenCounter", "chunked", "text_attrs"]

CHUNK_DOCUMENTS: Final = 1024
"""Documents a worker process counts per task."""

Meta = TypeVar("Meta")


@dataclass(frozen=True)
class TextSpec:
    """What an ingest's documents are and how to count their tokens.

    Args:
        kind: ``"text"`` (a string) or ``"chat"`` (a list of role/content messages).
        field: The JSONL field or Parquet column that holds them.
        tokenizer: A tokenizer.json to count tokens with; None: no counts.
        template: ``chat``: a Jinja chat template file's text; None: the tokenizer's.
        raw: The documents are raw UTF-8 (a Parquet column), not JSON values.
    """

    kind: str
    field: str
    tokenizer: str | None = None
    template: str | None = None
    raw: bool = False

    def pipeline(self) -> TextPipeline:
        """The pipeline that counts (no BOS/EOS: the count is the text's own).

        Raises:
            DataError: the tokenizer or template cannot be used, saying why.
        """
        assert self.tokenizer is not None
        try:
            if self.kind == "chat":
                return ChatPipeline(self.tokenizer, self.template, raw=self.raw)
            return TextPipeline(self.tokenizer, add_bos=False, add_eos=False, raw=self.raw)
        except InvalidArgument as e:
            raise DataError(str(e)) from e


def text_attrs(ref: DatasetRef, attrs: dict[str, Any], spec: TextSpec, identity: str) -> bool:
    """Record in ``attrs`` what the dataset's documents are and what counted them; refuse a
    second ingest whose documents or counts would differ. True when ``attrs`` changed."""
    wanted = {"kind": spec.kind, "field": spec.field, "identity": identity}
    current = attrs.get("text")
    if current == wanted:
        return False
    if current is not None:
        raise DataError(
            f"dataset {ref.name!r} version {ref.version!r} holds {current.get('kind')} documents "
            f"of field {current.get('field')!r} counted by "
            f"{current.get('identity') or 'no tokenizer'}; "
            f"this ingest's are {spec.kind} of {spec.field!r} counted by "
            f"{identity or 'no tokenizer'}. One version's counts come from one tokenizer: "
            "ingest into a new --version"
        )
    attrs["text"] = wanted
    return True


_COUNTER: TextPipeline | None = None


def _start(spec: TextSpec) -> None:
    global _COUNTER
    _COUNTER = spec.pipeline()


def _count(task: tuple[Any, list[bytes]]) -> tuple[Any, list[int | str]]:
    meta, datas = task
    assert _COUNTER is not None, "the worker's initializer loaded the tokenizer"
    counts: list[int | str] = []
    for found in _COUNTER.encode_documents(datas):
        counts.append(f"{found.kind}: {found}" if isinstance(found, BadSample) else found[0].size)
    return meta, counts


class TokenCounter:
    """Worker processes that count documents' tokens (a context manager).

    Args:
        spec: The documents and the tokenizer.
        workers: Processes; default the CPUs this process may use.
    """

    def __init__(self, spec: TextSpec, workers: int | None = None) -> None:
        self.spec = spec
        self.identity = spec.pipeline().identity  # loads it here first: errors come early
        self.workers = workers or len(os.sched_getaffinity(0))
        self._pool: Any = None

    def __enter__(self) -> TokenCounter:
        # spawn: the ingest's process may hold threads (the object store's) and a database
        # connection that a fork would copy.
        context = multiprocessing.get_context("spawn")
        self._pool = context.Pool(self.workers, initializer=_start, initargs=(self.spec,))
        return self

    def __exit__(self, *exc: object) -> None:
        pool, self._pool = self._pool, None
        if pool is not None:
            pool.terminate()
            pool.join()

    def counted(
        self, chunks: Iterable[tuple[Meta, list[bytes]]]
    ) -> Iterator[tuple[Meta, list[int | str]]]:
        """Each chunk's documents' counts (an int, or the reason it has none), in order."""
        assert self._pool is not None, "used inside its with block"
        # A window of chunks in flight, not Pool.imap, which reads its whole input ahead.
        pending: deque[Any] = deque()
        for chunk in chunks:
            pending.append(self._pool.apply_async(_count, (chunk,)))
            if len(pending) >= 2 * self.workers:
                yield pending.popleft().get()
        while pending:
            yield pending.popleft().get()


def chunked(items: Iterable[Any], size: int = CHUNK_DOCUMENTS) -> Iterator[list[Any]]:
    """``items`` in lists of ``size``."""
    chunk: list[Any] = []
    for item in items:
        chunk.append(item)
        if len(chunk) == size:
            yield chunk
            chunk = []
    if chunk:
        yield chunk
