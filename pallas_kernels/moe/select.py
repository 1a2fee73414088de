"""Top-k expert selection of a decode-sized MoE call in one launch: biased top-k, combine weights, renormalisation.

XLA runs `k3jax.layers.moe.route`'s selection as about four kernels on the critical path between the router matmul
and the first expert kernel (the bias add, a top-k sort, the weights' gather and the renormalisation; ~8 µs of a
decode step's MoE layer in k3_gpu at B = 64, RESULTS.md, 2026-12-02). Given the router's f32 ``logits [N, E]``
(``x @ W``, from XLA as in `route`), this kernel computes per token, ``tokens_per_program`` tokens per program,
with ``scores = sigmoid(logits)``:
- ``experts [N, k]``: the top-k of ``scores + bias`` by k rounds of max / first-argmax over the experts not taken
  yet (ties go to the lower expert index, as `jax.lax.top_k`; NaN ranks as -inf; k distinct experts always);
- ``weights [N, k]`` f32: the unbiased scores of those experts, divided by their sum (+ 1e-20, in j order) when
  `renormalize`, times `scale` (`route`'s combine weights).

Triton backend on GPU (``backend="gpu"``), the Pallas interpreter on CPU (``"interpret"``, tests). Ungrouped
routing only (``num_expert_group == 1``). Not differentiable: the MoE layer uses it in inference-only decode steps
(`cfg.runtime.moe_decode_select`).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels.moe.topk import MAX_EXPERTS, MAX_TOKENS, check_scores, top_k_rounds
from pallas_kernels.tiling import next_pow2, triton_params

__all__ = ["BACKENDS", "MAX_EXPERTS", "MAX_TOKENS", "select_experts"]

BACKENDS = ("gpu", "interpret")
_F32 = jnp.float32


def select_experts(logits_ne: jax.Array, bias_e: jax.Array, k: int, *, scale: float = 1.0, renormalize: bool = True,
                   tokens_per_program: int = 16, warps: int = 4, backend: str = "gpu") -> tuple[jax.Array, jax.Array]:
    """(weights [N, k] f32, experts [N, k] int32) from the router's logits [N, E] and the selection-only bias [E]
    (module doc)."""
    if backend not in BACKENDS:
        raise ValueError(f"select_experts: unknown backend {backend!r}; expected one of {BACKENDS}")
    n, e = check_scores("select_experts", logits_ne, k)
    if bias_e.shape != (e,):
        raise ValueError(f"select_experts: expected the bias [E={e}], got shape {bias_e.shape}")
    tt = next_pow2(tokens_per_program, 16)
    np_, ep = -(-n // tt) * tt, next_pow2(e, 16)
    logits = jnp.pad(logits_ne.astype(_F32), ((0, np_ - n), (0, ep - e)))
    bias = jnp.pad(bias_e.astype(_F32), (0, ep - e))
    weights, experts = _select_call(logits, bias, e=e, k=int(k), tt=tt, scale=float(scale),
                                    renormalize=bool(renormalize), interpret=backend == "interpret",
                                    warps=int(warps))
    return weights[:n, :k], experts[:n, :k]


@functools.partial(jax.jit, static_argnames=("e", "k", "tt", "scale", "renormalize", "interpret", "warps"))
def _select_call(logits_ne, bias_e, *, e: int, k: int, tt: int, scale: float, renormalize: bool, interpret: bool,
                 warps: int):
    np_, ep = logits_ne.shape
    kp = next_pow2(k, 1)

    def kernel(logits_ref, bias_ref, weights_ref, experts_ref):
        col = jax.lax.broadcasted_iota(jnp.int32, (tt, ep), 1)
        slot = jax.lax.broadcasted_iota(jnp.int32, (tt, kp), 1)
        scores = 1.0 / (1.0 + jnp.exp(-logits_ref[...]))  # sigmoid (exp(-x) -> inf gives 0)
        biased = scores + bias_ref[...][None, :]
        biased = jnp.where(biased != biased, -jnp.inf, biased)  # NaN ranks last (and never breaks the argmax)
        weights = jnp.zeros((tt, kp), _F32)
        experts = jnp.zeros((tt, kp), jnp.int32)
        total = jnp.zeros((tt,), _F32)
        for j, idx, hit in top_k_rounds(biased, col < e, k):  # padding columns are never chosen
            w = jnp.sum(jnp.where(hit, scores, 0.0), axis=1)  # the unbiased score of the chosen expert
            total = total + w
            weights = jnp.where(slot == j, w[:, None], weights)
            experts = jnp.where(slot == j, idx[:, None], experts)
        if renormalize:
            weights = weights / (total[:, None] + 1e-20)
        weights_ref[...] = weights * scale
        experts_ref[...] = experts

    return pl.pallas_call(
        kernel,
        out_shape=(jax.ShapeDtypeStruct((np_, kp), _F32), jax.ShapeDtypeStruct((np_, kp), jnp.int32)),
        grid=(np_ // tt,),
        in_specs=[pl.BlockSpec((tt, ep), lambda i: (i, 0)), pl.BlockSpec((ep,), lambda i: (0,))],
        out_specs=(pl.BlockSpec((tt, kp), lambda i: (i, 0)), pl.BlockSpec((tt, kp), lambda i: (i, 0))),
        interpret=interpret,
        compiler_params=triton_params(interpret, warps, 1),
        name="k3_moe_select",
    )(logits_ne, bias_e)
