"""Top-k expert selection of a decode-sized MoE call in one launch: biased top-k, combine weights, renormalisation.

XLA runs `k3jax.layers.moe.route`'s selection as about four kernels on the critical path between the router matmul
and the first expert kernel (the bias add, a top-k sort, the weights' gather and the renormalisation; ~8 µs of a
decode step's MoE layer in k3_gpu at B = 64, RESULTS.md session 15). Given the router's f32 ``logits [N, E]``
(``x @ W``, from XLA as in `route`), this kernel computes per token, ``tokens_per_program`` tokens per program,
with ``scores = sigmoid(logits)``:
- ``experts [N, k]``: the top-k of ``scores + bias`` by k rounds of max / first-argmax over the experts not taken
  yet (ties go to the lower expert index, as `jax.lax.top_k`; NaN ranks as -inf; k distinct experts always);
- ``weights [N, k]`` f32: the unbiased scores of those experts, divided by their sum (+ 1e-20, in j order) when
  `renormalize`, times `scale` (`route`'s combine weights).

Triton backend on GPU (``backend="gpu"``), the Pallas interpreter on CPU (``"interpret"``, tests). Ungrouped
routing only (``num_expert_group == 1``). Not differentiable: the MoE layer uses it in inference-only decode steps
(`cfg.moe_decode_select`).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels.kda.chunk_fwd import triton_params
from pallas_kernels.moe.topk import MAX_EXPERTS, MAX_TOKENS, check_scores, top_k_rounds
from pallas_kernels.tiling import next_pow2

__all__ = ["BACKENDS", "MAX_EXPERTS", "MAX_TOKENS", "router_block", "select_experts", "select_experts_routed"]

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


def _select_rows(logits, bias_row, *, e: int, k: int, scale: float, renormalize: bool):
    """The selection of one program's token rows from their f32 logits [tt, Ep] (in-kernel, traced): returns
    (weights [tt, Kp] f32, experts [tt, Kp] int32), Kp = k rounded up to a power of two (module doc)."""
    tt, ep = logits.shape
    kp = next_pow2(k, 1)
    col = jax.lax.broadcasted_iota(jnp.int32, (tt, ep), 1)
    slot = jax.lax.broadcasted_iota(jnp.int32, (tt, kp), 1)
    scores = 1.0 / (1.0 + jnp.exp(-logits))  # sigmoid (exp(-x) -> inf gives 0)
    biased = scores + bias_row[None, :]
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
    return weights * scale, experts


@functools.partial(jax.jit, static_argnames=("e", "k", "tt", "scale", "renormalize", "interpret", "warps"))
def _select_call(logits_ne, bias_e, *, e: int, k: int, tt: int, scale: float, renormalize: bool, interpret: bool,
                 warps: int):
    np_, ep = logits_ne.shape
    kp = next_pow2(k, 1)

    def kernel(logits_ref, bias_ref, weights_ref, experts_ref):
        weights_ref[...], experts_ref[...] = _select_rows(logits_ref[...], bias_ref[...], e=e, k=k, scale=scale,
                                                          renormalize=renormalize)

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


def router_block(d: int, limit: int = 128) -> int:
    """The contraction step of `select_experts_routed` for width D: the largest power of two <= `limit` dividing D,
    0 when it is under 16 (the kernel then does not apply)."""
    step = limit
    while step >= 16 and d % step:
        step //= 2
    return step if step >= 16 else 0


def select_experts_routed(x_nd: jax.Array, router_de: jax.Array, bias_e: jax.Array, k: int, *, scale: float = 1.0,
                          renormalize: bool = True, tokens_per_program: int = 16, block_d: int = 128,
                          warps: int = 4, stages: int = 3, backend: str = "gpu") -> tuple[jax.Array, jax.Array]:
    """`select_experts` with the router matmul in the same launch: (weights [N, k] f32, experts [N, k] int32) from
    the MoE input x [N, D] and the router W [D, E]. Each program accumulates its tokens' logits ``x @ W`` in f32
    over D in `block_d` steps (16-bit x and W of one dtype: their products are exact in f32 and are multiplied
    as they are; otherwise both upcast to f32 at HIGHEST precision, as `k3jax.layers.moe.router_logits`' f32
    matmul), then selects as `select_experts`. One launch instead of XLA's router gemm, its split-K reduction and
    the selection kernel."""
    if backend not in BACKENDS:
        raise ValueError(f"select_experts_routed: unknown backend {backend!r}; expected one of {BACKENDS}")
    if x_nd.ndim != 2 or router_de.ndim != 2 or x_nd.shape[1] != router_de.shape[0]:
        raise ValueError(f"select_experts_routed: expected x [N, D] and router [D, E] with equal D, got "
                         f"{x_nd.shape} and {router_de.shape}")
    n, e = check_scores("select_experts_routed", jax.ShapeDtypeStruct((x_nd.shape[0], router_de.shape[1]), _F32),
                        k)
    if bias_e.shape != (e,):
        raise ValueError(f"select_experts_routed: expected the bias [E={e}], got shape {bias_e.shape}")
    d = x_nd.shape[1]
    td = router_block(d, block_d)
    if not td:
        raise ValueError(f"select_experts_routed: D={d} has no power-of-two contraction step >= 16 dividing it")
    tt = next_pow2(tokens_per_program, 16)
    np_, ep = -(-n // tt) * tt, next_pow2(e, 16)
    same16 = x_nd.dtype == router_de.dtype and jnp.dtype(x_nd.dtype).itemsize == 2
    op_dtype = x_nd.dtype if same16 else _F32
    x = jnp.pad(x_nd.astype(op_dtype), ((0, np_ - n), (0, 0)))
    w = router_de.astype(op_dtype)
    if ep != e:
        w = jnp.pad(w, ((0, 0), (0, ep - e)))
    bias = jnp.pad(bias_e.astype(_F32), (0, ep - e))
    weights, experts = _routed_call(x, w, bias, e=e, k=int(k), tt=tt, td=td, scale=float(scale),
                                    renormalize=bool(renormalize), interpret=backend == "interpret",
                                    warps=int(warps), stages=int(stages))
    return weights[:n, :k], experts[:n, :k]


@functools.partial(jax.jit, static_argnames=("e", "k", "tt", "td", "scale", "renormalize", "interpret", "warps",
                                             "stages"))
def _routed_call(x_nd, w_de, bias_e, *, e: int, k: int, tt: int, td: int, scale: float, renormalize: bool,
                 interpret: bool, warps: int, stages: int):
    np_, d = x_nd.shape
    ep = w_de.shape[1]
    kp = next_pow2(k, 1)
    prec = jax.lax.Precision.HIGHEST if x_nd.dtype == _F32 else jax.lax.Precision.DEFAULT

    def kernel(x_ref, w_ref, bias_ref, weights_ref, experts_ref):
        r0 = pl.multiple_of(pl.program_id(0) * tt, tt)

        def step(i, acc):
            d0 = pl.multiple_of(i * td, td)
            return acc + jax.lax.dot_general(x_ref[pl.ds(r0, tt), pl.ds(d0, td)], w_ref[pl.ds(d0, td), :],
                                             (((1,), (0,)), ((), ())), precision=prec,
                                             preferred_element_type=_F32)

        logits = jax.lax.fori_loop(0, d // td, step, jnp.zeros((tt, ep), _F32))
        weights, experts = _select_rows(logits, bias_ref[...], e=e, k=k, scale=scale, renormalize=renormalize)
        weights_ref[pl.ds(r0, tt), :] = weights
        experts_ref[pl.ds(r0, tt), :] = experts

    return pl.pallas_call(
        kernel,
        out_shape=(jax.ShapeDtypeStruct((np_, kp), _F32), jax.ShapeDtypeStruct((np_, kp), jnp.int32)),
        grid=(np_ // tt,),
        interpret=interpret,
        compiler_params=triton_params(interpret, warps, stages),
        name="k3_moe_route_select",
    )(x_nd, w_de, bias_e)
