"""K3Model: embedding → decoder layers (repeating units scanned) → final AttnRes → norm → lm_head.

The residual stream is a carry `(h_btd, bank_nbtd)`: with Block AttnRes (K3) the bank holds the block snapshots
(fixed size, rows filled as layers run); with plain residuals (Kimi-Linear) the bank is an empty [0, B, T, D] array.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from k3jax.numerics import wide

from k3jax.config import LayerGroup, ModelConfig
from k3jax.layers import params
from k3jax.layers.attn_res import AttnResRead, push_snapshot, snapshots_before
from k3jax.layers.kda import KDA
from k3jax.layers.mla import MLA
from k3jax.layers.mlp import GatedMLP
from k3jax.layers.moe import LatentMoE
from k3jax.layers.norms import RMSNorm

Carry = tuple[jax.Array, jax.Array]  # (h_btd, bank_nbtd)


class DecoderLayer(nnx.Module):
    """One layer: attention (KDA or MLA) and FFN (dense or MoE), with AttnRes reads or plain residuals."""

    def __init__(self, cfg: ModelConfig, attn: str, ffn: str, *, rngs: nnx.Rngs):
        self.cfg = cfg
        pd = cfg.jnp_param_dtype
        self.input_layernorm = RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps, param_dtype=pd)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps, param_dtype=pd)
        self.self_attn = KDA(cfg, rngs=rngs) if attn == "kda" else MLA(cfg, rngs=rngs)
        self.mlp = GatedMLP(cfg, cfg.intermediate_size, rngs=rngs) if ffn == "dense" else LatentMoE(cfg, rngs=rngs)
        if cfg.uses_attn_res:
            self.self_attention_res = AttnResRead(cfg)
            self.mlp_res = AttnResRead(cfg)

    def __call__(self, carry: Carry, layer_index) -> Carry:
        h, bank = carry
        if not self.cfg.uses_attn_res:
            h = h + self.self_attn(self.input_layernorm(h)).astype(h.dtype)
            h = h + self.mlp(self.post_attention_layernorm(h)).astype(h.dtype)
            return h, bank
        block = self.cfg.attn_res_block_size
        filled = snapshots_before(layer_index, block)
        x = self.self_attention_res(h, bank, filled)
        is_snapshot = layer_index % block == 0
        bank = push_snapshot(bank, filled, h, is_snapshot)  # snapshot BEFORE this layer's attention
        partial = jnp.where(is_snapshot, jnp.zeros_like(h), h)
        partial = partial + self.self_attn(self.input_layernorm(x)).astype(h.dtype)
        x = self.mlp_res(partial, bank, filled + is_snapshot)
        partial = partial + self.mlp(self.post_attention_layernorm(x)).astype(h.dtype)
        return partial, bank


class DecoderUnit(nnx.Module):
    """The repeating unit (e.g. KDA, KDA, KDA, MLA) that a LayerGroup scans over."""

    def __init__(self, cfg: ModelConfig, pattern, *, rngs: nnx.Rngs):
        self.layers = nnx.List([DecoderLayer(cfg, attn, ffn, rngs=rngs) for attn, ffn in pattern])

    def __call__(self, carry: Carry, first_layer_index) -> Carry:
        for j, layer in enumerate(self.layers):
            carry = layer(carry, first_layer_index + j)
        return carry


class ScannedUnits(nnx.Module):
    """`group.num_repeats` stacked copies of a DecoderUnit (parameters get a leading 'layers' axis), run by scan."""

    def __init__(self, cfg: ModelConfig, group: LayerGroup, *, rngs: nnx.Rngs):
        self.group = group
        self.remat = cfg.remat

        @nnx.split_rngs(splits=group.num_repeats)
        @nnx.vmap(in_axes=(0,), out_axes=0, transform_metadata={nnx.PARTITION_NAME: "layers"})
        def make(rngs):
            return DecoderUnit(cfg, group.pattern, rngs=rngs)

        self.units = make(rngs)

    def __call__(self, carry: Carry) -> Carry:
        unit_len = len(self.group.pattern)
        starts = self.group.start + unit_len * jnp.arange(self.group.num_repeats, dtype=jnp.int32)

        def body(carry, unit, start):
            return unit(carry, start)

        if self.remat:
            body = nnx.remat(body)

        @nnx.scan(in_axes=(nnx.Carry, 0, 0), out_axes=nnx.Carry,
                  transform_metadata={nnx.PARTITION_NAME: "layers"})
        def run(carry, unit, start):
            return body(carry, unit, start)

        return run(carry, self.units, starts)


class K3Model(nnx.Module):
    """The K3 text backbone: `model(input_ids int32[B, T]) -> logits f32[B, T, V]`."""

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        self.cfg = cfg
        pd = cfg.jnp_param_dtype
        self.embed_tokens = params.normal(rngs, (cfg.vocab_size, cfg.hidden_size), ("vocab", "embed"), pd, std=1.0)
        groups = []
        for group in cfg.layer_groups():
            if group.num_repeats == 1:
                groups.append(DecoderUnit(cfg, group.pattern, rngs=rngs))
            else:
                groups.append(ScannedUnits(cfg, group, rngs=rngs))
        self.groups = nnx.List(groups)
        self.group_starts = tuple(g.start for g in cfg.layer_groups())
        if cfg.uses_attn_res:
            self.output_attn_res = AttnResRead(cfg)
        self.norm = RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps, param_dtype=pd)
        if not cfg.tie_word_embeddings:
            self.lm_head = params.normal(rngs, (cfg.hidden_size, cfg.vocab_size), ("embed", "vocab"), pd)

    def embed(self, input_ids_bt: jax.Array) -> jax.Array:
        return jnp.take(self.embed_tokens[...], input_ids_bt, axis=0).astype(self.cfg.jnp_dtype)

    def hidden_states(self, input_ids_bt: jax.Array) -> jax.Array:
        """Final normed hidden states [B, T, D] (before the head)."""
        cfg = self.cfg
        h = self.embed(input_ids_bt)
        b, t, d = h.shape
        bank = jnp.zeros((cfg.num_attn_res_snapshots, b, t, d), h.dtype)
        carry = (h, bank)
        for start, group in zip(self.group_starts, self.groups):
            carry = group(carry) if isinstance(group, ScannedUnits) else group(carry, start)
        h, bank = carry
        if cfg.uses_attn_res:
            h = self.output_attn_res(h, bank, cfg.num_attn_res_snapshots)
        return self.norm(h)

    def logits(self, h_btd: jax.Array) -> jax.Array:
        dt = self.cfg.jnp_dtype
        head = self.embed_tokens[...].T if self.cfg.tie_word_embeddings else self.lm_head[...]
        return jnp.einsum("btd,dv->btv", h_btd.astype(dt), head.astype(dt),
                          preferred_element_type=wide(dt))

    def __call__(self, input_ids_bt: jax.Array) -> jax.Array:
        return self.logits(self.hidden_states(input_ids_bt))
