"""The text and chat pipelines on their own: a document's tokens are the tokenizer's
encoding with BOS/EOS, a batch is one encode_batch equal to one-by-one decodes, bad
documents are named bad samples, and a chat's loss_mask is 1 exactly on the assistant's
tokens (the reply and its end-of-turn, never a header or another role's text)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from tokenizers import Tokenizer

from batchd_server.errors import InvalidArgument
from batchd_server.pipelines.base import BadSample, SampleInfo
from batchd_server.pipelines.chat import ChatPipeline
from batchd_server.pipelines.registry import build_pipeline
from batchd_server.pipelines.text import TextPipeline

from text_data import CHAT_TEMPLATE, chats, documents, train_tokenizer

BOS, EOS = 1, 2


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, Tokenizer]:
    path = tmp_path_factory.mktemp("tok") / "tokenizer.json"
    return str(path), train_tokenizer(path)


def _info() -> SampleInfo:
    return SampleInfo(sample_id=7, label=-1, path="a.jsonl", length=-1, seed=0, epoch=0)


def _decode(pipeline: TextPipeline, data: bytes, fields: list[str]) -> dict[str, Any]:
    block = {f.name: np.zeros((1, *f.shape), f.dtype) for f in pipeline.fields()}
    pipeline.decode_into(memoryview(data), _info(), {k: v[0, ...] for k, v in block.items()})
    shapes = pipeline.finish(block, 1)
    return {k: block[k].reshape(-1)[: int(np.prod(shapes[k]))] for k in fields}


def test_a_document_is_the_tokenizers_encoding_between_bos_and_eos(
    tokenizer: tuple[str, Tokenizer],
) -> None:
    path, tok = tokenizer
    for text in documents(20, seed=4):
        want = [BOS, *tok.encode(text).ids, EOS]
        got = _decode(TextPipeline(path, max_len=4096), json.dumps(text).encode(), ["input_ids"])
        assert got["input_ids"].tolist() == want
        raw = TextPipeline(path, max_len=4096).utf8()
        assert _decode(raw, text.encode(), ["input_ids"])["input_ids"].tolist() == want
        bare = TextPipeline(path, add_bos=False, add_eos=False, max_len=5, dtype="uint16")
        got = _decode(bare, json.dumps(text).encode(), ["input_ids", "length"])
        assert got["input_ids"].tolist() == tok.encode(text).ids[:5]
        assert got["input_ids"].dtype == np.uint16


def test_a_batch_is_decoded_as_its_documents_one_by_one(tokenizer: tuple[str, Tokenizer]) -> None:
    path, tok = tokenizer
    texts = documents(9, seed=5)
    pipeline = TextPipeline(path, max_len=64)
    data = b"".join(json.dumps(t).encode() for t in texts)
    lengths = np.array([len(json.dumps(t).encode()) for t in texts], np.int64)
    starts = np.cumsum(lengths) - lengths
    block = {f.name: np.zeros((len(texts), *f.shape), f.dtype) for f in pipeline.fields()}
    assert pipeline.decode_batch(np.frombuffer(data, np.uint8), starts, lengths, block)
    for i, text in enumerate(texts):
        want = [BOS, *tok.encode(text).ids, EOS][:64]
        assert int(block["length"][i]) == len(want)
        assert block["input_ids"][i, : len(want)].tolist() == want
    bad = np.frombuffer(b'"ok"""', np.uint8)
    assert not pipeline.decode_batch(bad, np.array([0, 4]), np.array([4, 2]), block)


@pytest.mark.parametrize(
    ("data", "kind", "says"),
    [
        (b'""', "corrupt", "empty document"),
        (b"17", "shape", "int 17, where text is a string"),
        (b'["a"]', "shape", "list"),
        (b'"unterminated', "corrupt", "not a JSON value"),
    ],
)
def test_a_bad_document_is_a_named_bad_sample(
    tokenizer: tuple[str, Tokenizer], data: bytes, kind: str, says: str
) -> None:
    with pytest.raises(BadSample, match=says) as caught:
        _decode(TextPipeline(tokenizer[0], max_len=8), data, ["input_ids"])
    assert caught.value.kind == kind
    assert "a.jsonl" in str(caught.value)


