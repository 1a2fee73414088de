"""A decode-sized matmul with its residual adds in the epilogue: ``round(round(x @ w) + a_1) + a_2 ...`` in one launch.

At decode the latent MoE's up-projection ([N, L] @ [L, D]) is followed by two bf16 adds (the shared experts' output,
then the residual stream), which XLA runs as a second kernel after its gemm (k3_gpu B = 64: 3.6 µs gemm + 3.3 µs
add per MoE layer, RESULTS.md session 16). Here program j computes the output columns j·tn .. (j+1)·tn of all M rows,
accumulating ``x @ w`` in f32 over K in `tk` steps, rounds to the output dtype, then adds each addend in f32 and
rounds again, in order: the same roundings as ``((x @ w).astype(dt) + a_1) + a_2`` in XLA. Triton backend on GPU
(``backend="gpu"``), the Pallas interpreter on CPU (``"interpret"``, tests). Inference only (no VJP).
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels.kda.chunk_fwd import triton_params
from pallas_kernels.tiling import next_pow2

__all__ = ["BACKENDS", "AddTiling", "matmul_add"]

BACKENDS = ("gpu", "interpret")
_F32 = jnp.float32
MAX_ROWS = 256


class AddTiling(NamedTuple):
    """tn: output columns per program; tk: K step; warps / stages: Triton's."""

    tn: int = 32
    tk: int = 64
    num_warps: int = 4
    num_stages: int = 4


def matmul_add(x_mk: jax.Array, w_kn: jax.Array, addends: tuple = (), *, tiling: AddTiling = AddTiling(),
               backend: str = "gpu") -> jax.Array:
    """``x @ w`` (f32 accumulation) rounded to x's dtype, then each addend [M, N] added in f32 and rounded, in
    order. x and w share a 16-bit or f32 dtype; M <= 256 (padded to a power of two); tn / tk (capped at N / K)
    must divide N / K."""
    if backend not in BACKENDS:
        raise ValueError(f"matmul_add: unknown backend {backend!r}; expected one of {BACKENDS}")
    if x_mk.ndim != 2 or w_kn.ndim != 2 or x_mk.shape[1] != w_kn.shape[0]:
        raise ValueError(f"matmul_add: expected x [M, K] and w [K, N] with equal K, got {x_mk.shape} and "
                         f"{w_kn.shape}")
    m, k = x_mk.shape
    n = w_kn.shape[1]
    if m > MAX_ROWS:
        raise ValueError(f"matmul_add: decode sizes only (M <= {MAX_ROWS}), got M={m}")
    if jnp.dtype(x_mk.dtype) != jnp.dtype(w_kn.dtype):
        raise ValueError(f"matmul_add: x and w must share a dtype, got {x_mk.dtype} and {w_kn.dtype}")
    for i, a in enumerate(addends):
        if a.shape != (m, n):
            raise ValueError(f"matmul_add: addend {i} must have shape {[m, n]}, got {list(a.shape)}")
    tiling = tiling._replace(tn=min(tiling.tn, n), tk=min(tiling.tk, k))
    for name, size, full in (("tn", tiling.tn, n), ("tk", tiling.tk, k)):
        if size < 16 or size & (size - 1) or full % size:
            raise ValueError(f"matmul_add: {name}={size} must be a power of two >= 16 dividing {full}")
    mp = next_pow2(m, 16)
    pad = lambda a: jnp.pad(a, ((0, mp - m), (0, 0))) if mp != m else a  # noqa: E731
    out = _call(pad(x_mk), w_kn, tuple(pad(a) for a in addends), tiling=tiling, interpret=backend == "interpret")
    return out[:m]


@functools.partial(jax.jit, static_argnames=("tiling", "interpret"))
def _call(x_mk, w_kn, addends, *, tiling: AddTiling, interpret: bool):
    m, k = x_mk.shape
    n = w_kn.shape[1]
    tn, tk = tiling.tn, tiling.tk
    dt = x_mk.dtype
    precision = jax.lax.Precision.HIGHEST if jnp.dtype(dt) == _F32 else jax.lax.Precision.DEFAULT

    def kernel(x_ref, w_ref, *refs):  # whole-array refs (K, N need not be powers of two); offsets by hand
        *add_refs, out_ref = refs
        n0 = pl.multiple_of(pl.program_id(0) * tn, tn)

        def step(i, acc):
            k0 = pl.multiple_of(i * tk, tk)
            return acc + jax.lax.dot_general(x_ref[:, pl.ds(k0, tk)], w_ref[pl.ds(k0, tk), pl.ds(n0, tn)],
                                             (((1,), (0,)), ((), ())), precision=precision,
                                             preferred_element_type=_F32)

        y = jax.lax.fori_loop(0, k // tk, step, jnp.zeros((m, tn), _F32)).astype(dt)
        for a_ref in add_refs:
            y = (y.astype(_F32) + a_ref[:, pl.ds(n0, tn)].astype(_F32)).astype(dt)
        out_ref[:, pl.ds(n0, tn)] = y

    return pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct((m, n), dt),
        grid=(n // tn,),
        interpret=interpret,
        compiler_params=triton_params(interpret, tiling.num_warps, tiling.num_stages),
        name="k3_matmul_add",
    )(x_mk, w_kn, *addends)
