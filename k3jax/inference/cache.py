"""The continuous-batching decode cache around `k3jax.model.DecodeCache`: which leaves are per sequence and which
are shared page pools, writing sequences into slots, page-table rows, and the host-side page allocator.

A `DecodeCache` for `num_slots` sequences holds per-sequence leaves (KDA states, page-table rows, lengths; batch axis
0, or 1 for scanned groups whose leaves carry a leading [repeats] axis) and the MLA page pools [N, page_size, C]
shared by every slot through the page table (`SHARED`). The batch axes are found from the cache's shapes
(`cache_batch_axes`), not assumed. `CacheLayout` splits a cache into its per-sequence leaves and its pools (so jitted
functions can donate the pools alone) and joins them back. `PageAllocator` is the pool's free list and reference
counts (a prefix-cache entry and the requests sharing it each hold a reference).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Sequence

import jax
import numpy as np

from k3jax.model import NO_PAGE, DecodeCache, init_cache

SHARED = -1  # "batch axis" of a cache leaf shared by every slot (an MLA page pool)


class PageAllocator:
    """Host-side bookkeeping of the MLA page pool: a free list and a reference count per page.

    A page is free at count 0. `allocate` hands out pages at count 1 (most recently freed first); `ref` adds a
    holder to pages in use (a prefix-cache entry, a request sharing a prefix); `release` drops one holder per page
    and returns pages reaching 0 to the free list. Misuse (releasing a free page) raises: it would mean two
    requests writing one page.
    """

    def __init__(self, num_pages: int):
        if num_pages < 1:
            raise ValueError(f"num_pages must be >= 1, got {num_pages}")
        self.num_pages = num_pages
        self.refcount = np.zeros((num_pages,), np.int64)
        self._free = list(range(num_pages - 1, -1, -1))  # a stack: pop() gives page 0 first

    @property
    def num_free(self) -> int:
        return len(self._free)

    def allocate(self, n: int) -> list[int] | None:
        """n free pages (count 1), or None (nothing taken) when fewer than n are free."""
        if n > len(self._free):
            return None
        pages = [self._free.pop() for _ in range(n)]
        self.refcount[pages] = 1
        return pages

    def ref(self, pages: Sequence[int]) -> None:
        for p in pages:
            if self.refcount[p] < 1:
                raise AssertionError(f"page {p} is free: cannot share it")
            self.refcount[p] += 1

    def release(self, pages: Sequence[int]) -> None:
        for p in pages:
            if self.refcount[p] < 1:
                raise AssertionError(f"page {p} released more often than it was taken")
            self.refcount[p] -= 1
            if self.refcount[p] == 0:
                self._free.append(p)

def pages_for(positions: int, page_size: int) -> int:
    """Pages holding `positions` tokens."""
    return -(-positions // page_size)


def page_table_rows(pages: Sequence[Sequence[int]], n: int, pages_per_seq: int) -> np.ndarray:
    """int32 [n, pages_per_seq] page-table rows (NO_PAGE past each list; rows past the lists: all NO_PAGE)."""
    table = np.full((n, pages_per_seq), NO_PAGE, np.int32)
    for i, p in enumerate(pages):
        table[i, :len(p)] = p
    return table


def cache_batch_axes(cfg, max_len: int, page_size: int | None = None) -> DecodeCache:
    """The batch axis of every leaf of a `DecodeCache` (a DecodeCache of ints), found by comparing the shapes of
    caches for batch 1 and 2 over the same page pool: exactly one axis differs, or none (SHARED: a page pool)."""
    one = jax.eval_shape(lambda: init_cache(cfg, 1, max_len, page_size=page_size, num_pages=1))
    two = jax.eval_shape(lambda: init_cache(cfg, 2, max_len, page_size=page_size, num_pages=1))

    def axis(a, b):
        diff = [i for i, (x, y) in enumerate(zip(a.shape, b.shape)) if x != y]
        if len(diff) > 1:
            raise ValueError(f"cannot find the batch axis of a cache leaf {a.shape} / {b.shape}")
        return diff[0] if diff else SHARED

    return jax.tree.map(axis, one, two)


def write_slots(cache: DecodeCache, new: DecodeCache, slots_n: jax.Array, axes: DecodeCache) -> DecodeCache:
    """`cache` with sequence i of `new` (batch n) written into slot slots_n[i] (out-of-range slots are dropped),
    and the SHARED leaves (page pools) of `new`, which already hold the new sequences' latent rows."""

    def put(c, x, axis):
        if axis == SHARED:
            return x
        index = (slice(None),) * axis + (slots_n,)
        return c.at[index].set(x.astype(c.dtype), mode="drop")

    return jax.tree.map(put, cache, new, axes)


@dataclasses.dataclass(frozen=True)
class CacheLayout:
    """A `DecodeCache`'s flattened structure and per-leaf batch axes: splits a cache into its per-sequence leaves
    and its shared page pools (so jitted functions can donate the pools alone) and joins them back."""

    treedef: Any
    axes: tuple[int, ...]

    @classmethod
    def of(cls, cfg, max_len: int, page_size: int) -> "CacheLayout":
        leaves, treedef = jax.tree.flatten(cache_batch_axes(cfg, max_len, page_size))
        return cls(treedef, tuple(leaves))

    def axes_tree(self) -> DecodeCache:
        return jax.tree.unflatten(self.treedef, self.axes)

    def split(self, cache: DecodeCache) -> tuple[tuple, tuple]:
        """(per-sequence leaves, page pools) in leaf order."""
        leaves = self.treedef.flatten_up_to(cache)
        seq = tuple(x for x, a in zip(leaves, self.axes) if a != SHARED)
        pools = tuple(x for x, a in zip(leaves, self.axes) if a == SHARED)
        return seq, pools

    def join(self, seq: Sequence, pools: Sequence) -> DecodeCache:
        seq, pools = iter(seq), iter(pools)
        return jax.tree.unflatten(self.treedef, [next(pools) if a == SHARED else next(seq) for a in self.axes])

    def without_pools(self, cache: DecodeCache) -> DecodeCache:
        """The per-sequence part alone (pools replaced by empty placeholders): what a prefix entry keeps."""
        seq, pools = self.split(cache)
        return self.join(seq, [np.zeros((0,), np.float32)] * len(pools))
