"""RMSNorm with the released numerics (the KDA L2 norm is `k3jax.ops.kda.l2_normalize`)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from k3jax.layers import params
from k3jax.numerics import upcast


def rms_normalize(x: jax.Array, eps: float) -> jax.Array:
    """x_f32 * rsqrt(mean(x_f32^2) + eps), in (at least) float32 (no gain)."""
    x32 = upcast(x)
    return x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)


def rms_norm(x: jax.Array, weight: jax.Array, eps: float) -> jax.Array:
    """Released RMSNorm: `w * normalize(x_f32).astype(x.dtype)` (the gain is applied after the cast back)."""
    return weight * rms_normalize(x, eps).astype(x.dtype)


class RMSNorm(nnx.Module):
    """RMSNorm over the last axis; `weight` stored in `param_dtype` (f32 where the checkpoint stores f32)."""

    def __init__(self, size: int, *, eps: float, param_dtype, axis_name: str = "norm"):
        self.eps = eps
        self.weight = params.constant(1.0, (size,), (axis_name,), param_dtype)

    def __call__(self, x: jax.Array) -> jax.Array:
        return rms_norm(x, self.weight[...], self.eps)
