"""Routing plan for decode-sized MoE calls in one launch: top-k selection and the expert-sorted row layout.

The dropless MoE sorts the N·k (token, expert) assignments by expert so the grouped matmuls see each expert's rows
contiguously. In XLA a decode step spends about ten small kernels per MoE layer on that (sigmoid + bias, a top-k
sort, an argsort of the assignments, a bincount scatter, gathers and slices). This kernel computes, for N tokens and
E experts in one program:
- ``experts [N, k]``: the top-k of ``sigmoid(logits) + bias`` per token (the bias only selects; ties go to the
  lower expert index, as `jax.lax.top_k`), found by k rounds of max / first-argmax;
- ``group_sizes [E]``: assignments per expert;
- ``rows [N, k]``: the row of each assignment in the expert-sorted order of a *stable* sort of the flat assignment
  list by expert, i.e. ``offset[e] + #(tokens n' < n that chose e)`` (a token picks an expert at most once): an
  exclusive cumulative sum over tokens of the int32 [N, E] choice matrix plus the exclusive cumulative sum of the
  group sizes (integer scans: exact, no [N, N] matrix in shared memory).
The combine weights are left to the caller (a differentiable gather of the scores at ``experts``).

Triton backend on GPU (``backend="gpu"``), the Pallas interpreter on CPU (``"interpret"``, tests). N and E are
padded to powers of two >= 16 inside (padded tokens choose nothing, padded experts are never chosen).
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels.kda.chunk_fwd import triton_params

__all__ = ["BACKENDS", "MAX_EXPERTS", "MAX_TOKENS", "RoutePlan", "route_plan"]

BACKENDS = ("gpu", "interpret")
MAX_TOKENS = 256  # one program holds [N, N] and [N, E] tiles: decode sizes only
MAX_EXPERTS = 256
_F32 = jnp.float32


class RoutePlan(NamedTuple):
    experts_nk: jax.Array  # int32 [N, k]: chosen experts, best first
    rows_nk: jax.Array  # int32 [N, k]: row of each assignment in the expert-sorted layout
    group_sizes_e: jax.Array  # int32 [E]: assignments per expert


def _pow2_at_least_16(n: int) -> int:
    return max(16, 1 << max(int(n) - 1, 0).bit_length())


def route_plan(logits_ne: jax.Array, bias_e: jax.Array, k: int, *, backend: str = "gpu") -> RoutePlan:
    """Top-k of ``sigmoid(logits) + bias`` per token and the expert-sorted row plan (see the module doc)."""
    if backend not in BACKENDS:
        raise ValueError(f"route_plan: unknown backend {backend!r}; expected one of {BACKENDS}")
    if logits_ne.ndim != 2 or bias_e.shape != logits_ne.shape[1:]:
        raise ValueError(f"route_plan: expected logits [N, E] and bias [E], got {logits_ne.shape} and "
                         f"{bias_e.shape}")
    n, e = logits_ne.shape
    if not 1 <= k <= e:
        raise ValueError(f"route_plan: k={k} must be in [1, E={e}]")
    if n > MAX_TOKENS or e > MAX_EXPERTS:
        raise ValueError(f"route_plan: decode sizes only (N <= {MAX_TOKENS}, E <= {MAX_EXPERTS}), got N={n}, "
                         f"E={e}")
    np_, ep = _pow2_at_least_16(n), _pow2_at_least_16(e)
    logits = jnp.pad(logits_ne.astype(_F32), ((0, np_ - n), (0, ep - e)))
    bias = jnp.pad(bias_e.astype(_F32), (0, ep - e))
    experts, rows, sizes = _plan_call(logits, bias, n=n, e=e, k=int(k), interpret=backend == "interpret")
    return RoutePlan(experts[:n], rows[:n], sizes[:e])


@functools.partial(jax.jit, static_argnames=("n", "e", "k", "interpret"))
def _plan_call(logits_ne, bias_e, *, n: int, e: int, k: int, interpret: bool):
    np_, ep = logits_ne.shape

    def kernel(logits_ref, bias_ref, experts_ref, rows_ref, sizes_ref):
        col = jax.lax.broadcasted_iota(jnp.int32, (np_, ep), 1)
        tok = jax.lax.broadcasted_iota(jnp.int32, (np_, ep), 0)
        x = logits_ref[...]
        biased = 1.0 / (1.0 + jnp.exp(-x)) + bias_ref[...][None, :]
        biased = jnp.where(col < e, biased, -jnp.inf)
        real = tok < n
        chosen = []
        choice = jnp.zeros((np_, ep), jnp.int32)  # 1 where token n chose expert e (real tokens only)
        for _ in range(k):
            top = jnp.max(biased, axis=1)
            idx = jnp.min(jnp.where(biased == top[:, None], col, ep), axis=1)  # first index of the max
            hit = col == idx[:, None]
            chosen.append(idx)
            choice = choice + jnp.where(hit & real, 1, 0)
            biased = jnp.where(hit, -jnp.inf, biased)
        sizes = jnp.sum(choice, axis=0)  # [ep]
        offsets = jnp.cumsum(sizes) - sizes  # exclusive: first row of each expert
        start = offsets[None, :] + jnp.cumsum(choice, axis=0) - choice  # [np, ep]: row if token n chose e
        for j, idx in enumerate(chosen):
            experts_ref[:, j] = idx
            rows_ref[:, j] = jnp.sum(jnp.where(col == idx[:, None], start, 0), axis=1)
        sizes_ref[...] = sizes

    return pl.pallas_call(
        kernel,
        out_shape=(jax.ShapeDtypeStruct((np_, k), jnp.int32), jax.ShapeDtypeStruct((np_, k), jnp.int32),
                   jax.ShapeDtypeStruct((ep,), jnp.int32)),
        grid=(1,),
        interpret=interpret,
        compiler_params=triton_params(interpret, 4 if np_ * ep <= 8192 else 8, 1),
        name="k3_moe_route_plan",
    )(logits_ne, bias_e)
