"""Intra-chunk stage as three kernels over a precomputed cumulative gate (``KernelConfig.intra="split"``).

Same outputs as ``chunk_fwd.intra_chunk``'s single kernel (``qg, kg, w, u, aqk, decay``), organised to cut the
serial work per program, which is what limits the single kernel on a GPU (``benchmarks/kda_stages.py``):

0. XLA: ``G`` = chunk-local inclusive cumulative sum of ``g * log2(e)`` (f32), so the kernels read any row of the
   cumulative decay with a load instead of a cross-row reduction.
1. ``gram`` (grid chunk x batch*head): per key block, the four 16-row blocks of ``aqk`` and ``akk``, each one
   [16, BK] x [BK, 64] product referenced to the first row of its sub-chunk (see ``_gram_kernel`` for the exponent
   ranges), plus ``qg``, ``kg`` and ``decay``. Writes ``akk`` (beta-scaled, strictly lower) in f32.
2. ``solve`` (grid chunk x batch*head): ``A = (I + akk)^-1`` as a full 64x64 lower-triangular matrix from the
   16x16 blocks (diagonal inverses by doubling, off-diagonal blocks by block forward substitution), in f32.
3. ``apply`` (grid chunk x batch*head): ``u = A (beta v)`` and ``w = A (beta k 2^G)`` as 64x64 @ 64xBK products.

Packed documents (``documents`` from ``chunk_fwd.document_layout``) are masked exactly as in the single kernel.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pallas_kernels.kda.chunk_fwd import (
    _INVERSES,
    _LOG2E,
    CHUNK,
    SUB_CHUNK,
    _dot,
    _dot_nt,
    _matmul_policy,
    _rows_masked,
    document_masks,
    document_operands,
    triton_params,
)

__all__ = ["chunk_cumulative_gate", "intra_chunk_split"]

_N_SUB = CHUNK // SUB_CHUNK
_F32 = jnp.float32
_PAIRS = [(i, j) for i in range(_N_SUB) for j in range(i + 1)]


def chunk_cumulative_gate(g):
    """``[B, Tp, H, K]`` f32: inclusive cumulative sum of ``g * log2(e)`` within each 64-row chunk."""
    b, tp, h, kd = g.shape
    g_bnchk = (g.astype(_F32) * _LOG2E).reshape(b, tp // CHUNK, CHUNK, h, kd)
    return jnp.cumsum(g_bnchk, axis=2).reshape(b, tp, h, kd)


def _gram_kernel(q_ref, k_ref, gc_ref, beta_ref, *refs, scale, precision, block_k, segmented):
    """Row blocks of ``aqk`` / ``akk``: for each 16-row sub-chunk ``i`` one [16, BK] x [BK, 64] product per key
    block, every column referenced to the first row ``n`` of ``i``: ``q_r 2^(G_r - G_n)`` (exponent <= 0) times
    ``k_c 2^(G_n - G_c)``, whose exponent is <= 0 for columns before ``i`` and <= 15 tokens of decay (<= 108 in
    base 2 at the -5 gate bound: finite in f32) inside ``i``; columns after ``i`` are zeroed before the exp2."""
    if segmented:
        doc_ref, carry_ref, last_ref, qg_ref, kg_ref, aqk_ref, akk_ref, decay_ref = refs
    else:
        qg_ref, kg_ref, aqk_ref, akk_ref, decay_ref = refs
    s = SUB_CHUNK
    kd = q_ref.shape[-1]
    inter_dtype = qg_ref.dtype
    subs = range(_N_SUB)
    masks = document_masks(doc_ref, carry_ref, last_ref) if segmented else None
    carry_rows = masks["carry"] if segmented else [None] * _N_SUB
    last_rows = masks["last"] if segmented else [None] * _N_SUB
    rows_c1 = jnp.arange(CHUNK, dtype=jnp.int32)[:, None]

    def body(kb, acc):
        aqk, kk = list(acc[0]), list(acc[1])
        c = pl.ds(pl.multiple_of(kb * block_k, block_k), block_k)
        gc_all = gc_ref[:, c]  # [64, BK]
        k_all = k_ref[:, c].astype(_F32)
        g_last = gc_ref[pl.ds(CHUNK - 1, 1), c]  # [1, BK]
        for i in subs:
            rows = pl.ds(i * s, s)
            q_i = q_ref[rows, c].astype(_F32) * scale
            k_i = k_ref[rows, c].astype(_F32)
            gc_i = gc_ref[rows, c]
            first = gc_ref[pl.ds(i * s, 1), c]  # [1, BK]
            from_first = jnp.exp2(gc_i - first)  # <= 1
            k_cols = k_all * jnp.exp2(jnp.where(rows_c1 < (i + 1) * s, first - gc_all, -jnp.inf))
            aqk[i] = aqk[i] + _dot_nt(q_i * from_first, k_cols, precision)
            kk[i] = kk[i] + _dot_nt(k_i * from_first, k_cols, precision)
            qg_ref[rows, c] = _rows_masked(q_i * jnp.exp2(gc_i), carry_rows[i]).astype(inter_dtype)
            kg_ref[rows, c] = _rows_masked(k_i * jnp.exp2(g_last - gc_i), last_rows[i]).astype(inter_dtype)
        decay_ref[c] = jnp.exp2(jnp.sum(g_last, axis=0))  # the single row as [BK]
        return aqk, kk

    zeros = [jnp.zeros((s, CHUNK), _F32)] * _N_SUB
    aqk_acc, kk_acc = lax.fori_loop(0, kd // block_k, body, (zeros, zeros))
    cols_1c = jnp.arange(CHUNK, dtype=jnp.int32)[None, :]
    doc_all = doc_ref[...] if segmented else None
    for i in subs:
        row_ids = i * s + jnp.arange(s, dtype=jnp.int32)[:, None]
        keep_a, keep_k = cols_1c <= row_ids, cols_1c < row_ids
        if segmented:
            same = doc_ref[pl.ds(i * s, s)][:, None] == doc_all[None, :]
            keep_a, keep_k = keep_a & same, keep_k & same
        beta_i = beta_ref[pl.ds(i * s, s)].astype(_F32)[:, None]
        aqk_ref[pl.ds(i * s, s), :] = jnp.where(keep_a, aqk_acc[i], 0.0).astype(inter_dtype)
        akk_ref[pl.ds(i * s, s), :] = beta_i * jnp.where(keep_k, kk_acc[i], 0.0)


def _solve_kernel(akk_ref, a_ref, *, precision, solve):
    """``A = (I + akk)^-1`` (64x64, lower block-triangular) from the 16x16 blocks of ``akk``."""
    s = SUB_CHUNK
    subs = range(_N_SUB)
    akk = {(i, j): akk_ref[pl.ds(i * s, s), pl.ds(j * s, s)] for (i, j) in _PAIRS if i > j}
    inv = [_INVERSES[solve](akk_ref[pl.ds(i * s, s), pl.ds(i * s, s)]) for i in subs]
    blocks = {}
    for j in subs:
        blocks[j, j] = inv[j]
        for i in range(j + 1, _N_SUB):
            acc = _dot(akk[i, j], inv[j], precision)
            for m in range(j + 1, i):
                acc = acc + _dot(akk[i, m], blocks[m, j], precision)
            blocks[i, j] = -_dot(inv[i], acc, precision)
    zeros_ss = jnp.zeros((s, s), _F32)
    for i in subs:
        for j in subs:
            a_ref[pl.ds(i * s, s), pl.ds(j * s, s)] = blocks.get((i, j), zeros_ss)


def _apply_kernel(a_ref, v_ref, k_ref, gc_ref, beta_ref, *refs, precision, block_k, segmented):
    """``u = A (beta v)``, ``w = A (beta k 2^G)`` (w rows outside the carried-in document masked)."""
    if segmented:
        _, carry_ref, _, u_ref, w_ref = refs
        carry = carry_ref[...].astype(_F32)[:, None]
    else:
        u_ref, w_ref = refs
        carry = None
    a_cc = a_ref[...]
    beta_c1 = beta_ref[...].astype(_F32)[:, None]

    def u_block(vb, carry_):
        c = pl.ds(pl.multiple_of(vb * block_k, block_k), block_k)
        u_ref[:, c] = _dot(a_cc, beta_c1 * v_ref[:, c].astype(_F32), precision).astype(u_ref.dtype)
        return carry_

    def w_block(kb, carry_):
        c = pl.ds(pl.multiple_of(kb * block_k, block_k), block_k)
        rhs = _rows_masked(beta_c1 * k_ref[:, c].astype(_F32) * jnp.exp2(gc_ref[:, c]), carry)
        w_ref[:, c] = _dot(a_cc, rhs, precision).astype(w_ref.dtype)
        return carry_

    lax.fori_loop(0, v_ref.shape[-1] // block_k, u_block, 0)
    lax.fori_loop(0, k_ref.shape[-1] // block_k, w_block, 0)


def intra_chunk_split(q, k, v, g, beta, *, scale, config, interpret=False, documents=None):
    """``chunk_fwd.intra_chunk`` through the three kernels above (same arguments and results)."""
    b, tp, h, kd = q.shape
    vd = v.shape[-1]
    n = tp // CHUNK
    inter_dtype, precision = _matmul_policy(q.dtype)
    block_k = min(config.block_k, kd, vd)
    params = triton_params(interpret, config.warps[0])
    segmented = documents is not None
    doc_ops, doc_specs = document_operands(documents, h, three_d_grid=False)
    gc = chunk_cumulative_gate(g)

    def chunk_spec(width):
        return pl.BlockSpec((None, CHUNK, None, width), lambda c, bh: (bh // h, c, bh % h, 0))

    beta_spec = pl.BlockSpec((None, CHUNK, None), lambda c, bh: (bh // h, c, bh % h))
    qg, kg, aqk, akk, decay = pl.pallas_call(
        functools.partial(_gram_kernel, scale=scale, precision=precision, block_k=block_k, segmented=segmented),
        out_shape=(jax.ShapeDtypeStruct((b, tp, h, kd), inter_dtype),
                   jax.ShapeDtypeStruct((b, tp, h, kd), inter_dtype),
                   jax.ShapeDtypeStruct((b, tp, h, CHUNK), inter_dtype),
                   jax.ShapeDtypeStruct((b, tp, h, CHUNK), _F32),
                   jax.ShapeDtypeStruct((b, h, n, kd), _F32)),
        grid=(n, b * h),
        in_specs=[chunk_spec(kd), chunk_spec(kd), chunk_spec(kd), beta_spec] + doc_specs,
        out_specs=[chunk_spec(kd), chunk_spec(kd), chunk_spec(CHUNK), chunk_spec(CHUNK),
                   pl.BlockSpec((None, None, None, kd), lambda c, bh: (bh // h, bh % h, c, 0))],
        interpret=interpret,
        compiler_params=params,
        name="kda_chunk_gram",
    )(q, k, gc, beta, *doc_ops)
    a = pl.pallas_call(
        functools.partial(_solve_kernel, precision=precision, solve=config.solve),
        out_shape=jax.ShapeDtypeStruct((b, tp, h, CHUNK), _F32),
        grid=(n, b * h),
        in_specs=[chunk_spec(CHUNK)],
        out_specs=chunk_spec(CHUNK),
        interpret=interpret,
        compiler_params=params,
        name="kda_chunk_solve",
    )(akk)
    u, w = pl.pallas_call(
        functools.partial(_apply_kernel, precision=precision, block_k=block_k, segmented=segmented),
        out_shape=(jax.ShapeDtypeStruct((b, tp, h, vd), inter_dtype),
                   jax.ShapeDtypeStruct((b, tp, h, kd), inter_dtype)),
        grid=(n, b * h),
        in_specs=[chunk_spec(CHUNK), chunk_spec(vd), chunk_spec(kd), chunk_spec(kd), beta_spec] + doc_specs,
        out_specs=[chunk_spec(vd), chunk_spec(kd)],
        interpret=interpret,
        compiler_params=params,
        name="kda_chunk_apply",
    )(a, v, k, gc, beta, *doc_ops)
    if segmented:
        decay = decay * documents["keep"][:, None, :, None]
    return qg, kg, w, u, aqk, decay