def test_a_tokenizer_that_cannot_be_used_is_refused_saying_why(
    tokenizer: tuple[str, Tokenizer], tmp_path: Path
) -> None:
    with pytest.raises(InvalidArgument, match="cannot be read on the server"):
        TextPipeline(str(tmp_path / "missing.json"))
    (tmp_path / "bad.json").write_text("{}")
    with pytest.raises(InvalidArgument, match=r"not a Hugging Face tokenizer\.json"):
        TextPipeline(str(tmp_path / "bad.json"))
    with pytest.raises(InvalidArgument, match="options"):
        build_pipeline("text", {"tokenizer": tokenizer[0], "nonsense": 1})
    alone = tmp_path / "alone" / "tokenizer.json"
    alone.parent.mkdir()
    raw = json.loads(Path(tokenizer[0]).read_text())
    raw["added_tokens"] = [t for t in raw["added_tokens"] if t["content"] not in ("<s>", "</s>")]
    for name in ("<s>", "</s>"):
        raw["model"]["vocab"].pop(name)
    alone.write_text(json.dumps(raw))
    with pytest.raises(InvalidArgument, match=r"no BOS token.*add_bos=False"):
        TextPipeline(str(alone))
    assert TextPipeline(str(alone), add_bos=False, add_eos=False).extra_tokens() == 0


def _assistant_text(conversation: list[dict[str, str]]) -> str:
    return "".join(m["content"] + "<|end|>\n" for m in conversation if m["role"] == "assistant")


def test_a_chats_loss_mask_covers_exactly_the_assistants_tokens(
    tokenizer: tuple[str, Tokenizer],
) -> None:
    """With the tokenizer's template (tokenizer_config.json) and a given one: the tokens
    are the rendered conversation's, and the masked ones decode to the assistant replies
    with their end-of-turn, nothing else."""
    path, tok = tokenizer
    given = CHAT_TEMPLATE.replace("<|end|>\n", "<|end|>\n\n")
    for template, sep in ((None, "<|end|>\n"), (given, "<|end|>\n\n")):
        pipeline = ChatPipeline(path, template, max_len=2048)
        for conversation in chats(12, seed=6):
            got = _decode(pipeline, json.dumps(conversation).encode(), ["input_ids", "loss_mask"])
            ids, mask = got["input_ids"], got["loss_mask"]
            rendered = "".join(f"<|{m['role']}|>\n{m['content']}{sep}" for m in conversation)
            assert ids.tolist() == tok.encode(rendered).ids
            masked = tok.decode(ids[mask == 1].tolist(), skip_special_tokens=False)
            assert masked == _assistant_text(conversation).replace("<|end|>\n", sep)
            # Outside the mask: every header and every other message, whole.
            unmasked = tok.decode(ids[mask == 0].tolist(), skip_special_tokens=False)
            for m in conversation:
                if m["role"] != "assistant":
                    assert f"<|{m['role']}|>\n{m['content']}" in unmasked
            assert unmasked.count("<|assistant|>") == sum(
                m["role"] == "assistant" for m in conversation
            )


def test_a_bad_chat_is_a_named_bad_sample(tokenizer: tuple[str, Tokenizer]) -> None:
    pipeline = ChatPipeline(tokenizer[0], max_len=64)
    for data, says in (
        (b"[]", "empty conversation"),
        (b'"just text"', "list of"),
        (b'[{"role": "user"}]', "list of"),
    ):
        with pytest.raises(BadSample, match=says):
            _decode(pipeline, data, ["input_ids"])
    unstable = "{{ messages | length }}{% for m in messages %}{{ m.content }}{% endfor %}"
    chat = [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]
    with pytest.raises(BadSample, match="renders the conversation's first messages differently"):
        _decode(ChatPipeline(tokenizer[0], unstable, 64), json.dumps(chat).encode(), ["input_ids"])
    with pytest.raises(InvalidArgument, match="not valid Jinja"):
        ChatPipeline(tokenizer[0], "{% for %}")
