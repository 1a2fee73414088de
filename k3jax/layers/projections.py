"""The layers' input projections, computed in one place: ``{name: x @ w}`` for each weight a layer applies to
its (normed) input (KDA q, k, v, the decay gate's down projection, β and the output gate; MLA the query LoRA, the
latent and the output gate; the latent MoE its expert down projection and the shared experts' gate and up).

XLA's GPU dot merger already runs such siblings as one matmul over their concatenated weights, and reads that
concatenation in place inside the gemm fusion (no copy per step): concatenating the weights once ahead of time
measured no faster on an H200 (benchmarks/RESULTS.md, 2026-12-01 session 12), so they stay separate parameters.
"""

from __future__ import annotations

import functools

import jax
from flax import nnx

from k3jax.ops.linear import project as dense

__all__ = ["project_inputs"]


def project_inputs(module: nnx.Module, x: jax.Array, cfg) -> dict[str, jax.Array]:
    """``dense(x, module.<name>)`` for every name of ``module.input_projection_names()`` (a dotted name reaches
    into a child module: ``"shared_experts.gate_proj"``), by name, each shaped ``x.shape[:-1] + w.shape[1:]`` in
    x's dtype."""
    out = {}
    for name in module.input_projection_names():
        w = functools.reduce(getattr, name.split("."), module)
        out[name] = dense(x, w[...].astype(x.dtype), cfg)
    return out
