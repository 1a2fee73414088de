"""The gated activations (SiTU-GLU, SiLU-GLU) and the experts' grouped gated up-projection `grouped_glu`, shared
by the MLP / MoE layers and the expert-parallel form (`sharding.expert_parallel`)."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from k3jax.config import ModelConfig
from k3jax.numerics import upcast
from k3jax.ops import gmm as gmm_ops
from k3jax.ops.mx_quant import expert_activation_qat

__all__ = ["glu", "grouped_glu", "silu_glu", "situ_glu"]


def situ_glu(gate: jax.Array, up: jax.Array, beta1: float, beta2: float) -> jax.Array:
    """SiTU(g, u) = b1·tanh(g/b1)·sigmoid(g) · b2·tanh(u/b2), in f32 (|out| < b1·b2); -> SwiGLU as b1, b2 -> inf."""
    g = upcast(gate)
    u = upcast(up)
    return beta1 * jnp.tanh(g / beta1) * jax.nn.sigmoid(g) * (beta2 * jnp.tanh(u / beta2))


def silu_glu(gate: jax.Array, up: jax.Array) -> jax.Array:
    return jax.nn.silu(gate) * up


def glu(gate: jax.Array, up: jax.Array, cfg: ModelConfig) -> jax.Array:
    """The config's gated activation; returns the input dtype."""
    if cfg.hidden_act == "situ":
        return situ_glu(gate, up, cfg.activation_situ_beta, cfg.activation_situ_linear_beta).astype(gate.dtype)
    return silu_glu(gate, up)


def grouped_glu(rows_mk: jax.Array, w_gate, w_up, group_sizes_g: jax.Array, cfg: ModelConfig,
                impl: str = "auto", tiling=None) -> jax.Array:
    """The experts' gated up-projection act(rows @ w_gate[e], rows @ w_up[e]) per expert row group, in the rows'
    dtype. Decode-sized calls on a kernel backend run the fused kernel (`k3jax.ops.gmm.gmm_glu`: one launch,
    pre-activations kept in f32); otherwise two grouped matmuls (pre-activations rounded to the rows' dtype, as
    the released model) and `glu`. `impl`, `tiling`: as `k3jax.ops.gmm.gmm`. The result is the down projection's
    input, MXFP8-fake-quantized under `cfg.runtime.expert_act_qat` (`k3jax.ops.mx_quant`)."""
    if gmm_ops.fused_glu_applies(rows_mk.shape[0], w_gate, impl):
        situ = cfg.hidden_act == "situ"
        hidden = gmm_ops.gmm_glu(rows_mk, w_gate, w_up, group_sizes_g, activation=cfg.hidden_act,
                                 beta1=cfg.activation_situ_beta if situ else None,
                                 beta2=cfg.activation_situ_linear_beta if situ else None, impl=impl, tiling=tiling)
    else:
        hidden = glu(gmm_ops.gmm(rows_mk, w_gate, group_sizes_g, impl=impl, tiling=tiling),
                     gmm_ops.gmm(rows_mk, w_up, group_sizes_g, impl=impl, tiling=tiling), cfg)
    return expert_activation_qat(hidden, cfg)
