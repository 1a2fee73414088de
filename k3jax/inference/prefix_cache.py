"""Prefix cache: per-sequence decode state snapshotted at fixed token boundaries, reused by later prompts.

A prompt is prefilled in `block`-token chunks from position 0 (so boundaries are always multiples of `block`, 512
by default as in the report §13.9); after each full chunk an entry is kept under the exact token prefix it encodes:
the batch-1 per-sequence state (every KDA state + conv history, the length; the MLA page pools are not part of it)
and the ids of the MLA latent pages holding the prefix's rows. A later prompt that starts with a cached prefix (the
longest one leaving at least one token to run) restores the KDA states from the entry, maps the prefix's FULL pages
into its own page table by reference (they lie wholly below the prefix length, so no sequence writes them again),
copies the partial last page (if the boundary is not a page boundary; the sharer writes the rest of it) and
prefills only the rest. Chunks after the hit are the same chunks a cold run computes, so a hit gives bit-identical
caches and output to a cold run.

Pages are reference-counted by the scheduler's `PageAllocator`: the scheduler takes a reference for an entry when
it stores one, and `release(pages)` (given at construction) is called when an entry is dropped — least recently
used beyond `capacity`, by `evict_lru` when the page pool runs short, or by `clear`.
"""

from __future__ import annotations

import collections
from typing import Callable, NamedTuple, Sequence

from k3jax.model import DecodeCache


class PrefixEntry(NamedTuple):
    state: DecodeCache  # batch 1 after the prefix; MLA page pools replaced by empty placeholders
    pages: tuple[int, ...]  # pool pages of positions [0, prefix length): ceil(length / page_size); the last may be
    # partial (its owner keeps writing the rows past the prefix; a hit copies it)


class PrefixCache:
    def __init__(self, block: int, capacity: int = 64, release: Callable[[Sequence[int]], None] = lambda p: None):
        if block < 1 or block & (block - 1):
            raise ValueError(f"prefix block must be a power of two >= 1, got {block}")
        if capacity < 1:
            raise ValueError(f"prefix cache capacity must be >= 1, got {capacity}")
        self.block, self.capacity = block, capacity
        self._release = release
        self._entries: collections.OrderedDict[tuple[int, ...], PrefixEntry] = collections.OrderedDict()
        self.hits = 0
        self.tokens_reused = 0

    def __len__(self) -> int:
        return len(self._entries)

    def last_boundary(self, prompt_len: int) -> int:
        """The largest multiple of `block` that leaves at least one prompt token to prefill."""
        return ((prompt_len - 1) // self.block) * self.block

    def lookup(self, ids: Sequence[int]) -> tuple[int, PrefixEntry | None]:
        """(P, entry after ids[:P]) for the longest cached boundary prefix, or (0, None). Marks it recently used;
        `record_hit` counts it once the caller has used it."""
        for p in range(self.last_boundary(len(ids)), 0, -self.block):
            key = tuple(ids[:p])
            entry = self._entries.get(key)
            if entry is not None:
                self._entries.move_to_end(key)
                return p, entry
        return 0, None

    def record_hit(self, prefix_len: int) -> None:
        self.hits += 1
        self.tokens_reused += prefix_len

    def store(self, prefix: Sequence[int], entry: PrefixEntry) -> None:
        """Keeps `entry` (whose page references the caller already holds) under `prefix`."""
        key = tuple(prefix)
        if len(key) % self.block:
            raise ValueError(f"prefix of {len(key)} tokens is not at a {self.block}-token boundary")
        old = self._entries.pop(key, None)
        if old is not None:
            self._release(old.pages)
        self._entries[key] = entry
        while len(self._entries) > self.capacity:
            self.evict_lru()

    def evict_lru(self) -> bool:
        """Drops the least recently used entry (releasing its pages); False if there is none."""
        if not self._entries:
            return False
        _, entry = self._entries.popitem(last=False)
        self._release(entry.pages)
        return True

    def clear(self) -> None:
        while self.evict_lru():
            pass
