"""Routing margins and their per-expert histogram: what the MoE router records each forward pass for Quantile
Balancing (`k3jax.training.balancing`, docs/spec.md#quantile-balancing).

With unbiased sigmoid scores s [m tokens, n experts] and the bias b that routed them, the margin of token i to expert
j is `r_ij = s_ij − α_i`, α_i the (k+1)-th largest biased score `s_i + b` of the token: under a bias b', token i
would keep expert j roughly iff r_ij > −b'_j. The histogram counts each expert's margins in fixed bins over a fixed
range, so it sums over token shards (one all-reduce of [n, num_bins] int32) and feeds the histogram quantile.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

DEFAULT_NUM_BINS = 256
DEFAULT_MARGIN_RANGE = (-1.0, 1.0)  # sigmoid scores are in (0, 1): with a small bias the margins are in (-1, 1)


def token_scores(scores: jax.Array) -> jax.Array:
    """Scores with leading batch dimensions flattened to tokens, f32 [m, n]."""
    return scores.reshape(-1, scores.shape[-1]).astype(jnp.float32)


def routing_margins(scores: jax.Array, bias: jax.Array, k: int) -> jax.Array:
    """r_ij = s_ij − α_i with α_i the (k+1)-th largest biased score of token i; f32 [m, n]."""
    s = token_scores(scores)
    n = s.shape[-1]
    if not 0 < k < n:
        raise ValueError(f"top-k needs 0 < k < n_experts, got k={k}, n={n}")
    biased = s + bias.astype(jnp.float32)
    alpha = jax.lax.top_k(biased, k + 1)[0][:, k]
    return s - alpha[:, None]


def margin_histogram(margins: jax.Array, *, num_bins: int = DEFAULT_NUM_BINS,
                     margin_range: tuple[float, float] = DEFAULT_MARGIN_RANGE,
                     axis_name: str | tuple[str, ...] | None = None) -> jax.Array:
    """Per-expert counts of margins in `num_bins` equal bins over `margin_range`; int32 [n, num_bins].

    Values outside the range land in the first / last bin. With `axis_name` the counts are summed over that mapped
    axis (`shard_map` / `vmap` / `pmap`), so every participant gets the histogram of all tokens.
    """
    lo, hi = margin_range
    r = margins.astype(jnp.float32)
    n = r.shape[-1]
    width = (hi - lo) / num_bins
    idx = jnp.clip(jnp.floor((r - lo) / width), 0, num_bins - 1).astype(jnp.int32)  # [m, n]
    flat = (idx + jnp.arange(n, dtype=jnp.int32)[None, :] * num_bins).reshape(-1)
    counts = jnp.zeros((n * num_bins,), jnp.int32).at[flat].add(1).reshape(n, num_bins)
    if axis_name is not None:
        counts = jax.lax.psum(counts, axis_name)
    return counts
