"""`Eagle3Draft`: the EAGLE-3 layer (`k3jax.eagle3.Eagle3Layer`) as a speculative-decoding draft."""

from __future__ import annotations

import jax
from flax import nnx

from k3jax.eagle3 import Eagle3Layer, block_features
from k3jax.inference.drafts import MTPDraft, MTPState
from k3jax.model import AttnResBlocks, K3Model


class Eagle3Draft(MTPDraft):
    """`MTPDraft`'s incremental scheme (its own MLA latent pages; `observe` writes the rows of the positions the
    target consumed from the target's real features; drafts 2..k chain on the draft's own output, rows rewritten by
    the next `observe`) with g = W_E3 · [block outputs] in place of the target's final hidden state: exactly the
    attention pattern `Eagle3Layer.unrolled` trains with. The engine hands `observe` the target's block outputs
    (`uses_blocks`). Greedy rows draft greedily; sampled rows draw from the filtered draft distribution."""

    uses_blocks = True

    def __init__(self, layer: Eagle3Layer, num_tokens: int):
        super().__init__(layer, num_tokens)
        self.feature_blocks = layer.feature_blocks

    def target_features(self, h_btd: jax.Array, blocks: AttnResBlocks | None) -> jax.Array:
        """The chosen block outputs side by side [B, T, 3D] (`k3jax.eagle3.block_features`)."""
        if blocks is None:
            raise ValueError("the EAGLE-3 draft needs the target's AttnRes block outputs (uses_blocks)")
        return block_features(blocks, self.feature_blocks)

    def observe(self, params, state: MTPState, target: K3Model, feats_btf, next_ids_bt, start_b, valid_b,
                page_table_bp) -> MTPState:
        g_btd = nnx.merge(self.graphdef, params).fuse_features(feats_btf)
        return super().observe(params, state, target, g_btd, next_ids_bt, start_b, valid_b, page_table_bp)
