"""Group metadata for the grouped matmul kernels, computed once per call from `group_sizes` (pure jnp, jittable).

Rows are grouped contiguously: group i owns rows [starts[i], ends[i]). A virtual group `g` (index = number of real
groups) owns the tail [sum(group_sizes), m): its output rows must be zeros (`jax.lax.ragged_dot` semantics), so the
forward kernels visit it and write zeros instead of leaving those rows uninitialised.

Two tilings of the rows, both with a static number of slots (padding slots are no-ops):
- `group_tiles` (GPU): tiles start at each group's first row (not aligned to the tile size), so every tile belongs
  to exactly one group; at most cdiv(m, tm) + g tiles over the g + 1 groups.
- `aligned_items` (TPU, megablox-style): work items (group, aligned row tile) for every tile a group touches; a tile
  shared by several groups is visited once per group, consecutively, and the kernel masks rows by group.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp


class GroupBounds(NamedTuple):
    starts_v: jax.Array  # int32 [g + 1]: first row of each group; the last entry is the tail (virtual group)
    ends_v: jax.Array  # int32 [g + 1]: one past the last row; ends_v[g] = m


class GroupTiles(NamedTuple):
    tile_group: jax.Array  # int32 [slots]: group of each tile (g = tail); padding slots have group g
    tile_row_start: jax.Array  # int32 [slots]: first row of the tile; padding slots have m (empty)


class AlignedItems(NamedTuple):
    item_group: jax.Array  # int32 [items]: group of each work item (g = tail)
    item_tile: jax.Array  # int32 [items]: aligned row tile (rows tile*tm .. tile*tm + tm)
    item_valid: jax.Array  # int32 [items]: 0 for padding items (repeat the last real item, compute nothing)


def group_bounds(group_sizes_g: jax.Array, m: int) -> GroupBounds:
    """Row ranges of the groups (clamped to m) plus the tail group."""
    sizes = jnp.maximum(group_sizes_g.astype(jnp.int32), 0)
    ends = jnp.minimum(jnp.cumsum(sizes), m)
    starts = jnp.concatenate([jnp.zeros((1,), jnp.int32), ends[:-1]])
    total = ends[-1:]
    return GroupBounds(jnp.concatenate([starts, total]), jnp.concatenate([ends, jnp.full((1,), m, jnp.int32)]))


def num_group_tiles(m: int, num_groups: int, tm: int) -> int:
    """Upper bound of sum_i cdiv(size_i, tm) over the g + 1 groups: each group adds at most one partial tile."""
    return pl_cdiv(m, tm) + num_groups


def group_tiles(bounds: GroupBounds, m: int, tm: int) -> GroupTiles:
    num_groups = bounds.starts_v.shape[0] - 1
    slots = num_group_tiles(m, num_groups, tm)
    counts = (bounds.ends_v - bounds.starts_v + tm - 1) // tm
    cum = jnp.cumsum(counts)
    slot = jnp.arange(slots, dtype=jnp.int32)
    # compare_all: one fused comparison instead of a scan loop of tiny kernels (the decode profile showed ~390
    # launches per step from the default method).
    grp = jnp.searchsorted(cum, slot, side="right", method="compare_all").astype(jnp.int32)  # g + 1 past the end
    real = grp <= num_groups
    grp_c = jnp.minimum(grp, num_groups)
    first_slot = cum[grp_c] - counts[grp_c]
    row_start = bounds.starts_v[grp_c] + (slot - first_slot) * tm
    return GroupTiles(jnp.where(real, grp_c, num_groups), jnp.where(real, row_start, m).astype(jnp.int32))


def num_aligned_items(m: int, num_groups: int, tm: int) -> int:
    """Upper bound of the (group, aligned tile) pairs: cdiv(m, tm) tiles, plus one per group boundary."""
    return pl_cdiv(m, tm) + num_groups


def aligned_items(bounds: GroupBounds, m: int, tm: int, *, include_tail: bool, visit_empty: bool) -> AlignedItems:
    """Work items over aligned row tiles. `include_tail`: also cover the tail group (forward: zero rows).
    `visit_empty`: give every empty real group one item (tgmm: its weight gradient must be written as zeros)."""
    num_groups = bounds.starts_v.shape[0] - 1
    starts, ends = bounds.starts_v, bounds.ends_v
    if not include_tail:
        starts, ends = starts[:-1], ends[:-1]
    m_tiles = pl_cdiv(m, tm)
    first_tile = jnp.minimum(starts // tm, m_tiles - 1)
    last_tile = (jnp.maximum(ends, 1) - 1) // tm
    counts = jnp.where(ends > starts, last_tile - first_tile + 1, 0)
    if visit_empty:
        counts = jnp.maximum(counts, 1)
    items = num_aligned_items(m, num_groups, tm) + (num_groups if visit_empty else 0)
    cum = jnp.cumsum(counts)
    total = cum[-1]
    item = jnp.minimum(jnp.arange(items, dtype=jnp.int32), total - 1)  # padding items repeat the last real one
    grp = jnp.searchsorted(cum, item, side="right", method="compare_all").astype(jnp.int32)
    tile = first_tile[grp] + item - (cum[grp] - counts[grp])
    valid = (jnp.arange(items) < total).astype(jnp.int32)
    return AlignedItems(grp, tile.astype(jnp.int32), valid)


def pl_cdiv(a: int, b: int) -> int:
    return -(-a // b)
