"""Backward-pass ordering: a layer's weight gradients are computed before its input gradient flows on.

Inside one backward (a scanned unit's body, or the unscanned layers), nothing in the data flow asks for a layer's
weight gradients until the very end, where they are written to the gradient outputs. XLA's GPU scheduler then
ran the weight-gradient kernels of every layer of a unit (the experts' `tgmm`, the projections' dW dots, the
norm-gain reductions) after the unit's LAST layer's backward, keeping each layer's recomputed activations and
output gradients alive until then: in the `k3_gpu` step at T = 131,072 (`benchmarks/hlo_liveness.py` on the
GPU dump, benchmarks/RESULTS.md, 2026-12-05) ~7.5 GiB of routed-expert rows per MoE layer, held across the
unit's other layers by the deferred `tgmm` calls, plus their dW dots and reductions.

`tie_gradients(tree)` is the identity forward; in the backward its first cotangent takes a data dependence on all
the others (with an optimization barrier alone the compiled GPU step's memory did not move, 150.39 against
150.18 GiB: the barrier does not order XLA:GPU's schedule). Applied to (the layer's input carry, its
parameters) at a layer's entry, the input gradient that the previous layer's backward needs cannot exist before
this layer's weight gradients do: the scheduler must finish them, and free their operands, layer by layer.
Values and gradients are unchanged (exactly, unless a gradient holds inf/NaN).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

__all__ = ["tie_gradients"]


def _is_float(x) -> bool:
    return hasattr(x, "dtype") and jnp.issubdtype(x.dtype, jnp.inexact)


def tie_gradients(tree):
    """`tree` unchanged; in the backward its first floating leaf's cotangent depends on all the others' (see
    `_tie_bwd`). Non-floating leaves pass through untouched (they have no cotangent)."""
    leaves, treedef = jax.tree.flatten(tree)
    where = [i for i, x in enumerate(leaves) if _is_float(x)]
    if len(where) < 2:
        return tree
    tied = _tie([leaves[i] for i in where])
    for i, x in zip(where, tied):
        leaves[i] = x
    return jax.tree.unflatten(treedef, leaves)


@jax.custom_vjp
def _tie(xs: list) -> list:
    return xs


def _tie_fwd(xs):
    return xs, None


def _tie_bwd(_, cts):
    # An optimization barrier over the cotangents did not order XLA:GPU's schedule (the module docstring), so the
    # first cotangent (a layer's input gradient, by the caller's order) takes a data dependence on every other
    # one: + 0 × (one element of each), added to its first element only. Exact (adds +0.0) unless a gradient holds
    # inf/NaN, which then reaches that element too.
    cts = list(cts)
    first, others = cts[0], [c.reshape(-1)[0].astype(jnp.float32) for c in cts[1:] if c.size]
    if first.size and others:
        cts[0] = first.at[(0,) * first.ndim].add((sum(others) * 0.0).astype(first.dtype))
    return (cts,)


_tie.defvjp(_tie_fwd, _tie_bwd)
