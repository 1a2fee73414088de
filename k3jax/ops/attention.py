"""Attention cores: causal softmax attention (MLA's training / prefill core) and the paged latent decode kernel
(MLA's absorbed one-token step, `pallas_kernels.mla`) with the choice of its backend."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from k3jax.numerics import wide
from k3jax.ops import backend as backend_lib
from pallas_kernels.mla import DecodeConfig, gpu_compatible, paged_latent_attention

__all__ = ["causal_attention", "mla_decode_backend", "paged_latent_decode"]


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


def mla_decode_backend(cfg, num_pages: int, page_size: int) -> str | None:
    """The paged decode kernel's backend for this trace, or None for the XLA gather path
    (`cfg.runtime.mla_decode_impl`): "auto" takes the kernel ("gpu") when the traced platform is a GPU and the
    pool suits Triton (kv_lora_rank, the rope width and page_size powers of two >= 16, < 2**31 elements);
    "pallas" takes it anywhere ("interpret" off GPU). Under a multi-device mesh (outside shard_map) the XLA path
    runs: GSPMD cannot partition a Pallas call."""
    if cfg.runtime.mla_decode_impl == "xla" or backend_lib.kernel_mesh() is not None:
        return None
    on_gpu = backend_lib.on_gpu()
    if cfg.runtime.mla_decode_impl == "pallas":
        return "gpu" if on_gpu else "interpret"
    fits = gpu_compatible(cfg.kv_lora_rank, cfg.qk_rope_head_dim, page_size, num_pages)
    return "gpu" if on_gpu and fits else None


def paged_latent_decode(q_bhc, pages_npc, page_table_bp, lengths_b, *, scale, latent_dim, backend, num_splits=0):
    """One query per sequence over its paged latent rows (`pallas_kernels.mla.paged_latent_attention`, on the
    backend from `mla_decode_backend`): positions 0 .. lengths_b - 1 read through the page table; returns the
    attended latent [B, H, latent_dim] f32. `num_splits`: page ranges per sequence (0 = auto)."""
    return paged_latent_attention(q_bhc, pages_npc, page_table_bp, lengths_b, scale=scale, latent_dim=latent_dim,
                                  backend=backend, config=DecodeConfig(num_splits=num_splits))
