"""Prefix cache: per-sequence decode caches snapshotted at fixed token boundaries, reused by later prompts.

A prompt is prefilled in `block`-token chunks from position 0 (so boundaries are always multiples of `block`, 512
by default as in the report §13.9); after each full chunk the batch-1 `DecodeCache` (every KDA state + conv
history, every MLA latent row so far, length) is kept under the exact token prefix it encodes. A later prompt that
starts with a cached prefix (the longest one leaving at least one token to run) starts from that snapshot and
prefills only the rest. Chunks after the hit are the same chunks a cold run computes, so a hit gives bit-identical
caches and output to a cold run.

Entries are whole batch-1 caches (KDA states are fixed-size; MLA latent buffers are copied, not shared pages:
the paged MLA cache is not implemented). Least recently used entries are dropped beyond `capacity`.
"""

from __future__ import annotations

import collections
from typing import Sequence

from k3jax.model import DecodeCache


class PrefixCache:
    def __init__(self, block: int, capacity: int = 64):
        if block < 1 or block & (block - 1):
            raise ValueError(f"prefix block must be a power of two >= 1, got {block}")
        if capacity < 1:
            raise ValueError(f"prefix cache capacity must be >= 1, got {capacity}")
        self.block, self.capacity = block, capacity
        self._entries: collections.OrderedDict[tuple[int, ...], DecodeCache] = collections.OrderedDict()
        self.hits = 0
        self.tokens_reused = 0

    def __len__(self) -> int:
        return len(self._entries)

    def last_boundary(self, prompt_len: int) -> int:
        """The largest multiple of `block` that leaves at least one prompt token to prefill."""
        return ((prompt_len - 1) // self.block) * self.block

    def lookup(self, ids: Sequence[int]) -> tuple[int, DecodeCache | None]:
        """(P, snapshot after ids[:P]) for the longest cached boundary prefix, or (0, None)."""
        for p in range(self.last_boundary(len(ids)), 0, -self.block):
            key = tuple(ids[:p])
            entry = self._entries.get(key)
            if entry is not None:
                self._entries.move_to_end(key)
                self.hits += 1
                self.tokens_reused += p
                return p, entry
        return 0, None

    def store(self, prefix: Sequence[int], cache: DecodeCache) -> None:
        key = tuple(prefix)
        if len(key) % self.block:
            raise ValueError(f"prefix of {len(key)} tokens is not at a {self.block}-token boundary")
        self._entries[key] = cache
        self._entries.move_to_end(key)
        while len(self._entries) > self.capacity:
            self._entries.popitem(last=False)

    def clear(self) -> None:
        self._entries.clear()
