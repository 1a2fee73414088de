"""Multi-token prediction (docs/spec.md#mtp): one DeepSeek-V3-style MTP layer used during pretraining.

For position i it combines the main model's final hidden state h_i with the embedding of the next token t_{i+1},
runs one extra decoder block (MLA attention + the model's FFN kind, plain residuals) and predicts t_{i+2} through the
main model's (shared) embedding and head:

    h'_i = Block(eh_proj · [RMSNorm(h_i); RMSNorm(Emb(t_{i+1}))]),   logits'_i = head(RMSNorm(h'_i))

The release ships no MTP weights (`num_nextn_predict_layers = 0`); training turns one on (`train.py --mtp`). It is a
separate module next to `K3Model`, so serving and conversion never see it; training checkpoints save it. Its loss
is `k3jax.training.loss.mtp_loss`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from k3jax.config import ModelConfig
from k3jax.layers import params
from k3jax.layers.norms import RMSNorm
from k3jax.model import DecoderLayer


class MTPLayer(nnx.Module):
    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        d, pd = cfg.hidden_size, cfg.runtime.jnp_param_dtype
        self.cfg = cfg
        self.hidden_norm = RMSNorm(d, eps=cfg.rms_norm_eps, param_dtype=pd)  # DeepSeek-V3 `hnorm`
        self.embed_norm = RMSNorm(d, eps=cfg.rms_norm_eps, param_dtype=pd)  # `enorm`
        self.eh_proj = params.normal(rngs, (2 * d, d), ("mtp_concat", "embed"), pd)
        ffn = "moe" if cfg.first_k_dense_replace < cfg.num_hidden_layers else "dense"
        block_cfg = cfg.replace(attn_res_block_size=None)  # one block: plain residuals
        self.block = DecoderLayer(block_cfg, "mla", ffn, rngs=rngs)
        self.norm = RMSNorm(d, eps=cfg.rms_norm_eps, param_dtype=pd)

    def __call__(self, h_btd: jax.Array, next_embed_btd: jax.Array,
                 segment_ids_bt: jax.Array | None = None) -> jax.Array:
        """The MTP hidden state (normed) for every position: [B, T, D]."""
        dt = self.cfg.runtime.jnp_dtype
        x = jnp.concatenate([self.hidden_norm(h_btd).astype(dt), self.embed_norm(next_embed_btd).astype(dt)], -1)
        x = x @ self.eh_proj[...].astype(dt)
        empty_bank = jnp.zeros((0,) + x.shape, x.dtype)
        h, _ = self.block((x, empty_bank), 0, segment_ids_bt)
        return self.norm(h)
