"""Dense weight projections ``x[..., K...] @ w[K..., N...]``: the single dispatch point for the layers' matmuls
(KDA, MLA, shared-expert and latent-MoE projections, the LM head): ``jax.lax.dot_general``, what ``jnp.einsum``
emits (XLA picks a Triton gemm fusion or cuBLAS), with one-row calls kept a matmul (`unless_single_row`).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

__all__ = ["project", "project_wide", "unless_single_row"]


def project(x: jax.Array, w: jax.Array, cfg, *, contract: int = 1, preferred_element_type=None) -> jax.Array:
    """Contracts the last `contract` axes of x with the first `contract` axes of w (``"btd,dhk->bthk"`` is
    contract=1, ``"bthk,hkd->btd"`` contract=2); result dtype `preferred_element_type` or x's, f32 accumulation."""
    if x.shape[x.ndim - contract:] != w.shape[:contract]:
        raise ValueError(f"project: x {x.shape} and w {w.shape} disagree on the {contract} contracted axes")
    del cfg
    dims = (tuple(range(x.ndim - contract, x.ndim)), tuple(range(contract)))
    return unless_single_row(
        lambda x2: jax.lax.dot_general(x2, w, (dims, ((), ())), preferred_element_type=preferred_element_type),
        x, x.ndim - contract)


@jax.custom_vjp
def project_wide(x_nk: jax.Array, w_km: jax.Array) -> jax.Array:
    """``x @ w`` (one contracted axis) with f32 accumulation and an f32 result (the LM head's logits), whose
    backward rounds the f32 output cotangent to x's dtype before its two matmuls: with bf16 compute they run as
    bf16 gemms (f32 accumulation) instead of f32/TF32 gemms on a [tokens, vocab] f32 operand, which took about a
    fifth of a k3_gpu training micro-step (benchmarks/RESULTS.md, 2026-12-03). Exact for f32 compute."""
    return _project_wide(x_nk, w_km)


def _project_wide(x, w):
    return jax.lax.dot_general(x, w, (((x.ndim - 1,), (0,)), ((), ())), preferred_element_type=_wide(x.dtype))


def _project_wide_fwd(x, w):
    return _project_wide(x, w), (x, w)


def _project_wide_bwd(res, g):
    x, w = res
    g = g.astype(x.dtype)
    dx = jax.lax.dot_general(g, w, (((g.ndim - 1,), (1,)), ((), ())), preferred_element_type=_wide(x.dtype))
    lead = tuple(range(x.ndim - 1))
    dw = jax.lax.dot_general(x, g, ((lead, lead), ((), ())), preferred_element_type=_wide(x.dtype))
    return dx.astype(x.dtype), dw.astype(w.dtype)


def _wide(dtype):
    return jnp.promote_types(dtype, jnp.float32)


project_wide.defvjp(_project_wide_fwd, _project_wide_bwd)


def unless_single_row(fn, x: jax.Array, lead: int) -> jax.Array:
    """``fn(x)`` where the product of x's first `lead` axes (the rows of a matmul) is 1 (batch-1 decode) runs on x
    padded with a zero row along axis 0, then keeps the real row. XLA rewrites a one-row matmul as a multiply and a
    reduction over a materialised [K, N] product (k3_gpu decode at B = 1 spent ~1.8 ms of a 2.5 ms step there:
    benchmarks/RESULTS.md, 2026-11-30); two rows stay a matmul. `fn` must act row by row along axis 0."""
    if lead < 1 or math.prod(x.shape[:lead]) != 1:
        return fn(x)
    return fn(jnp.concatenate([x, jnp.zeros_like(x)], axis=0))[:1]
