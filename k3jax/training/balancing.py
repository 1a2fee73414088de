"""Quantile Balancing of the MoE router bias (docs/spec.md#quantile-balancing, report Eq 13–14).

Per MoE layer per step, on the tokens just routed (m tokens, n experts, top-k), with unbiased sigmoid scores s and
the bias b that routed them:

1. `biased = s + b`; per token the top-(k+1) biased values; the (k+1)-th is the cutoff α_i;
2. margins `r_ij = s_ij − α_i` (raw score minus the biased cutoff): under a bias b', token i would keep expert j
   roughly iff s_ij + b'_j > α_i, i.e. iff r_ij > −b'_j (`k3jax.layers.routing`, which the router records with);
3. `b̂_j = −quantile_{1−k/n}(r_:,j)`: then a fraction k/n of the tokens — the target load k·m/n — clears expert j's
   threshold;
4. `b_next = b̂ − mean(b̂)` (top-k is shift invariant), used from the next step on.

Two estimators of the quantile:

- `quantile_balancing_bias`: exact, sort-based (`jnp.quantile`, linear interpolation), for one device's tokens.
- `quantile_balancing_bias_histogram`: scalable: a fixed-bin histogram of each expert's margins over a fixed range
  (`num_bins` bins), the counts summed over `axis_name` with `jax.lax.psum` (one all-reduce of [n, num_bins]
  int32), the quantile by linear interpolation inside the bin holding the target rank. The estimate lies in the
  same bin as that order statistic (so within one bin width of it) as long as it falls inside the range; margins
  outside the range are clamped into the end bins.

Everything here is a pure, jittable function of arrays (no LAPACK ops). Scores with leading batch dimensions are
flattened to tokens; for scan-stacked layers (`router_bias` of shape [layers, n]) `jax.vmap` over the layer axis.
Group-limited routing (`num_expert_group > 1`) is not modelled: the cutoff is the plain top-(k+1) over all experts.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from k3jax.layers.moe import LatentMoE
from k3jax.layers.routing import DEFAULT_MARGIN_RANGE, DEFAULT_NUM_BINS, margin_histogram, routing_margins


def quantile_balancing_bias(scores: jax.Array, bias: jax.Array, k: int) -> jax.Array:
    """Next router bias from this step's scores (exact quantile: sort-based, linear interpolation). f32 [n]."""
    r = routing_margins(scores, bias, k)
    q = 1.0 - k / r.shape[-1]
    b_hat = -jnp.quantile(r, q, axis=0, method="linear")
    return b_hat - b_hat.mean()


def histogram_quantile(counts: jax.Array, q: float | jax.Array, *,
                       margin_range: tuple[float, float] = DEFAULT_MARGIN_RANGE) -> jax.Array:
    """The q-quantile of each row of a histogram [n, num_bins]; f32 [n].

    Uses the same rank as `jnp.quantile(..., method='linear')`: the (1-based, fractional) rank c = q·(M−1) + 1 of
    the M counted values. The bin b with cum[b−1] < c ≤ cum[b] holds that order statistic; inside it the values are
    taken as evenly spread, so the estimate is `lo_b + width·(c − cum[b−1]) / counts[b]`.
    """
    lo, hi = margin_range
    num_bins = counts.shape[-1]
    width = (hi - lo) / num_bins
    counts = counts.astype(jnp.float32)
    cum = jnp.cumsum(counts, axis=-1)
    total = cum[:, -1]
    c = q * jnp.maximum(total - 1.0, 0.0) + 1.0  # [n]
    b = jnp.clip(jnp.sum(cum < c[:, None], axis=-1), 0, num_bins - 1)  # first bin with cum >= c
    below = jnp.take_along_axis(cum, b[:, None], axis=-1)[:, 0] - jnp.take_along_axis(counts, b[:, None], axis=-1)[:, 0]
    in_bin = jnp.take_along_axis(counts, b[:, None], axis=-1)[:, 0]
    frac = jnp.clip((c - below) / jnp.maximum(in_bin, 1.0), 0.0, 1.0)
    return lo + width * (b.astype(jnp.float32) + frac)


def quantile_balancing_bias_histogram(scores: jax.Array, bias: jax.Array, k: int, *,
                                      num_bins: int = DEFAULT_NUM_BINS,
                                      margin_range: tuple[float, float] = DEFAULT_MARGIN_RANGE,
                                      axis_name: str | tuple[str, ...] | None = None) -> jax.Array:
    """Next router bias from this step's scores, quantile from a histogram of margins (summed over `axis_name`
    when given: call it inside `shard_map` / `vmap(axis_name=...)` over token shards). f32 [n]."""
    r = routing_margins(scores, bias, k)
    counts = margin_histogram(r, num_bins=num_bins, margin_range=margin_range, axis_name=axis_name)
    b_hat = -histogram_quantile(counts, 1.0 - k / r.shape[-1], margin_range=margin_range)
    return b_hat - b_hat.mean()


def next_bias_from_counts(counts_ne: jax.Array, k: int) -> jax.Array:
    """Quantile Balancing's next bias from a margin histogram [..., n, num_bins] (leading axes: stacked layers)."""
    n, num_bins = counts_ne.shape[-2:]
    flat = counts_ne.reshape(-1, n, num_bins)
    b_hat = -jax.vmap(lambda c: histogram_quantile(c, 1.0 - k / n))(flat)
    b_next = b_hat - b_hat.mean(axis=-1, keepdims=True)
    return b_next.reshape(counts_ne.shape[:-1])


def moe_layers(model) -> list:
    """Every MoE layer module of `model` that records routing statistics (stacked scan copies count once)."""
    return [m for _, m in nnx.iter_graph(model)
            if isinstance(m, LatentMoE) and hasattr(m, "margin_counts")]


def apply_quantile_balancing(model) -> None:
    """Sets every MoE layer's router bias from the margin histogram its last forward pass recorded (in place;
    call after the optimizer step inside the jitted train step, so the new bias routes the next step's tokens).
    The histogram was computed over the whole global batch: under a mesh, GSPMD sums the per-shard counts."""
    for moe in moe_layers(model):
        k = moe.cfg.num_experts_per_token
        moe.router_bias[...] = next_bias_from_counts(moe.margin_counts[...], k).astype(moe.router_bias.dtype)


def routing_load_metrics(model) -> dict[str, jax.Array]:
    """max/mean expert load over all MoE layers of the last forward pass: the worst layer and the average."""
    ratios = []
    for moe in moe_layers(model):
        loads = moe.expert_loads[...]
        loads = loads.reshape(-1, loads.shape[-1])
        ratios.append(loads.max(-1) / jnp.maximum(loads.mean(-1), 1e-9))
    if not ratios:
        return {}
    r = jnp.concatenate(ratios)
    return {"expert_load_max_over_mean": r.max(), "expert_load_max_over_mean_avg": r.mean()}
