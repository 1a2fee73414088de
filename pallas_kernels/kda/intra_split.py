"""Intra-chunk stage as three kernels over a precomputed cumulative gate (``KernelConfig.intra="split"``).

Same outputs as ``chunk_fwd.intra_chunk``'s single kernel (``qg, kg, w, u, aqk, decay``), organised to cut the
serial work per program, which is what limits the single kernel on a GPU (``benchmarks/kda_stages.py``):

0. XLA: ``G`` = chunk-local inclusive cumulative sum of ``g * log2(e)`` (f32), so the kernels read any row of the
   cumulative decay with a load instead of a cross-row reduction.
1. ``gram`` (grid chunk x batch*head): per key block, the ten 16x16 sub-chunk blocks of ``aqk`` and ``akk``
   (diagonal blocks referenced to the sub-chunk's middle row, off-diagonal blocks ``(i, j < i)`` to the first row
   ``n`` of sub-chunk ``i``: ``q_i 2^(G_i - G_n)`` and ``k_j 2^(G_n - G_j)``, both exponents <= 0), plus ``qg``,
   ``kg`` and ``decay``. Writes ``akk`` (beta-scaled, strictly lower) in f32.
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

    def body(kb, acc):
        aqk, kk = dict(zip(_PAIRS, acc[0])), dict(zip(_PAIRS, acc[1]))
        c = pl.ds(pl.multiple_of(kb * block_k, block_k), block_k)

        def row(r):  # one row of the cumulative gate, [1, BK]
            return gc_ref[pl.ds(r, 1), c]

        q = [q_ref[pl.ds(i * s, s), c].astype(_F32) * scale for i in subs]
        k = [k_ref[pl.ds(i * s, s), c].astype(_F32) for i in subs]
        gc = [gc_ref[pl.ds(i * s, s), c] for i in subs]
        g_last = row(CHUNK - 1)
        for i in subs:
            mid, first = row(i * s + s // 2), row(i * s)
            aqk[i, i] = aqk[i, i] + _dot_nt(q[i] * jnp.exp2(gc[i] - mid), k[i] * jnp.exp2(mid - gc[i]), precision)
            kk[i, i] = kk[i, i] + _dot_nt(k[i] * jnp.exp2(gc[i] - mid), k[i] * jnp.exp2(mid - gc[i]), precision)
            from_first = jnp.exp2(gc[i] - first)  # <= 1
            q_first, k_first = q[i] * from_first, k[i] * from_first
            for j in range(i):
                k_bridged = k[j] * jnp.exp2(first - gc[j])  # exponent <= 0: row n comes after every row of j
                aqk[i, j] = aqk[i, j] + _dot_nt(q_first, k_bridged, precision)
                kk[i, j] = kk[i, j] + _dot_nt(k_first, k_bridged, precision)
            rows = pl.ds(i * s, s)
            qg_ref[rows, c] = _rows_masked(q[i] * jnp.exp2(gc[i]), carry_rows[i]).astype(inter_dtype)
            kg_ref[rows, c] = _rows_masked(k[i] * jnp.exp2(g_last - gc[i]), last_rows[i]).astype(inter_dtype)
        decay_ref[c] = jnp.exp2(jnp.sum(g_last, axis=0))  # the single row as [BK]
        return [aqk[p] for p in _PAIRS], [kk[p] for p in _PAIRS]

    zeros_ss = jnp.zeros((s, s), _F32)
    aqk_acc, kk_acc = lax.fori_loop(0, kd // block_k, body, ([zeros_ss] * len(_PAIRS), [zeros_ss] * len(_PAIRS)))
    rows_s1 = jnp.arange(s, dtype=jnp.int32)[:, None]
    cols_1s = jnp.arange(s, dtype=jnp.int32)[None, :]
    for (i, j), a, kk in zip(_PAIRS, aqk_acc, kk_acc):
        keep_a = rows_s1 >= cols_1s if i == j else None
        keep_k = rows_s1 > cols_1s if i == j else None
        if segmented:
            same = masks["same"][i, j]
            keep_a = same if keep_a is None else keep_a & same
            keep_k = same if keep_k is None else keep_k & same
        a = a if keep_a is None else jnp.where(keep_a, a, 0.0)
        kk = kk if keep_k is None else jnp.where(keep_k, kk, 0.0)
        beta_i = beta_ref[pl.ds(i * s, s)].astype(_F32)[:, None]
        aqk_ref[pl.ds(i * s, s), pl.ds(j * s, s)] = a.astype(inter_dtype)
        akk_ref[pl.ds(i * s, s), pl.ds(j * s, s)] = beta_i * kk
    zeros_inter = jnp.zeros((s, s), inter_dtype)
    for i in subs:
        for j in range(i + 1, _N_SUB):
            aqk_ref[pl.ds(i * s, s), pl.ds(j * s, s)] = zeros_inter
            akk_ref[pl.ds(i * s, s), pl.ds(j * s, s)] = jnp.zeros((s, s), _F32)


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
