"""Block Attention Residuals kernels for decode-sized rows: `mix_norm` (the depth softmax read + the RMSNorm that
consumes it, in one launch)."""

from pallas_kernels.attn_res.mix_norm import BACKENDS, chunk_width, mix_norm

__all__ = ["BACKENDS", "chunk_width", "mix_norm"]
