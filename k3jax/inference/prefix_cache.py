"""Prefix cache: per-sequence decode state snapshotted at fixed token boundaries, reused by later prompts.

A prompt is prefilled in `block`-token chunks from position 0 (so chunk ends are always multiples of `block`). The
release keeps KDA state checkpoints at two intervals (docs/spec.md#prefix-cache): every 512 tokens (`block`), and
every 6144 tokens (`long_block`) for long prompts. Here a chunk end p is KEPT as a snapshot when p <= `threshold`,
or when p is a multiple of `long_block` (`keeps`): a 131072-token prompt keeps 32 + 19 snapshots with the defaults,
not 255. Which ends are kept depends on the position alone, never on the prompt's length, so every prompt sees the
same boundary set and a hit at any kept boundary resumes on exactly the chunk grid a cold run uses.

An entry is kept under the exact token prefix it encodes (a chain of BLAKE2b digests, one per `block` tokens, so a
lookup hashes each prompt token once): the batch-1 per-sequence state (every KDA state + conv history, the length;
the MLA page pools are not part of it) and the ids of the MLA latent pages holding the prefix's rows. A later prompt
that starts with a cached prefix (the longest kept one leaving at least one token to run) restores the KDA states
from the entry, maps the prefix's FULL pages into its own page table by reference (they lie wholly below the prefix
length, so no sequence writes them again), copies the partial last page (if the boundary is not a page boundary;
the sharer writes the rest of it) and prefills only the rest. Chunks after the hit are the same chunks a cold run
computes, so a hit gives bit-identical caches and output to a cold run.

Memory: snapshots are bounded in bytes (`max_bytes`, the sum of their device arrays' sizes; least recently used
entries are dropped to fit a new one, and one larger than the bound alone is not kept) and optionally in count
(`capacity`). Their MLA pages live in the scheduler's page pool and are reference-counted by its `PageAllocator`:
the scheduler takes a reference for an entry when it stores one, and `release(pages)` (given at construction) is
called when an entry is dropped — by either bound, by `evict_lru` when the page pool runs short, or by `clear`.
"""

from __future__ import annotations

import collections
import hashlib
from typing import Any, Callable, NamedTuple, Sequence

import jax
import numpy as np

from k3jax.model import DecodeCache

DEFAULT_BLOCK = 512  # the release's fine checkpoint interval (docs/spec.md#prefix-cache)
DEFAULT_LONG_BLOCK = 6144  # the release's coarse interval
DEFAULT_THRESHOLD = 16384  # ours: boundaries past it are kept at the coarse interval only
AUTO_FRACTION = 0.25  # automatic byte bound: this share of the least free device memory
AUTO_FALLBACK_BYTES = 1 << 30  # automatic byte bound where devices report no memory (CPU)


class PrefixEntry(NamedTuple):
    state: DecodeCache  # batch 1 after the prefix; MLA page pools replaced by empty placeholders
    pages: tuple[int, ...]  # pool pages of positions [0, prefix length): ceil(length / page_size); the last may be
    # partial (its owner keeps writing the rows past the prefix; a hit copies it)
    extra: Any = None  # device arrays a speculative draft keeps of the prefix's last position (else None)


def entry_bytes(entry: PrefixEntry) -> int:
    """Device bytes of an entry's snapshot (global sizes: a sharded array counts whole)."""
    return sum(int(x.nbytes) for x in jax.tree.leaves((entry.state, entry.extra)))


def auto_max_bytes(devices: Sequence) -> int:
    """AUTO_FRACTION of the least free memory among `devices` (bytes_limit - bytes_in_use of `memory_stats`), or
    AUTO_FALLBACK_BYTES where a device reports none (CPU)."""
    free = []
    for d in devices:
        try:
            stats = d.memory_stats()
        except Exception:  # noqa: BLE001 - backends without memory statistics raise or return None
            stats = None
        if not stats or "bytes_limit" not in stats:
            return AUTO_FALLBACK_BYTES
        free.append(int(stats["bytes_limit"]) - int(stats.get("bytes_in_use", 0)))
    return max(1, int(AUTO_FRACTION * min(free))) if free else AUTO_FALLBACK_BYTES


