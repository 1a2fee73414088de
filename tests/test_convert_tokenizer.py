"""Tokenizer selection: tiktoken model when the directory has one (optional dependency), bytes otherwise."""

from __future__ import annotations

import base64
import json

import pytest

import configs
import k3jax
from k3jax.data.text import ByteTokenizer


def test_byte_tokenizer_without_tiktoken_model(tmp_path):
    tok = k3jax.load_tokenizer(str(tmp_path), configs.get_config("tiny"))
    assert isinstance(tok, ByteTokenizer) and tok.decode(tok.encode("héllo")) == "héllo"


def test_tiktoken_model(tmp_path):
    pytest.importorskip("tiktoken")
    ranks = [bytes([b]) for b in range(256)] + [b"he", b"ll", b"hell", b"hello"]
    (tmp_path / "tiktoken.model").write_text(
        "".join(f"{base64.b64encode(t).decode()} {i}\n" for i, t in enumerate(ranks)))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(
        {"added_tokens_decoder": {"300": {"content": "[BOS]"}, "301": {"content": "[EOS]"}}}))
    cfg = configs.get_config("tiny").replace(vocab_size=320, bos_token_id=300, eos_token_id=301, pad_token_id=319)
    tok = k3jax.load_tokenizer(str(tmp_path), cfg)
    ids = tok.encode("hello world", add_eos=True)
    assert ids[0] == 300 and ids[1] == 259 and ids[-1] == 301  # "hello" is one merged token
    assert tok.decode(ids[1:-1]) == "hello world"
