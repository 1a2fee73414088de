"""The top-k selection of the decode routing kernel (`select`): k rounds of max /
first-argmax inside a kernel, and the argument checks of their [N, E] score inputs."""

from __future__ import annotations

import jax
import jax.numpy as jnp

__all__ = ["MAX_EXPERTS", "MAX_TOKENS", "check_scores", "top_k_rounds"]

MAX_TOKENS = 256  # the kernels hold [tokens, E] tiles: decode sizes only
MAX_EXPERTS = 256


def check_scores(name: str, scores_ne: jax.Array, k: int) -> tuple[int, int]:
    """(N, E) of selection scores [N, E] for top-k, or a ValueError naming `name` and the problem."""
    if scores_ne.ndim != 2:
        raise ValueError(f"{name}: expected selection scores [N, E], got shape {scores_ne.shape}")
    n, e = scores_ne.shape
    if not 1 <= k <= e:
        raise ValueError(f"{name}: k={k} must be in [1, E={e}]")
    if n > MAX_TOKENS or e > MAX_EXPERTS:
        raise ValueError(f"{name}: decode sizes only (N <= {MAX_TOKENS}, E <= {MAX_EXPERTS}), got N={n}, E={e}")
    return n, e


def top_k_rounds(ranked_te: jax.Array, free_te: jax.Array, k: int):
    """Yields (j, idx [T] int32, hit [T, E] bool) for j = 0 .. k-1, best first: the column of the largest `ranked`
    value among the still `free` columns of each row (in-kernel, traced). Ties go to the lower column, as
    `jax.lax.top_k`; with only -inf left a row takes its first free column, so its k columns are always distinct.
    Callers map NaN to -inf first."""
    width = ranked_te.shape[1]
    col = jax.lax.broadcasted_iota(jnp.int32, ranked_te.shape, 1)
    for j in range(k):
        masked = jnp.where(free_te, ranked_te, -jnp.inf)
        top = jnp.max(masked, axis=1)
        idx = jnp.min(jnp.where(free_te & (masked == top[:, None]), col, width), axis=1)
        hit = col == idx[:, None]
        yield j, idx, hit
        free_te = free_te & ~hit
