"""Dense weight projections ``x[..., K...] @ w[K..., N...]``: the single dispatch point for the layers' matmuls
(KDA, MLA, shared-expert and latent-MoE projections, the LM head): ``jax.lax.dot_general``, what ``jnp.einsum``
emits (XLA picks a Triton gemm fusion or cuBLAS), with one-row calls kept a matmul (`unless_single_row`).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

__all__ = ["project", "unless_single_row"]


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


def unless_single_row(fn, x: jax.Array, lead: int) -> jax.Array:
    """``fn(x)`` where the product of x's first `lead` axes (the rows of a matmul) is 1 (batch-1 decode) runs on x
    padded with a zero row along axis 0, then keeps the real row. XLA rewrites a one-row matmul as a multiply and a
    reduction over a materialised [K, N] product (k3_gpu decode at B = 1 spent ~1.8 ms of a 2.5 ms step there:
    benchmarks/RESULTS.md, 2026-11-30); two rows stay a matmul. `fn` must act row by row along axis 0."""
    if lead < 1 or math.prod(x.shape[:lead]) != 1:
        return fn(x)
    return fn(jnp.concatenate([x, jnp.zeros_like(x)], axis=0))[:1]
