"""Tokenizers: the Kimi tiktoken BPE (`tiktoken.model` + `tokenizer_config.json`) when present, else bytes.

`tiktoken.model` is a BPE rank file (one `base64(token) rank` per line). Special tokens come from
`tokenizer_config.json` `added_tokens_decoder` ({id: {"content": ...}}); ids in [n_ranks, vocab_size) that it does
not name become `<|reserved_token_{id}|>` so the id space is complete. The pre-tokenisation regex is taken from
`tokenizer_config.json` (`pat_str`) when it carries one; otherwise a generic Han/letters/digits/punctuation split
is used. NOTE: not verified against the released Kimi tokenizer files (none are available here); with the released
files, check `encode` against the HF tokenizer before relying on ids.

`tiktoken` is an optional dependency: loading a directory that has `tiktoken.model` without it installed raises
ImportError saying so. Directories without `tiktoken.model` get `k3jax.data.text.ByteTokenizer` (tiny configs).
"""

from __future__ import annotations

import json
import os

from k3jax.config import ModelConfig
from k3jax.data.text import ByteTokenizer

DEFAULT_PATTERN = "|".join([
    r"[\p{Han}]+",
    r"[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?",
    r"\p{N}{1,3}",
    r" ?[^\s\p{L}\p{N}]+[\r\n]*",
    r"\s*[\r\n]+",
    r"\s+(?!\S)",
    r"\s+",
])


class TiktokenTokenizer:
    """encode/decode with the same surface as ByteTokenizer (bos_id, eos_id, pad_id)."""

    def __init__(self, directory: str, config: ModelConfig):
        try:
            import tiktoken
            from tiktoken.load import load_tiktoken_bpe
        except ImportError:
            raise ImportError(f"{directory} has tiktoken.model: install the optional dependency `tiktoken` "
                              f"(pip install tiktoken) to load it") from None
        ranks = load_tiktoken_bpe(os.path.join(directory, "tiktoken.model"))
        tok_cfg = {}
        cfg_path = os.path.join(directory, "tokenizer_config.json")
        if os.path.exists(cfg_path):
            with open(cfg_path) as f:
                tok_cfg = json.load(f)
        special = {}
        for tid, entry in (tok_cfg.get("added_tokens_decoder") or {}).items():
            content = entry["content"] if isinstance(entry, dict) else str(entry)
            special[content] = int(tid)
        named = set(special.values())
        for tid in range(len(ranks), config.vocab_size):
            if tid not in named:
                special[f"<|reserved_token_{tid}|>"] = tid
        self.encoding = tiktoken.Encoding(name=os.path.basename(os.path.normpath(directory)) or "kimi",
                                          pat_str=tok_cfg.get("pat_str", DEFAULT_PATTERN),
                                          mergeable_ranks=ranks, special_tokens=special)
        self.bos_id, self.eos_id, self.pad_id = config.bos_token_id, config.eos_token_id, config.pad_token_id

    def encode(self, text: str, *, add_bos: bool = True, add_eos: bool = False) -> list[int]:
        ids = self.encoding.encode(text, disallowed_special=())
        return ([self.bos_id] if add_bos else []) + ids + ([self.eos_id] if add_eos else [])

    def decode(self, ids) -> str:
        return self.encoding.decode([int(i) for i in ids])


def load_tokenizer(directory: str, config: ModelConfig):
    """TiktokenTokenizer when `directory/tiktoken.model` exists, else ByteTokenizer for `config`'s special ids."""
    if os.path.exists(os.path.join(directory, "tiktoken.model")):
        return TiktokenTokenizer(directory, config)
    return ByteTokenizer(config.bos_token_id, config.eos_token_id, config.pad_token_id, config.vocab_size)
