"""Grouped matmul for the latent MoE experts (`jax.lax.ragged_dot` semantics) with Pallas kernels for GPU and
TPU; the backend is named by the caller (`k3jax.ops.gmm` picks it by platform, see api.py):
- `gmm` (differentiable) and `tgmm` (its weight gradient): api.py;
- `gmm_glu`: the fused expert up-projection act(x @ w_gate, x @ w_up), differentiable: glu.py;
- `gmm_mxfp4`: inference with MXFP4 weights decoded inside the kernel: quantized.py;
- `qat.mxfp4_fake_quant`: quantization-aware training's MXFP4-fake-quantized copy of the expert weights, written in
  the one pass that casts them for these kernels: qat.py."""

from pallas_kernels.gmm.api import (
    BACKENDS,
    DECODE_ROWS_PER_GROUP,
    DECODE_TILING,
    Tiling,
    gmm,
    tgmm,
)
from pallas_kernels.gmm.glu import gmm_glu
from pallas_kernels.gmm.quantized import gmm_mxfp4

__all__ = ["BACKENDS", "DECODE_ROWS_PER_GROUP", "DECODE_TILING", "Tiling",
           "gmm", "gmm_glu", "gmm_mxfp4", "tgmm"]
