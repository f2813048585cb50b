"""batchd.Text and batchd.Chat: checked when built, every option on the wire, and a
Loader that could not hold their documents refused before any connection."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

import batchd
from batchd._packing import check_pack
from batchd.errors import InvalidArgument


def test_text_and_chat_travel_whole() -> None:
    text = batchd.Text(tokenizer=Path("/m/tokenizer.json"), add_eos=False, max_len=512)
    msg = text._to_proto().text
    assert (msg.tokenizer, msg.add_bos, msg.add_eos, msg.max_len, msg.chat) == (
        "/m/tokenizer.json",
        True,
        False,
        512,
        False,
    )
    assert batchd.Text("/m/t.json")._to_proto().text.max_len == 0  # whole documents
    chat = batchd.Chat("/m/t.json", template="{{ messages }}", dtype="uint16", pad_id=3)
    msg = chat._to_proto().text
    assert (msg.chat, msg.template, msg.dtype, msg.pad_id) == (True, "{{ messages }}", "uint16", 3)
    assert batchd.Chat("/m/t.json")._to_proto().text.template == ""


@pytest.mark.parametrize(
    ("make", "words"),
    [
        (lambda: batchd.Text(tokenizer=""), "tokenizer=''"),
        (lambda: batchd.Text(tokenizer=5), "tokenizer.json on the server's machine"),
        (lambda: batchd.Text("/t.json", max_len=0), "max_len=0"),
        (lambda: batchd.Text("/t.json", dtype="int8"), "'int32', 'uint16'"),
        (lambda: batchd.Text("/t.json", dtype="uint16", pad_id=-1), "pad_id"),
        (lambda: batchd.Chat("/t.json", template=""), "Jinja template"),
    ],
)
def test_a_bad_text_spec_fails_when_built(make: Any, words: str) -> None:
    with pytest.raises(InvalidArgument, match=words):
        make()


def test_whole_documents_need_pack_and_text_packs() -> None:
    with pytest.raises(InvalidArgument, match=r"max_len=None\) keeps whole documents"):
        check_pack(None, batchd.Text("/t.json"))
    with pytest.raises(InvalidArgument, match=r"Chat\(max_len=\.\.\.\)"):
        check_pack(None, batchd.Chat("/t.json"))
    check_pack(None, batchd.Text("/t.json", max_len=64))
    check_pack(batchd.Pack(seq_len=8), batchd.Text("/t.json"))
    check_pack(batchd.Pack(seq_len=8), batchd.Chat("/t.json"))
