"""Precision policy: the spec's "f32" means *at least* f32.

Math the spec marks f32 runs in `promote(dtype, float32)`: float32 for bf16/f32 models, float64 when a model is
built in float64 (tests use that to compare against float64 references without float32 noise).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def wide(dtype) -> jnp.dtype:
    """The accumulation/compute dtype for values stored as `dtype`: at least float32."""
    return jnp.promote_types(dtype, jnp.float32)


def upcast(x: jax.Array) -> jax.Array:
    """`x` in at least float32."""
    return x.astype(wide(x.dtype))
