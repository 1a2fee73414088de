"""The training losses in f32: next-token cross-entropy and the MTP layer's t+2 cross-entropy."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax

from k3jax.mtp import MTPLayer


def next_token_loss(logits_btv: jax.Array, targets_bt: jax.Array, mask_bt: jax.Array | None = None, *,
                    denominator: jax.Array | None = None) -> jax.Array:
    """Mean cross-entropy over unmasked positions (logits upcast to f32). `denominator`: divide the masked sum by
    this token count instead of this batch's own (a micro-batch's share of a whole batch's mean)."""
    losses = optax.softmax_cross_entropy_with_integer_labels(logits_btv.astype(jnp.float32), targets_bt)
    return masked_mean(losses, mask_bt, denominator=denominator)


def masked_mean(losses: jax.Array, mask_bt: jax.Array | None = None, *,
                denominator: jax.Array | None = None) -> jax.Array:
    """Mean of per-token losses over unmasked positions, or their masked sum / `denominator`."""
    if mask_bt is None:
        return losses.mean() if denominator is None else losses.sum() / denominator
    mask = mask_bt.astype(jnp.float32)
    count = jnp.maximum(mask.sum(), 1.0) if denominator is None else denominator
    return (losses * mask).sum() / count


def token_counts(targets_bt: jax.Array, loss_mask_bt: jax.Array) -> dict[str, jax.Array]:
    """The LM and MTP losses' token counts of a whole batch (>= 1), f32: the denominators its micro-batches'
    losses share under gradient accumulation."""
    mtp_mask = mtp_targets(targets_bt, loss_mask_bt)[1]
    return {"lm_tokens": jnp.maximum(loss_mask_bt.astype(jnp.float32).sum(), 1.0),
            "mtp_tokens": jnp.maximum(mtp_mask.astype(jnp.float32).sum(), 1.0)}


def mtp_targets(targets_bt: jax.Array, loss_mask_bt: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Targets t_{i+2} for position i and their mask: valid where both i → i+1 and i+1 → i+2 are in-document
    predictions (so i, i+1 and i+2 are one document); the last position has none."""
    tgt = jnp.concatenate([targets_bt[:, 1:], jnp.zeros_like(targets_bt[:, :1])], axis=1)
    mask = loss_mask_bt.astype(bool)
    mask = jnp.concatenate([mask[:, :-1] & mask[:, 1:], jnp.zeros_like(mask[:, :1])], axis=1)
    return tgt, mask


def mtp_loss(model, mtp: MTPLayer, h_btd: jax.Array, targets_bt: jax.Array, loss_mask_bt: jax.Array,
             segment_ids_bt: jax.Array | None = None, *, denominator: jax.Array | None = None) -> jax.Array:
    """Cross-entropy of the MTP layer's t_{i+2} predictions (the embedding of t_{i+1} is `targets[i]`)."""
    h_mtp = mtp(h_btd, model.embed(targets_bt), segment_ids_bt)
    tgt, mask = mtp_targets(targets_bt, loss_mask_bt)
    return masked_mean(model.token_losses(h_mtp, tgt), mask, denominator=denominator)
