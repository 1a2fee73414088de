"""Paged MLA decode attention (issue 8): ``paged_latent_attention`` reads each sequence's latent pages once,
through its page table, with a flash-decoding online softmax (decode.py)."""

from pallas_kernels.mla.decode import (
    BACKENDS,
    DecodeConfig,
    gpu_compatible,
    paged_latent_attention,
)

__all__ = ["BACKENDS", "DecodeConfig", "gpu_compatible", "paged_latent_attention"]
