"""The chat pipeline: conversations rendered by a Jinja chat template, tokenized, with a loss
mask that is 1 exactly on the assistant's tokens.

A sample is a list of ``{"role": ..., "content": ...}`` messages (a JSONL field recorded by
``ingest jsonl --messages``). The template is the one given, else the ``chat_template`` of
the ``tokenizer_config.json`` beside the tokenizer, rendered as Hugging Face renders it
(a sandboxed Jinja environment, ``trim_blocks`` and ``lstrip_blocks``, ``raise_exception``).

*Which tokens are the assistant's.* The conversation is rendered once whole and, for each
assistant message ``i``, as its first ``i`` messages with the generation prompt (the header
the model answers after) and as its first ``i + 1`` messages: message ``i``'s own text is
the characters between the two, which the whole rendering must begin with (a template that
renders a conversation's start differently once more messages follow is refused). A token is
the assistant's when its first character (the tokenizer's offsets) is in one of those spans,
so the mask covers the reply and what the template closes it with (end of turn), never the
role header or anyone else's message.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from typing import Any

import numpy as np

from batchd_server.errors import InvalidArgument
from batchd_server.pipelines.base import BadSample, Block, FieldSpec
from batchd_server.pipelines.text import Encoded, TextPipeline, tokenizer_config

__all__ = ["ChatPipeline"]


def _compile(source: str) -> Any:
    from jinja2 import TemplateError
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message: str) -> None:
        raise TemplateError(message)

    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"]
    )
    env.globals["raise_exception"] = raise_exception
    try:
        return env.from_string(source)
    except TemplateError as e:
        raise InvalidArgument(f"the chat template is not valid Jinja ({e})") from e


class ChatPipeline(TextPipeline):
    """Chat transcripts as tokens and a ``loss_mask`` (see the module docs).

    Args:
        tokenizer: The tokenizer.json's path on this machine.
        template: A Jinja chat template; "" or None: the tokenizer's (tokenizer_config.json).
        max_len, dtype, pad_id, raw: As :class:`TextPipeline`'s.

    Raises:
        InvalidArgument: as :class:`TextPipeline`, or no template / one that is not Jinja.
    """

    def __init__(
        self,
        tokenizer: str,
        template: str | None = None,
        max_len: int | None = None,
        dtype: str = "int32",
        pad_id: int = 0,
        raw: bool = False,
    ) -> None:
        super().__init__(tokenizer, False, False, max_len, dtype, pad_id, raw)
        config = tokenizer_config(self.path)
        source = template or config.get("chat_template")
        if isinstance(source, list):  # several named templates: the default one
            named = {t.get("name"): t.get("template") for t in source if isinstance(t, dict)}
            source = named.get("default")
        if not isinstance(source, str) or not source:
            raise InvalidArgument(
                f"Chat needs a chat template: tokenizer {self.path!r} has no chat_template in a "
                "tokenizer_config.json beside it; pass batchd.Chat(..., template=JINJA)"
            )
        self.template_source = source
        self.template = _compile(source)
        self.context = {
            key: config[key]
            for key in ("bos_token", "eos_token", "pad_token", "unk_token")
            if isinstance(config.get(key), str)
        }

    @property
    def identity(self) -> str:
        template = hashlib.sha256(self.template_source.encode()).hexdigest()
        return f"chat:sha256:{self.sha256}:template:{template}"

    def fields(self) -> list[FieldSpec]:
        return [*super().fields(), FieldSpec("loss_mask", np.dtype(np.uint8), (self.max_len,))]

    def check(self, value: Any) -> Any:
        if not isinstance(value, list) or not all(
            isinstance(m, dict)
            and isinstance(m.get("role"), str)
            and isinstance(m.get("content"), str)
            for m in value
        ):
            raise BadSample(
                "shape",
                f"holds {type(value).__name__} {str(value)[:60]!r}, where a chat is a list of "
                '{"role": str, "content": str} messages',
            )
        if not value:
            raise BadSample("corrupt", "is an empty conversation: it has no messages")
        return value

    def _render(self, messages: Sequence[Any], prompt: bool) -> str:
        from jinja2 import TemplateError

        try:
            return str(
                self.template.render(
                    messages=list(messages), add_generation_prompt=prompt, **self.context
                )
            )
        except TemplateError as e:
            raise BadSample("corrupt", f"the chat template refused it ({e})") from e

    def render(self, messages: Sequence[Any]) -> tuple[str, list[tuple[int, int]]]:
        """The conversation's text and the character spans of its assistant messages.

        Raises:
            BadSample: the template fails, or renders a start of the conversation that the
                whole rendering does not begin with.
        """
        text = self._render(messages, False)
        spans = []
        for i, message in enumerate(messages):
            if message["role"] != "assistant":
                continue
            head = self._render(messages[:i], True)
            end = self._render(messages[: i + 1], False)
            if not text.startswith(end) or not end.startswith(head):
                raise BadSample(
                    "corrupt",
                    "the chat template renders the conversation's first messages differently "
                    "once more follow, so the assistant's tokens cannot be found; use a "
                    "template that renders message by message",
                )
            spans.append((len(head), len(end)))
        return text, spans

    def prepare(self, value: Any) -> tuple[str, Any]:
        return self.render(value)

    def encode(self, prepared: Sequence[tuple[str, Any]]) -> list[Encoded]:
        encodings = self.tokenizer.encode_batch([t for t, _ in prepared], add_special_tokens=False)
        out: list[Encoded] = []
        for (_, spans), e in zip(prepared, encodings, strict=True):
            ids = np.array(e.ids, self.dtype)
            firsts = np.array([o[0] for o in e.offsets], np.int64)
            mask = np.zeros(ids.size, np.uint8)
            for start, end in spans:
                mask[(firsts >= start) & (firsts < end)] = 1
            out.append((ids, mask))
        return out

    def _write(self, row: Block, encoded: Encoded) -> None:
        super()._write(row, encoded)
        mask = encoded[1]
        assert mask is not None, "a chat's encoding has its mask"
        kept = mask[: self.max_len]
        row["loss_mask"][..., : kept.size] = kept

    def finish(self, block: Block, rows: int) -> dict[str, tuple[int, ...]]:
        lengths = block["length"][:rows]
        longest = int(lengths.max()) if rows else 0
        mask = block["loss_mask"]
        kept = mask[:rows, :longest].copy()
        kept[~(np.arange(longest) < lengths[:, None])] = 0
        mask.reshape(-1)[: rows * longest].reshape(rows, longest)[...] = kept
        shapes = super().finish(block, rows)
        shapes["loss_mask"] = (rows, longest)
        return shapes
