"""Causal softmax attention: the single dispatch point for MLA's attention core."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from k3jax.numerics import wide


def causal_attention(q_bthk: jax.Array, k_bthk: jax.Array, v_bthv: jax.Array, *, scale: float,
                     impl: str = "xla", segment_ids_bt: jax.Array | None = None) -> jax.Array:
    """softmax(q kᵀ · scale + causal mask) v with f32 logits and softmax; returns f32 [B, T, H, V].

    `segment_ids_bt` int [B, T] (optional, packed documents): a query also only sees keys with its own id, so
    equal ids must be contiguous (as the KDA resets assume). Every query still sees itself: no empty row.
    """
    if impl != "xla":
        raise ValueError(f"unknown attention impl {impl!r}; available: 'xla'")
    b, t = q_bthk.shape[:2]
    logits = jnp.einsum("bqhk,bshk->bhqs", q_bthk, k_bthk, preferred_element_type=wide(q_bthk.dtype)) * scale
    mask = jnp.tril(jnp.ones((t, t), dtype=bool))[None, None]  # [1, 1, T, T]
    if segment_ids_bt is not None:
        if segment_ids_bt.shape != (b, t):
            raise ValueError(f"attention: segment_ids must have shape [B, T] = {(b, t)}, got {segment_ids_bt.shape}")
        mask = mask & (segment_ids_bt[:, None, :, None] == segment_ids_bt[:, None, None, :])
    logits = jnp.where(mask, logits, -jnp.inf)
    probs = jax.nn.softmax(logits, axis=-1)
    return jnp.einsum("bhqs,bshv->bqhv", probs, v_bthv.astype(probs.dtype))
