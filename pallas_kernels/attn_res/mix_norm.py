"""One AttnRes read followed by the RMSNorm that consumes it, fused for decode-sized rows (K3_SPEC.md §3.1).

A read mixes the filled bank rows and the live partial sum with a per-token softmax over depth, and the layer then
RMS-normalises the mix before its attention or FFN. In XLA that is a concatenate of the sources, a score reduction,
the softmax, the weighted sum and the norm: four to six small kernels per read, 35 reads per `k3_gpu` decode step,
each moving well under a megabyte. This kernel does the whole read in one launch: program i takes ``block_m`` rows
and, over ``chunk``-wide column slices of D,
1. accumulates each source's sum of squares and its dot with the pseudo-query (``key_gain ⊙ query``);
   score = dot · rsqrt(ssq / D + eps), i.e. ``rms_normalize(source) · query``;
2. takes the softmax over sources and the sum of squares of the mix *rounded to the activation dtype* (the
   reference casts the mix back before its RMSNorm);
3. writes ``out_gain · (mix · rsqrt(ssq_mix / D + eps)).astype(dtype)`` (the released RMSNorm: gain after the cast).
Passes 2 and 3 recompute the mix from the sources (L1/L2-resident at these sizes) instead of holding a [block_m, D]
row in registers. Everything is f32 inside. The number of filled bank rows is static (the unrolled decode step
knows it per layer); rows past it are never read.

Triton backend on GPU (``backend="gpu"``), the Pallas interpreter on CPU (``"interpret"``, tests). Forward only:
the dispatch (`k3jax.layers.attn_res.read_normed`) gives it the XLA composite's gradient.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels.kda.chunk_fwd import triton_params
from pallas_kernels.tiling import largest_pow2_divisor

__all__ = ["BACKENDS", "chunk_width", "mix_norm"]

BACKENDS = ("gpu", "interpret")
_F32 = jnp.float32


def chunk_width(d: int) -> int:
    """The column slice: the largest power of two <= 512 dividing D (0 when below 16: the kernel cannot take D)."""
    return largest_pow2_divisor(d, 512, 16)


def _block_rows(m: int) -> int:
    """Rows per program: the largest power of two <= 8 dividing M that still leaves >= 128 programs (a read moves
    well under a megabyte: what matters is spreading it over the SMs), else 1 (decode B = 64: 64 programs)."""
    for r in (8, 4, 2):
        if m % r == 0 and m // r >= 128:
            return r
    return 1


def mix_norm(live_md: jax.Array, bank_nmd: jax.Array, num_filled: int, key_gain_d: jax.Array, query_d: jax.Array,
             out_gain_d: jax.Array, *, eps: float, out_eps: float | None = None, backend: str = "gpu") -> jax.Array:
    """``out_gain * rms_normalize(mix).astype(dtype)`` with ``mix = Σ_s softmax_s(rms_normalize(src_s) · q) src_s``
    over sources ``bank[:num_filled]`` then ``live`` (q = key_gain ⊙ query). Returns [M, D] in
    ``promote(out_gain.dtype, live.dtype)``, what ``RMSNorm(attn_res_mix(...))`` returns. ``eps`` is the sources'
    normalisation epsilon, ``out_eps`` the RMSNorm's (default: ``eps``)."""
    if backend not in BACKENDS:
        raise ValueError(f"attn_res mix_norm: unknown backend {backend!r}; expected one of {BACKENDS}")
    if live_md.ndim != 2 or bank_nmd.ndim != 3 or bank_nmd.shape[1:] != live_md.shape:
        raise ValueError(f"attn_res mix_norm: expected live [M, D] and bank [N, M, D], got {live_md.shape} and "
                         f"{bank_nmd.shape}")
    d = live_md.shape[1]
    for name, v in (("key_gain", key_gain_d), ("query", query_d), ("out_gain", out_gain_d)):
        if v.shape != (d,):
            raise ValueError(f"attn_res mix_norm: {name} must be [D] = [{d}], got {list(v.shape)}")
    if not isinstance(num_filled, int) or not 0 <= num_filled <= bank_nmd.shape[0]:
        raise ValueError(f"attn_res mix_norm: num_filled must be a static int in [0, {bank_nmd.shape[0]}], "
                         f"got {num_filled!r}")
    if not chunk_width(d):
        raise ValueError(f"attn_res mix_norm: D={d} has no power-of-two divisor >= 16")
    if jnp.dtype(bank_nmd.dtype) != jnp.dtype(live_md.dtype):
        raise ValueError(f"attn_res mix_norm: bank and live must share a dtype, got {bank_nmd.dtype} and "
                         f"{live_md.dtype}")
    out_dtype = jnp.promote_types(out_gain_d.dtype, live_md.dtype)
    out_eps = float(eps if out_eps is None else out_eps)
    return _mix_norm_call(live_md, bank_nmd, key_gain_d, query_d, out_gain_d, num_filled=num_filled, eps=float(eps),
                          out_eps=out_eps, out_dtype=jnp.dtype(out_dtype), interpret=backend == "interpret")


