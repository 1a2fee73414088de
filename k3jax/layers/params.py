"""Parameter creation with logical axis names (resolved to mesh axes only in `sharding/rules.py`)."""

from __future__ import annotations

import math
from typing import Sequence

import jax
import jax.numpy as jnp
from flax import nnx


class RouterBias(nnx.Variable):
    """Expert-selection bias (`e_score_correction_bias`): training state updated by Quantile Balancing, not a
    gradient parameter."""


class RoutingStats(nnx.Variable):
    """Per-step routing statistics a MoE layer records during its forward pass (margin histogram, expert loads):
    read by Quantile Balancing and the training metrics; neither a parameter nor part of the released weights."""


def normal(rngs: nnx.Rngs, shape: Sequence[int], axes: Sequence[str | None], dtype, *, fan_in: int | None = None,
           std: float | None = None) -> nnx.Param:
    """Truncation-free normal init: std = `std` if given, else 1/sqrt(fan_in) (fan_in defaults to shape[0])."""
    if std is None:
        std = 1.0 / math.sqrt(fan_in if fan_in is not None else shape[0])
    value = (std * jax.random.normal(rngs.params(), tuple(shape), jnp.float32)).astype(dtype)
    return nnx.Param(value, out_sharding=tuple(axes), eager_sharding=False)


def constant(value: float, shape: Sequence[int], axes: Sequence[str | None], dtype) -> nnx.Param:
    return nnx.Param(jnp.full(tuple(shape), value, dtype), out_sharding=tuple(axes), eager_sharding=False)


def from_array(value: jax.Array, axes: Sequence[str | None]) -> nnx.Param:
    return nnx.Param(value, out_sharding=tuple(axes), eager_sharding=False)


def router_bias(num_experts: int, dtype=jnp.float32) -> RouterBias:
    """Zero-initialised f32 selection bias, one per expert."""
    return RouterBias(jnp.zeros((num_experts,), dtype), out_sharding=("experts_router",), eager_sharding=False)


def routing_stats(shape: Sequence[int], axes: Sequence[str | None], dtype) -> RoutingStats:
    return RoutingStats(jnp.zeros(tuple(shape), dtype), out_sharding=tuple(axes), eager_sharding=False)
