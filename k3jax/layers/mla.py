"""Gated Multi-head Latent Attention with NoPE (K3_SPEC.md §3.3).

q from a LoRA (or a plain projection for Kimi-Linear); keys/values from a 512-wide normalised latent plus one
64-wide key part `k_r` shared by all heads and never rotated; scale (nope + rope)^-0.5; sigmoid output gate.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from k3jax.numerics import upcast

from k3jax.config import ModelConfig
from k3jax.layers import params
from k3jax.layers.norms import RMSNorm
from k3jax.ops.attention import causal_attention


class MLA(nnx.Module):
    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        self.cfg = cfg
        d, h, pd = cfg.hidden_size, cfg.num_attention_heads, cfg.jnp_param_dtype
        qk, nope, vd = cfg.qk_head_dim, cfg.qk_nope_head_dim, cfg.v_head_dim
        if cfg.q_lora_rank is None:
            self.q_proj = params.normal(rngs, (d, h, qk), ("embed", "heads", "head_dim"), pd)
        else:
            self.q_a_proj = params.normal(rngs, (d, cfg.q_lora_rank), ("embed", "q_lora"), pd)
            self.q_a_layernorm = RMSNorm(cfg.q_lora_rank, eps=cfg.mla_lora_norm_eps, param_dtype=pd)
            self.q_b_proj = params.normal(rngs, (cfg.q_lora_rank, h, qk), ("q_lora", "heads", "head_dim"), pd)
        self.kv_a_proj_with_mqa = params.normal(
            rngs, (d, cfg.kv_lora_rank + cfg.qk_rope_head_dim), ("embed", "kv_lora"), pd)
        self.kv_a_layernorm = RMSNorm(cfg.kv_lora_rank, eps=cfg.mla_lora_norm_eps, param_dtype=pd)
        self.kv_b_proj = params.normal(rngs, (cfg.kv_lora_rank, h, nope + vd), ("kv_lora", "heads", "head_dim"), pd)
        if cfg.mla_use_output_gate:
            self.g_proj = params.normal(rngs, (d, h, vd), ("embed", "heads", "head_dim"), pd)
        self.o_proj = params.normal(rngs, (h, vd, d), ("heads", "head_dim", "embed"), pd, fan_in=h * vd)

    def latent(self, x_btd: jax.Array) -> jax.Array:
        """The per-token cache row: [kv_a_layernorm(latent) | k_r], width kv_lora_rank + qk_rope_head_dim."""
        dt = self.cfg.jnp_dtype
        c = x_btd.astype(dt) @ self.kv_a_proj_with_mqa[...].astype(dt)
        lat, k_r = c[..., :self.cfg.kv_lora_rank], c[..., self.cfg.kv_lora_rank:]
        return jnp.concatenate([self.kv_a_layernorm(lat), k_r], axis=-1)

    def queries(self, x_btd: jax.Array) -> jax.Array:
        dt = self.cfg.jnp_dtype
        x = x_btd.astype(dt)
        if self.cfg.q_lora_rank is None:
            return jnp.einsum("btd,dhk->bthk", x, self.q_proj[...].astype(dt))
        q_lat = self.q_a_layernorm(x @ self.q_a_proj[...].astype(dt))
        return jnp.einsum("btr,rhk->bthk", q_lat, self.q_b_proj[...].astype(dt))

    def __call__(self, x_btd: jax.Array) -> jax.Array:
        cfg, dt = self.cfg, self.cfg.jnp_dtype
        h, nope = cfg.num_attention_heads, cfg.qk_nope_head_dim
        q_bthk = self.queries(x_btd)
        cache_btc = self.latent(x_btd)
        lat, k_r = cache_btc[..., :cfg.kv_lora_rank], cache_btc[..., cfg.kv_lora_rank:]
        kv_bthe = jnp.einsum("btr,rhe->bthe", lat, self.kv_b_proj[...].astype(dt))
        k_nope, v_bthv = kv_bthe[..., :nope], kv_bthe[..., nope:]
        k_rope = jnp.broadcast_to(k_r[:, :, None, :], k_r.shape[:2] + (h, cfg.qk_rope_head_dim))
        k_bthk = jnp.concatenate([k_nope, k_rope], axis=-1)
        o_bthv = causal_attention(q_bthk, k_bthk, v_bthv, scale=cfg.qk_head_dim ** -0.5)  # f32
        if cfg.mla_use_output_gate:
            gate = jnp.einsum("btd,dhv->bthv", x_btd.astype(dt), self.g_proj[...].astype(dt))
            o_bthv = o_bthv * jax.nn.sigmoid(upcast(gate))
        return jnp.einsum("bthv,hvd->btd", o_bthv.astype(dt), self.o_proj[...].astype(dt))
