"""The gated activations fused into `gmm_glu`'s epilogue, in f32 (elementwise jnp: runs inside the Triton and
Mosaic kernels and in the XLA path / the custom VJP's recompute).

situ: SiTU(g, u) = β1·tanh(g/β1)·sigmoid(g) · β2·tanh(u/β2) (docs/spec.md#situ; same formula as
      k3jax.layers.mlp.situ_glu; |out| < β1·β2; tends to SwiGLU as β1, β2 -> inf).
silu: silu(g)·u = g·sigmoid(g)·u (SwiGLU).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

ACTIVATIONS = ("situ", "silu")


def _sigmoid(x):
    return 1.0 / (1.0 + jnp.exp(-x))  # lowers everywhere (Triton, Mosaic); exp(-x) -> inf gives 0


def glu_f32(gate, up, activation: str, beta1: float | None, beta2: float | None):
    """act(gate, up) in f32 for f32 inputs."""
    if activation == "situ":
        return (beta1 * jnp.tanh(gate / beta1) * _sigmoid(gate)) * (beta2 * jnp.tanh(up / beta2))
    if activation == "silu":
        return gate * _sigmoid(gate) * up
    raise ValueError(f"unknown gmm_glu activation {activation!r}; available: {', '.join(ACTIVATIONS)}")


def glu_vjp_f32(gate, up, d_out, activation: str, beta1, beta2):
    """(d_gate, d_up) of `glu_f32` at (gate, up) for the cotangent d_out, all f32 (autodiff of the formula)."""
    _, pull = jax.vjp(lambda g, u: glu_f32(g, u, activation, beta1, beta2), gate, up)
    return pull(d_out)
