"""Grouped matmul (rows grouped contiguously by expert): the single dispatch point for the MoE experts."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def gmm(lhs_mk: jax.Array, rhs_gkn: jax.Array, group_sizes_g: jax.Array, *, impl: str = "ragged_dot",
        preferred_element_type=None) -> jax.Array:
    """`jax.lax.ragged_dot` semantics: row block i (of size group_sizes[i]) is multiplied by rhs[i]."""
    if impl != "ragged_dot":
        raise ValueError(f"unknown gmm impl {impl!r}; available: 'ragged_dot'")
    return jax.lax.ragged_dot(lhs_mk, rhs_gkn, group_sizes_g.astype(jnp.int32),
                              preferred_element_type=preferred_element_type)
