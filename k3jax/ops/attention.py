"""Causal softmax attention: the single dispatch point for MLA's attention core."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from k3jax.numerics import wide


def causal_attention(q_bthk: jax.Array, k_bthk: jax.Array, v_bthv: jax.Array, *, scale: float,
                     impl: str = "xla") -> jax.Array:
    """softmax(q kᵀ · scale + causal mask) v with f32 logits and softmax; returns f32 [B, T, H, V]."""
    if impl != "xla":
        raise ValueError(f"unknown attention impl {impl!r}; available: 'xla'")
    t = q_bthk.shape[1]
    logits = jnp.einsum("bqhk,bshk->bhqs", q_bthk, k_bthk, preferred_element_type=wide(q_bthk.dtype)) * scale
    causal = jnp.tril(jnp.ones((t, t), dtype=bool))
    logits = jnp.where(causal[None, None], logits, -jnp.inf)
    probs = jax.nn.softmax(logits, axis=-1)
    return jnp.einsum("bhqs,bshv->bqhv", probs, v_bthv.astype(probs.dtype))
