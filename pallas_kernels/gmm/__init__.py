"""Grouped matmul for the latent MoE experts (`jax.lax.ragged_dot` semantics) with Pallas kernels for GPU and
TPU; one dispatch point: `gmm(..., backend=None)` and `tgmm(...)` (see api.py)."""

from pallas_kernels.gmm.api import BACKENDS, Tiling, default_backend, gmm, tgmm

__all__ = ["BACKENDS", "Tiling", "default_backend", "gmm", "tgmm"]
