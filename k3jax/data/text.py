"""The embedded default corpus and byte-level tokenizer for the tiny configs.

The corpus is the Python standard library's own source, present on every machine that runs k3jax, read in a
fixed order so runs are reproducible. Tokens are bytes 0..255 plus BOS/EOS/PAD ids from the config.
"""

from __future__ import annotations

import pathlib
import sysconfig
from typing import Iterator

import numpy as np


class ByteTokenizer:
    def __init__(self, bos_id: int, eos_id: int, pad_id: int, vocab_size: int):
        if min(bos_id, eos_id, pad_id) < 256 or max(bos_id, eos_id, pad_id) >= vocab_size:
            raise ValueError(f"byte tokenizer needs special ids in [256, {vocab_size}); got bos={bos_id} "
                             f"eos={eos_id} pad={pad_id}")
        self.bos_id, self.eos_id, self.pad_id = bos_id, eos_id, pad_id

    def encode(self, text: str | bytes, *, add_bos: bool = True, add_eos: bool = False) -> list[int]:
        data = text.encode("utf-8") if isinstance(text, str) else text
        return ([self.bos_id] if add_bos else []) + list(data) + ([self.eos_id] if add_eos else [])

    def decode(self, ids) -> str:
        return bytes(int(i) for i in ids if 0 <= int(i) < 256).decode("utf-8", errors="replace")


def stdlib_corpus(max_bytes: int = 8 << 20) -> list[bytes]:
    """Documents: the standard library's `.py` files in sorted order, up to `max_bytes` in total."""
    root = pathlib.Path(sysconfig.get_paths()["stdlib"])
    docs, total = [], 0
    for path in sorted(root.rglob("*.py")):
        if "site-packages" in path.parts or "test" in path.parts:
            continue
        try:
            data = path.read_bytes()
        except OSError:
            continue
        docs.append(data)
        total += len(data)
        if total >= max_bytes:
            break
    if not docs:
        raise FileNotFoundError(f"no Python source files found under {root} for the default corpus")
    return docs


def token_stream(docs: list[bytes], tokenizer: ByteTokenizer) -> np.ndarray:
    """All documents concatenated as BOS + bytes + EOS, int32."""
    parts = [np.asarray(tokenizer.encode(d, add_bos=True, add_eos=True), np.int32) for d in docs]
    return np.concatenate(parts)


def random_windows(tokens: np.ndarray, batch_size: int, seq_len: int, seed: int) -> Iterator[np.ndarray]:
    """Endless batches of random windows [B, seq_len + 1] (inputs and shifted targets)."""
    if len(tokens) <= seq_len + 1:
        raise ValueError(f"corpus of {len(tokens)} tokens is too short for seq_len={seq_len}")
    rng = np.random.default_rng(seed)
    while True:
        starts = rng.integers(0, len(tokens) - seq_len - 1, size=batch_size)
        yield np.stack([tokens[s:s + seq_len + 1] for s in starts])