@functools.partial(jax.jit, static_argnames=("num_filled", "eps", "out_eps", "out_dtype", "interpret"))
def _mix_norm_call(live_md, bank_nmd, key_gain_d, query_d, out_gain_d, *, num_filled, eps, out_eps, out_dtype,
                   interpret):
    m, d = live_md.shape
    bm, dc = _block_rows(m), chunk_width(d)
    steps = d // dc
    act_dtype = live_md.dtype

    def kernel(live_ref, bank_ref, key_gain_ref, query_ref, out_gain_ref, out_ref):
        rows = pl.ds(pl.multiple_of(pl.program_id(0) * bm, bm), bm)

        def source(s, c0):  # [bm, dc] f32 slice of source s (bank rows first, the live sum last)
            cols = pl.ds(c0, dc)
            x = bank_ref[s, rows, cols] if s < num_filled else live_ref[rows, cols]
            return x.astype(_F32)

        def col(i):
            return pl.multiple_of(i * dc, dc)

        def scores_step(i, carry):
            c0 = col(i)
            q = key_gain_ref[pl.ds(c0, dc)].astype(_F32) * query_ref[pl.ds(c0, dc)].astype(_F32)
            out = []
            for s, (ssq, dot) in enumerate(carry):
                x = source(s, c0)
                out.append((ssq + jnp.sum(x * x, axis=1), dot + jnp.sum(x * q[None, :], axis=1)))
            return tuple(out)

        zero = jnp.zeros((bm,), _F32)
        sums = jax.lax.fori_loop(0, steps, scores_step, tuple((zero, zero) for _ in range(num_filled + 1)))
        scores = [dot * jax.lax.rsqrt(ssq / d + eps) for ssq, dot in sums]
        top = functools.reduce(jnp.maximum, scores)
        weights = [jnp.exp(s - top) for s in scores]
        total = functools.reduce(jnp.add, weights)
        probs = [w / total for w in weights]

        def mix(c0):  # the mix rounded to the activation dtype, as f32 [bm, dc]
            acc = functools.reduce(jnp.add, [p[:, None] * source(s, c0) for s, p in enumerate(probs)])
            return acc.astype(act_dtype).astype(_F32)

        def ssq_step(i, ssq):
            x = mix(col(i))
            return ssq + jnp.sum(x * x, axis=1)

        inv_rms = jax.lax.rsqrt(jax.lax.fori_loop(0, steps, ssq_step, zero) / d + out_eps)

        def write_step(i, carry):
            c0 = col(i)
            y = (mix(c0) * inv_rms[:, None]).astype(act_dtype).astype(_F32)
            out_ref[rows, pl.ds(c0, dc)] = (y * out_gain_ref[pl.ds(c0, dc)].astype(_F32)).astype(out_dtype)
            return carry

        jax.lax.fori_loop(0, steps, write_step, 0)

    return pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct((m, d), out_dtype),
        grid=(m // bm,),
        interpret=interpret,
        compiler_params=triton_params(interpret, 4, 1),
        name="k3_attn_res_mix_norm",
    )(live_md, bank_nmd, key_gain_d, query_d, out_gain_d)
