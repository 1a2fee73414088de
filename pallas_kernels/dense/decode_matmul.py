"""Split-K matmul for decode-sized rows (a few to a few hundred): ``x [M, K] @ w [K, N]`` streaming ``w`` from HBM.

At decode a dense projection multiplies a handful of rows by a weight read once: the cost is the weight bytes,
and the kernel must keep enough loads in flight on every SM. A [K, N] weight split only along N gives few programs
when N is small (1536 / 64 = 24 on a 132-SM H200), so this kernel also splits K: program (j, s) multiplies all M
rows by the ``[K/S, tn]`` block (s, j) of the weight, accumulating in f32, and writes its partial product; the S
partials are summed in f32 by XLA afterwards (a reduction that fuses into the consumer of the result). Triton
backend on GPU (``backend="gpu"``), the Pallas interpreter on CPU (``"interpret"``, tests).

Candidate for the model's decode projections (#8); `benchmarks/dense_decode_bench.py` times it against XLA's own
choice and cuBLAS.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels.kda.chunk_fwd import triton_params  # the Triton compiler parameters (as the MLA kernel)
from pallas_kernels.tiling import next_pow2

__all__ = ["BACKENDS", "SplitTiling", "decode_matmul", "default_tiling"]

BACKENDS = ("gpu", "interpret")
_F32 = jnp.float32
_TARGET_PROGRAMS = 264  # two programs per SM on an H200 (132 SMs)


class SplitTiling(NamedTuple):
    """tn: weight columns per program; tk: K step of the inner loop; splits: K splits (divides K / tk)."""

    tn: int = 64
    tk: int = 64
    splits: int = 0  # 0: chosen from the shape (`default_tiling`)
    num_warps: int = 4
    num_stages: int = 4


def default_tiling(k: int, n: int, tiling: SplitTiling = SplitTiling()) -> SplitTiling:
    """Fills ``splits``: the smallest divisor of K / tk giving at least ~264 programs (two per H200 SM)."""
    if tiling.splits:
        return tiling
    steps = k // tiling.tk
    col_tiles = max(n // tiling.tn, 1)
    for splits in range(1, steps + 1):
        if steps % splits == 0 and col_tiles * splits >= _TARGET_PROGRAMS:
            return tiling._replace(splits=splits)
    return tiling._replace(splits=steps)


def _check(x_mk, w_kn, tiling: SplitTiling, backend: str):
    if backend not in BACKENDS:
        raise ValueError(f"decode_matmul: unknown backend {backend!r}; expected one of {BACKENDS}")
    if x_mk.ndim != 2 or w_kn.ndim != 2 or x_mk.shape[1] != w_kn.shape[0]:
        raise ValueError(f"decode_matmul: expected x [M, K] and w [K, N] with equal K, got {x_mk.shape} and "
                         f"{w_kn.shape}")
    k, n = w_kn.shape
    for name, size in (("tn", tiling.tn), ("tk", tiling.tk)):
        if size < 16 or size & (size - 1):
            raise ValueError(f"decode_matmul: {name} must be a power of two >= 16, got {size}")
    if k % tiling.tk or n % tiling.tn:
        raise ValueError(f"decode_matmul: K={k} must be a multiple of tk={tiling.tk} and N={n} of tn={tiling.tn}")
    if (k // tiling.tk) % tiling.splits:
        raise ValueError(f"decode_matmul: splits={tiling.splits} must divide K / tk = {k // tiling.tk}")
    if jnp.dtype(x_mk.dtype) != jnp.dtype(w_kn.dtype):
        raise ValueError(f"decode_matmul: x and w must share a dtype, got {x_mk.dtype} and {w_kn.dtype}")


def decode_matmul(x_mk: jax.Array, w_kn: jax.Array, *, tiling: SplitTiling | None = None,
                  backend: str = "gpu", out_dtype=None) -> jax.Array:
    """``x @ w`` with f32 accumulation -> ``out_dtype`` (default x's dtype). M is padded to a power of two >= 16
    (Triton block sizes); K and N must be multiples of ``tk`` / ``tn``."""
    tiling = default_tiling(w_kn.shape[0], w_kn.shape[1], tiling or SplitTiling())
    _check(x_mk, w_kn, tiling, backend)
    m = x_mk.shape[0]
    mp = next_pow2(m, 16)
    x_p = jnp.pad(x_mk, ((0, mp - m), (0, 0))) if mp != m else x_mk
    partial = _split_k_call(x_p, w_kn, tiling=tiling, interpret=backend == "interpret")
    return partial.sum(0)[:m].astype(out_dtype or x_mk.dtype)


@functools.partial(jax.jit, static_argnames=("tiling", "interpret"))
def _split_k_call(x_mk, w_kn, *, tiling: SplitTiling, interpret: bool):
    m, k = x_mk.shape
    n = w_kn.shape[1]
    tn, tk, splits = tiling.tn, tiling.tk, tiling.splits
    k_split = k // splits
    precision = jax.lax.Precision.HIGHEST if jnp.dtype(x_mk.dtype) == _F32 else jax.lax.Precision.DEFAULT

    def kernel(x_ref, w_ref, out_ref):  # whole-array refs (K, N need not be powers of two); offsets by hand
        j, s = pl.program_id(0), pl.program_id(1)
        n0 = pl.multiple_of(j * tn, tn)

        def step(i, acc):
            k0 = pl.multiple_of(s * k_split + i * tk, tk)
            return acc + jax.lax.dot_general(x_ref[:, pl.ds(k0, tk)], w_ref[pl.ds(k0, tk), pl.ds(n0, tn)],
                                             (((1,), (0,)), ((), ())), precision=precision,
                                             preferred_element_type=_F32)

        out_ref[s, :, pl.ds(n0, tn)] = jax.lax.fori_loop(0, k_split // tk, step, jnp.zeros((m, tn), _F32))

    return pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct((splits, m, n), _F32),
        grid=(n // tn, splits),
        interpret=interpret,
        compiler_params=triton_params(interpret, tiling.num_warps, tiling.num_stages),
        name="k3_decode_matmul",
    )(x_mk, w_kn)