class PrefixCache:
    """Snapshots at kept boundaries, LRU-bounded by `max_bytes` (None: unbounded) and `capacity` (None: no count
    bound). `long_block` None or 0: every `block` boundary is kept."""

    def __init__(self, block: int = DEFAULT_BLOCK, capacity: int | None = None,
                 release: Callable[[Sequence[int]], None] = lambda p: None, *,
                 long_block: int | None = DEFAULT_LONG_BLOCK, threshold: int = DEFAULT_THRESHOLD,
                 max_bytes: int | None = None):
        if block < 1 or block & (block - 1):
            raise ValueError(f"prefix block must be a power of two >= 1, got {block}")
        if capacity is not None and capacity < 1:
            raise ValueError(f"prefix cache capacity must be >= 1, got {capacity}")
        if long_block and (long_block < 0 or long_block % block):
            raise ValueError(f"prefix long block must be a multiple of the prefix block {block}, got {long_block}")
        if threshold < 0:
            raise ValueError(f"prefix long threshold must be >= 0, got {threshold}")
        if max_bytes is not None and max_bytes < 1:
            raise ValueError(f"prefix cache byte bound must be >= 1, got {max_bytes}")
        self.block, self.capacity = block, capacity
        self.long_block, self.threshold = long_block or None, threshold
        self.max_bytes = max_bytes
        self._release = release
        self._entries: collections.OrderedDict[bytes, PrefixEntry] = collections.OrderedDict()
        self._bytes: dict[bytes, int] = {}
        self.bytes_used = 0
        self.reset_stats()

    def __len__(self) -> int:
        return len(self._entries)

    def reset_stats(self) -> None:
        self.hits = self.misses = 0
        self.tokens_saved = 0  # prompt tokens not prefilled thanks to hits

    def last_boundary(self, prompt_len: int) -> int:
        """The largest multiple of `block` that leaves at least one prompt token to prefill."""
        return ((prompt_len - 1) // self.block) * self.block

    def keeps(self, pos: int) -> bool:
        """Whether a snapshot is kept at chunk end `pos`: a block multiple up to `threshold`, a `long_block`
        multiple past it."""
        if pos <= 0 or pos % self.block:
            return False
        return self.long_block is None or pos <= self.threshold or pos % self.long_block == 0

    def block_keys(self, ids: Sequence[int]) -> list[bytes]:
        """keys[i]: the key of ids[:(i + 1) * block], for every full block up to `last_boundary(len(ids))`."""
        arr = np.asarray(ids, np.int64)
        keys, digest = [], b""
        for end in range(self.block, self.last_boundary(len(arr)) + 1, self.block):
            digest = hashlib.blake2b(digest + arr[end - self.block:end].tobytes(), digest_size=32).digest()
            keys.append(digest)
        return keys

    def lookup(self, keys: Sequence[bytes]) -> tuple[int, PrefixEntry | None]:
        """(P, entry after the prompt's first P tokens) for the longest cached boundary among the prompt's
        `block_keys`, or (0, None). Marks it recently used; `record` counts the admission once it is made."""
        for i in range(len(keys) - 1, -1, -1):
            entry = self._entries.get(keys[i])
            if entry is not None:
                self._entries.move_to_end(keys[i])
                return (i + 1) * self.block, entry
        return 0, None

    def record(self, prefix_len: int, prompt_len: int) -> None:
        """Counts one admission: a hit reusing `prefix_len` tokens, or (prefix_len 0) a miss when the prompt had
        a full block to reuse (shorter prompts cannot hit and count as neither)."""
        if prefix_len:
            self.hits += 1
            self.tokens_saved += prefix_len
        elif self.last_boundary(prompt_len) > 0:
            self.misses += 1

    def store(self, key: bytes, entry: PrefixEntry) -> bool:
        """Keeps `entry` (whose page references the caller already holds) under `key` (from `block_keys`), first
        dropping least recently used entries until it fits both bounds. False (its pages released, nothing else
        dropped) when it alone exceeds `max_bytes`."""
        size = entry_bytes(entry)
        if self.max_bytes is not None and size > self.max_bytes:
            self._release(entry.pages)
            return False
        if key in self._entries:
            self._drop(key)
        while self._entries and ((self.max_bytes is not None and self.bytes_used + size > self.max_bytes)
                                 or (self.capacity is not None and len(self._entries) >= self.capacity)):
            self.evict_lru()
        self._entries[key] = entry
        self._bytes[key] = size
        self.bytes_used += size
        return True

    def _drop(self, key: bytes) -> None:
        entry = self._entries.pop(key)
        self.bytes_used -= self._bytes.pop(key)
        self._release(entry.pages)

    def evict_lru(self) -> bool:
        """Drops the least recently used entry (releasing its pages); False if there is none."""
        if not self._entries:
            return False
        self._drop(next(iter(self._entries)))
        return True

    def clear(self) -> None:
        while self.evict_lru():
            pass

    def stats(self) -> dict:
        """What /health reports."""
        return {"enabled": True, "block": self.block, "long_block": self.long_block,
                "long_threshold": self.threshold, "entries": len(self), "capacity": self.capacity,
                "bytes_used": self.bytes_used, "bytes_limit": self.max_bytes, "hits": self.hits,
                "misses": self.misses, "tokens_saved": self.tokens_saved}
