"""Token sampling: pure functions over a batch of logits with per-sequence parameters and keys.

Order of operations (per row): temperature → top-k → top-p (nucleus, on the top-k-renormalised distribution) →
categorical draw. `temperature == 0` means greedy (argmax of the raw logits). `top_k <= 0` and `top_p >= 1` disable
those filters. All parameters are arrays (one value per sequence), so changing them never recompiles.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def greedy(logits_bv: jax.Array) -> jax.Array:
    """Argmax per row, int32[B] (lowest id on ties)."""
    return jnp.argmax(logits_bv, axis=-1).astype(jnp.int32)


def filter_logits(logits_bv: jax.Array, temperature_b: jax.Array, top_k_b: jax.Array,
                  top_p_b: jax.Array) -> jax.Array:
    """Temperature-scaled f32 logits with everything outside the top-k / top-p set at -inf.

    One descending sort per row. The kept set is {logit >= threshold} where the threshold is the smallest logit that
    top-k and top-p keep (so exact ties at the threshold are all kept). The most likely token is always kept.
    """
    logits = logits_bv.astype(jnp.float32)
    v = logits.shape[-1]
    t = jnp.where(temperature_b > 0, temperature_b, 1.0).astype(jnp.float32)
    scaled = logits / t[:, None]
    sorted_bv = -jnp.sort(-scaled, axis=-1)
    ranks = jnp.arange(v, dtype=jnp.int32)[None, :]
    k_b = jnp.where(top_k_b > 0, jnp.minimum(top_k_b, v), v).astype(jnp.int32)
    in_top_k = ranks < k_b[:, None]
    probs = jax.nn.softmax(jnp.where(in_top_k, sorted_bv, -jnp.inf), axis=-1)
    mass_before = jnp.cumsum(probs, axis=-1) - probs
    keep = in_top_k & (mass_before < top_p_b.astype(jnp.float32)[:, None])
    keep = keep.at[:, 0].set(True)
    n_keep = jnp.sum(keep, axis=-1).astype(jnp.int32)  # keep is a prefix of the sorted row
    threshold = jnp.take_along_axis(sorted_bv, (n_keep - 1)[:, None], axis=-1)
    return jnp.where(scaled >= threshold, scaled, -jnp.inf)


def sample(logits_bv: jax.Array, keys_b: jax.Array, temperature_b: jax.Array, top_k_b: jax.Array,
           top_p_b: jax.Array) -> jax.Array:
    """One token per row, int32[B]: greedy where temperature == 0, else a draw with that row's key."""
    filtered = filter_logits(logits_bv, temperature_b, top_k_b, top_p_b)
    drawn = jax.vmap(lambda key, row: jax.random.categorical(key, row))(keys_b, filtered).astype(jnp.int32)
    return jnp.where(temperature_b > 0, drawn, greedy(logits_bv))
