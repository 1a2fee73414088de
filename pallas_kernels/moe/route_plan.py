"""Routing plan for decode-sized MoE calls in one launch: top-k selection and the expert-sorted row layout.

The dropless MoE sorts the N·k (token, expert) assignments by expert so the grouped matmuls see each expert's rows
contiguously. In XLA a decode step spends about ten small kernels per MoE layer on that (a top-k sort, an argsort
of the assignments, a bincount scatter, gathers and slices). Given the selection scores (``sigmoid(logits) + bias``,
computed by the caller exactly as the XLA `route` does, so both paths rank identical values), this kernel computes
for N tokens and E experts in one program:
- ``experts [N, k]``: the top-k per token, found by k rounds of max / first-argmax over the experts not yet taken
  (ties go to the lower expert index, as `jax.lax.top_k`; NaN ranks as -inf; a token always gets k distinct
  experts, even when only -inf scores are left);
- ``group_sizes [E]``: assignments per expert;
- ``rows [N, k]``: the row of each assignment in the expert-sorted order of a *stable* sort of the flat assignment
  list by expert, i.e. ``offset[e] + #(tokens n' < n that chose e)`` (a token picks an expert at most once): an
  exclusive cumulative sum over tokens of the int32 [N, E] choice matrix plus the exclusive cumulative sum of the
  group sizes (integer scans: exact, no [N, N] matrix in shared memory). The rows are a permutation of
  0 .. N·k - 1;
- ``token_of_row [N·k]``: its inverse, the token whose copy sits at each expert-sorted row (written by scatter
  stores inside the kernel, so the caller gathers the expert inputs without a scatter of its own).
The combine weights are left to the caller (a differentiable gather of the scores at ``experts``).

Triton backend on GPU (``backend="gpu"``), the Pallas interpreter on CPU (``"interpret"``, tests). N and E are
padded to powers of two >= 16 inside (padded tokens choose nothing, padded experts are never chosen). Not
differentiable (integer outputs): callers pass ``stop_gradient`` scores.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels.kda.chunk_fwd import triton_params
from pallas_kernels.moe.topk import MAX_EXPERTS, MAX_TOKENS, check_scores, top_k_rounds
from pallas_kernels.tiling import next_pow2

__all__ = ["BACKENDS", "MAX_EXPERTS", "MAX_TOKENS", "RoutePlan", "route_plan"]

BACKENDS = ("gpu", "interpret")
_F32 = jnp.float32


class RoutePlan(NamedTuple):
    experts_nk: jax.Array  # int32 [N, k]: chosen experts, best first
    rows_nk: jax.Array  # int32 [N, k]: row of each assignment in the expert-sorted layout
    group_sizes_e: jax.Array  # int32 [E]: assignments per expert
    token_of_row_a: jax.Array  # int32 [N * k]: the token at each expert-sorted row (rows_nk's inverse)


def route_plan(scores_ne: jax.Array, k: int, *, backend: str = "gpu", warps: int | None = None) -> RoutePlan:
    """Top-k of the selection scores per token and the expert-sorted row plan (see the module doc). ``warps``:
    Triton warps of the one program. Default by padded scores N·E: 4 below 4096; 16 from 4096 to 8192 (the program is
    compute-bound: 64 × 64 took 16.8 µs at 4 warps, 9.0 at 16, 9.7 at 32 alone, and in k3_gpu decode at B = 64 the
    kernel went from 1.095× the XLA routing's step time to 1.001×; RESULTS.md, session 9); 8 above (session 7)."""
    if backend not in BACKENDS:
        raise ValueError(f"route_plan: unknown backend {backend!r}; expected one of {BACKENDS}")
    n, e = check_scores("route_plan", scores_ne, k)
    if warps is not None and (warps < 1 or warps & (warps - 1)):
        raise ValueError(f"route_plan: warps must be a power of two, got {warps!r}")
    np_, ep = next_pow2(n, 16), next_pow2(e, 16)
    scores = jnp.pad(jax.lax.stop_gradient(scores_ne).astype(_F32), ((0, np_ - n), (0, ep - e)))
    cells = np_ * ep
    warps = warps or (4 if cells < 4096 else 16 if cells <= 8192 else 8)
    experts, rows, sizes, token_of_row = _plan_call(scores, n=n, e=e, k=int(k), interpret=backend == "interpret",
                                                    warps=int(warps))
    return RoutePlan(experts[:n], rows[:n], sizes[:e], token_of_row[:n * k])


@functools.partial(jax.jit, static_argnames=("n", "e", "k", "interpret", "warps"))
def _plan_call(scores_ne, *, n: int, e: int, k: int, interpret: bool, warps: int):
    np_, ep = scores_ne.shape

    def kernel(scores_ref, experts_ref, rows_ref, sizes_ref, token_ref):
        col = jax.lax.broadcasted_iota(jnp.int32, (np_, ep), 1)
        tok = jax.lax.broadcasted_iota(jnp.int32, (np_, ep), 0)
        x = scores_ref[...]
        x = jnp.where(x != x, -jnp.inf, x)  # NaN ranks last (and never breaks the argmax below)
        real = tok < n
        chosen = []
        choice = jnp.zeros((np_, ep), jnp.int32)  # 1 where token n chose expert e (real tokens only)
        for _, idx, hit in top_k_rounds(x, col < e, k):  # padding columns are never chosen
            chosen.append(idx)
            choice = choice + jnp.where(hit & real, 1, 0)
        sizes = jnp.sum(choice, axis=0)  # [ep]
        offsets = jnp.cumsum(sizes) - sizes  # exclusive: first row of each expert
        start = offsets[None, :] + jnp.cumsum(choice, axis=0) - choice  # [np, ep]: row if token n chose e
        token = jax.lax.broadcasted_iota(jnp.int32, (np_,), 0)
        for j, idx in enumerate(chosen):
            row = jnp.sum(jnp.where(col == idx[:, None], start, 0), axis=1)
            experts_ref[:, j] = idx
            rows_ref[:, j] = row
            # scatter the inverse; padding tokens write past the N*k real rows (distinct slots, sliced off)
            token_ref[jnp.where(token < n, row, n * k + (token - n) * k + j)] = token
        sizes_ref[...] = sizes

    return pl.pallas_call(
        kernel,
        out_shape=(jax.ShapeDtypeStruct((np_, k), jnp.int32), jax.ShapeDtypeStruct((np_, k), jnp.int32),
                   jax.ShapeDtypeStruct((ep,), jnp.int32), jax.ShapeDtypeStruct((np_ * k,), jnp.int32)),
        grid=(1,),
        interpret=interpret,
        compiler_params=triton_params(interpret, warps, 1),
        name="k3_moe_route_plan",
    )(scores_ne)
