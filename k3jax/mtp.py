"""Multi-token prediction (docs/spec.md#mtp): one DeepSeek-V3-style MTP layer used during pretraining.

For position i it combines the main model's final hidden state h_i with the embedding of the next token t_{i+1},
runs one extra decoder block (MLA attention + the model's FFN kind, plain residuals) and predicts t_{i+2} through the
main model's (shared) embedding and head:

    h'_i = Block(eh_proj · [RMSNorm(h_i); RMSNorm(Emb(t_{i+1}))]),   logits'_i = head(RMSNorm(h'_i))

The release ships no MTP weights (`num_nextn_predict_layers = 0`); training turns one on (`train.py --mtp`). It is a
separate module next to `K3Model`; training checkpoints save it and its loss is `k3jax.training.loss.mtp_loss`.
`forward_cached` runs it incrementally over its own MLA latent pages: the speculative-decoding draft
(`k3jax.inference.drafts.MTPDraft`).
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

    def _fuse(self, h_btd: jax.Array, next_embed_btd: jax.Array) -> jax.Array:
        """eh_proj · [RMSNorm(h); RMSNorm(Emb(t_{i+1}))]: the block's input [B, T, D]."""
        dt = self.cfg.runtime.jnp_dtype
        x = jnp.concatenate([self.hidden_norm(h_btd).astype(dt), self.embed_norm(next_embed_btd).astype(dt)], -1)
        return x @ self.eh_proj[...].astype(dt)

    def __call__(self, h_btd: jax.Array, next_embed_btd: jax.Array,
                 segment_ids_bt: jax.Array | None = None) -> jax.Array:
        """The MTP hidden state (normed) for every position: [B, T, D]."""
        x = self._fuse(h_btd, next_embed_btd)
        h, _ = self.block((x, jnp.zeros((0,) + x.shape, x.dtype)), 0, segment_ids_bt)
        return self.norm(h)

    def forward_cached(self, h_btd: jax.Array, next_embed_btd: jax.Array, pages_npc: jax.Array,
                       page_table_bp: jax.Array, start_b: jax.Array, valid_len_b: jax.Array
                       ) -> tuple[jax.Array, jax.Array]:
        """`__call__` for T new positions per sequence continuing the block's latent pages (the MLA cache of
        `MLA.forward_cached`: position start_b[b] + t, only the first valid_len_b[b] rows written).
        Returns (hidden [B, T, D] normed, new pages)."""
        x = self._fuse(h_btd, next_embed_btd)
        (h, _), pages_npc = self.block.forward_cached((x, jnp.zeros((0,) + x.shape, x.dtype)), 0, pages_npc,
                                                      start_b, valid_len_b, page_table_bp)
        return self.norm(h), pages_npc
