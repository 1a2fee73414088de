"""Next-token cross-entropy in f32."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax


def next_token_loss(logits_btv: jax.Array, targets_bt: jax.Array, mask_bt: jax.Array | None = None) -> jax.Array:
    """Mean cross-entropy over unmasked positions (logits upcast to f32)."""
    losses = optax.softmax_cross_entropy_with_integer_labels(logits_btv.astype(jnp.float32), targets_bt)
    if mask_bt is None:
        return losses.mean()
    mask = mask_bt.astype(jnp.float32)
    return (losses * mask).sum() / jnp.maximum(mask.sum(), 1.0)
