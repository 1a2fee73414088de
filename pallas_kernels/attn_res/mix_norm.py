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
Each source row is read once, all of its slices' loads issued up front (the loop over D is unrolled: at decode
sizes a program is bound by load latency, not bandwidth; the first version looped three dependent passes over the
sources and took 5.5-11 us per read on an H200), and kept in registers in the activation dtype. Arithmetic is f32.
The number of filled bank rows is static (the unrolled decode step knows it per layer); rows past it are never
read.

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

__all__ = ["BACKENDS", "MAX_CHUNKS", "chunk_width", "mix_norm"]

BACKENDS = ("gpu", "interpret")
_F32 = jnp.float32


MAX_CHUNKS = 8  # column slices per row: all of them are held in registers (k3_gpu: D = 1536 = 3 x 512)


def chunk_width(d: int) -> int:
    """The column slice: the largest power of two <= 512 dividing D, 0 when the kernel cannot take D (no such
    divisor >= 16, or more than MAX_CHUNKS slices: the unrolled kernel would spill registers)."""
    width = largest_pow2_divisor(d, 512, 16)
    return width if width and d // width <= MAX_CHUNKS else 0


def _block_rows(m: int) -> int:
    """Rows per program: the largest power of two <= 8 dividing M that still leaves >= 128 programs (a read moves
    well under a megabyte: what matters is spreading it over the SMs), else 1 (decode B = 64: 64 programs)."""
    for r in (8, 4, 2):
        if m % r == 0 and m // r >= 128:
            return r
    return 1


def mix_norm(live_md: jax.Array, bank_nmd: jax.Array, num_filled: int, key_gain_d: jax.Array, query_d: jax.Array,
             out_gain_d: jax.Array, *, eps: float, out_eps: float | None = None, backend: str = "gpu",
             block_rows: int | None = None, warps: int = 4) -> jax.Array:
    """``out_gain * rms_normalize(mix).astype(dtype)`` with ``mix = Σ_s softmax_s(rms_normalize(src_s) · q) src_s``
    over sources ``bank[:num_filled]`` then ``live`` (q = key_gain ⊙ query). Returns [M, D] in
    ``promote(out_gain.dtype, live.dtype)``, what ``RMSNorm(attn_res_mix(...))`` returns. ``eps`` is the sources'
    normalisation epsilon, ``out_eps`` the RMSNorm's (default: ``eps``). ``block_rows`` (rows per program, a power
    of two dividing M; default: `_block_rows`) and ``warps`` are Triton tuning knobs
    (benchmarks/decode_kernels_bench.py)."""
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
        raise ValueError(f"attn_res mix_norm: D={d} needs a power-of-two divisor >= 16 that leaves at most "
                         f"{MAX_CHUNKS} slices of <= 512 columns")
    if jnp.dtype(bank_nmd.dtype) != jnp.dtype(live_md.dtype):
        raise ValueError(f"attn_res mix_norm: bank and live must share a dtype, got {bank_nmd.dtype} and "
                         f"{live_md.dtype}")
    m = live_md.shape[0]
    if block_rows is not None and (block_rows < 1 or block_rows & (block_rows - 1) or m % block_rows):
        raise ValueError(f"attn_res mix_norm: block_rows must be a power of two dividing M={m}, got {block_rows!r}")
    if warps < 1 or warps & (warps - 1):
        raise ValueError(f"attn_res mix_norm: warps must be a power of two, got {warps!r}")
    out_dtype = jnp.promote_types(out_gain_d.dtype, live_md.dtype)
    out_eps = float(eps if out_eps is None else out_eps)
    return _mix_norm_call(live_md, bank_nmd, key_gain_d, query_d, out_gain_d, num_filled=num_filled, eps=float(eps),
                          out_eps=out_eps, out_dtype=jnp.dtype(out_dtype), interpret=backend == "interpret",
                          block_rows=block_rows, warps=int(warps))


@functools.partial(jax.jit, static_argnames=("num_filled", "eps", "out_eps", "out_dtype", "interpret", "block_rows",
                                             "warps"))
def _mix_norm_call(live_md, bank_nmd, key_gain_d, query_d, out_gain_d, *, num_filled, eps, out_eps, out_dtype,
                   interpret, block_rows=None, warps=4):
    m, d = live_md.shape
    bm, dc = block_rows or _block_rows(m), chunk_width(d)
    steps = d // dc
    act_dtype = live_md.dtype

    def kernel(live_ref, bank_ref, key_gain_ref, query_ref, out_gain_ref, out_ref):
        rows = pl.ds(pl.multiple_of(pl.program_id(0) * bm, bm), bm)
        chunks = [pl.ds(i * dc, dc) for i in range(steps)]  # static: every load is issued up front
        # each source's row slices, read once (bank rows first, the live sum last), kept in the activation dtype
        src = [[bank_ref[s, rows, c] if s < num_filled else live_ref[rows, c] for c in chunks]
               for s in range(num_filled + 1)]
        q = [key_gain_ref[c].astype(_F32) * query_ref[c].astype(_F32) for c in chunks]
        scores = []
        for parts in src:
            ssq = functools.reduce(jnp.add, [jnp.sum(jnp.square(x.astype(_F32)), axis=1) for x in parts])
            dot = functools.reduce(jnp.add, [jnp.sum(x.astype(_F32) * qc[None, :], axis=1)
                                             for x, qc in zip(parts, q)])
            scores.append(dot * jax.lax.rsqrt(ssq / d + eps))
        top = functools.reduce(jnp.maximum, scores)
        weights = [jnp.exp(sc - top) for sc in scores]
        total = functools.reduce(jnp.add, weights)
        probs = [w / total for w in weights]
        # the mix per slice, rounded to the activation dtype (the reference casts it back before its RMSNorm)
        mix = [functools.reduce(jnp.add, [p[:, None] * parts[i].astype(_F32) for p, parts in zip(probs, src)])
               .astype(act_dtype).astype(_F32) for i in range(steps)]
        ssq_mix = functools.reduce(jnp.add, [jnp.sum(x * x, axis=1) for x in mix])
        inv_rms = jax.lax.rsqrt(ssq_mix / d + out_eps)
        for c, x in zip(chunks, mix):
            y = (x * inv_rms[:, None]).astype(act_dtype).astype(_F32)
            out_ref[rows, c] = (y * out_gain_ref[c].astype(_F32)).astype(out_dtype)

    return pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct((m, d), out_dtype),
        grid=(m // bm,),
        interpret=interpret,
        compiler_params=triton_params(interpret, warps, 1),
        name="k3_attn_res_mix_norm",
    )(live_md, bank_nmd, key_gain_d, query_d, out_gain_d)
