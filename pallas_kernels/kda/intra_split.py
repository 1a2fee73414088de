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

from pallas_kernels.kda.common import (
    CHUNK,
    LOG2E,
    SUB_CHUNK,
    ChunkSpecs,
    block_lower_inverse,
    document_masks,
    document_operands,
    dot,
    dot_nt,
    dot_tn,
    matmul_policy,
    rows_masked,
)
from pallas_kernels.kda.intra_bwd_tiled import key_block_update, value_block_grads
from pallas_kernels.kda.intra_fused import apply_call, intra_chunk_fused
from pallas_kernels.kda.intra_pairs import intra_chunk_pairs
from pallas_kernels.tiling import triton_params

__all__ = ["chunk_cumulative_gate", "intra_bwd_split", "intra_chunk_split"]

_N_SUB = CHUNK // SUB_CHUNK
_F32 = jnp.float32
_PAIRS = [(i, j) for i in range(_N_SUB) for j in range(i + 1)]


def chunk_cumulative_gate(g):
    """``[B, Tp, H, K]`` f32: inclusive cumulative sum of ``g * log2(e)`` within each 64-row chunk."""
    b, tp, h, kd = g.shape
    g_bnchk = (g.astype(_F32) * LOG2E).reshape(b, tp // CHUNK, CHUNK, h, kd)
    return jnp.cumsum(g_bnchk, axis=2).reshape(b, tp, h, kd)


def _gram_kernel(q_ref, k_ref, gc_ref, *refs, scale, precision, block_k, segmented):
    """Row blocks of ``aqk`` / ``akk``: for each 16-row sub-chunk ``i`` one [16, BK] x [BK, 64] product per key
    block, every column referenced to the first row ``n`` of ``i``: ``q_r 2^(G_r - G_n)`` (exponent <= 0) times
    ``k_c 2^(G_n - G_c)``, whose exponent is <= 0 for columns before ``i`` and <= 15 tokens of decay (<= 108 in
    base 2 at the -5 gate bound: finite in f32) inside ``i``; columns after ``i`` are zeroed before the exp2."""
    if segmented:
        doc_ref, carry_ref, last_ref, qg_ref, kg_ref, aqk_ref, kk_ref, decay_ref = refs
    else:
        qg_ref, kg_ref, aqk_ref, kk_ref, decay_ref = refs
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
            aqk[i] = aqk[i] + dot_nt(q_i * from_first, k_cols, precision)
            kk[i] = kk[i] + dot_nt(k_i * from_first, k_cols, precision)
            qg_ref[rows, c] = rows_masked(q_i * jnp.exp2(gc_i), carry_rows[i]).astype(inter_dtype)
            kg_ref[rows, c] = rows_masked(k_i * jnp.exp2(g_last - gc_i), last_rows[i]).astype(inter_dtype)
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
        aqk_ref[pl.ds(i * s, s), :] = jnp.where(keep_a, aqk_acc[i], 0.0).astype(inter_dtype)
        kk_ref[pl.ds(i * s, s), :] = jnp.where(keep_k, kk_acc[i], 0.0)


def _solve_kernel(kk_ref, beta_ref, a_ref, *, precision, solve):
    """``A = (I + akk)^-1`` (64x64, lower block-triangular) from the 16x16 blocks of ``akk = diag(beta) kk``."""
    s = SUB_CHUNK
    subs = range(_N_SUB)
    beta = [beta_ref[pl.ds(i * s, s)].astype(_F32)[:, None] for i in subs]
    akk = {(i, j): beta[i] * kk_ref[pl.ds(i * s, s), pl.ds(j * s, s)] for (i, j) in _PAIRS}
    blocks = block_lower_inverse(akk, solve=solve, precision=precision)
    zeros_ss = jnp.zeros((s, s), _F32)
    for i in subs:
        for j in subs:
            a_ref[pl.ds(i * s, s), pl.ds(j * s, s)] = blocks.get((i, j), zeros_ss)


def intra_chunk_split(q, k, v, g, beta, *, scale, config, interpret=False, documents=None, return_solve=False,
                      gate=None):
    """``chunk_fwd.intra_chunk`` through the three kernels above (same arguments and results); ``return_solve``
    also returns ``(kk, A, G)`` (the pairwise key products, the 64x64 inverse and the cumulative gate) for the
    backward. ``config.intra`` "fused2" runs the same algebra as two kernels (``intra_fused.py``),
    "pairs" per pair of sub-chunks (``intra_pairs.py``); those take ``gate`` (``chunk_fwd.intra_chunk``)."""
    if config.intra == "pairs":
        return intra_chunk_pairs(q, k, v, g, beta, scale=scale, config=config, interpret=interpret,
                                 documents=documents, return_solve=return_solve, gate=gate)
    if config.intra == "fused2":
        return intra_chunk_fused(q, k, v, g, beta, scale=scale, config=config, interpret=interpret,
                                 documents=documents, return_solve=return_solve, gate=gate)
    if gate is not None:
        raise ValueError("intra_chunk_split: the split kernels read an activated gate (gate must be None)")
    b, tp, h, kd = q.shape
    vd = v.shape[-1]
    n = tp // CHUNK
    inter_dtype, precision = matmul_policy(q.dtype)
    block_k = min(config.block_k, kd, vd)
    params = triton_params(interpret, config.warps[0])
    segmented = documents is not None
    doc_ops, doc_specs = document_operands(documents, h)
    gc = chunk_cumulative_gate(g)

    spec = ChunkSpecs(h)
    chunk_spec, beta_spec = spec.tile, spec.rows
    qg, kg, aqk, kk, decay = pl.pallas_call(
        functools.partial(_gram_kernel, scale=scale, precision=precision, block_k=block_k, segmented=segmented),
        out_shape=(jax.ShapeDtypeStruct((b, tp, h, kd), inter_dtype),
                   jax.ShapeDtypeStruct((b, tp, h, kd), inter_dtype),
                   jax.ShapeDtypeStruct((b, tp, h, CHUNK), inter_dtype),
                   jax.ShapeDtypeStruct((b, tp, h, CHUNK), _F32),
                   jax.ShapeDtypeStruct((b, h, n, kd), _F32)),
        grid=(n, b * h),
        in_specs=[chunk_spec(kd), chunk_spec(kd), chunk_spec(kd)] + doc_specs,
        out_specs=[chunk_spec(kd), chunk_spec(kd), chunk_spec(CHUNK), chunk_spec(CHUNK),
                   spec.per_chunk(kd)],
        interpret=interpret,
        compiler_params=params,
        name="kda_chunk_gram",
    )(q, k, gc, *doc_ops)
    a = pl.pallas_call(
        functools.partial(_solve_kernel, precision=precision, solve=config.solve),
        out_shape=jax.ShapeDtypeStruct((b, tp, h, CHUNK), _F32),
        grid=(n, b * h),
        in_specs=[chunk_spec(CHUNK), beta_spec],
        out_specs=chunk_spec(CHUNK),
        interpret=interpret,
        compiler_params=params,
        name="kda_chunk_solve",
    )(kk, beta)
    u, w = apply_call(a, v, k, gc, beta, documents, inter_dtype=inter_dtype, precision=precision, config=config,
                      interpret=interpret)
    if segmented:
        decay = decay * documents["keep"][:, None, :, None]
    if return_solve:
        return qg, kg, w, u, aqk, decay, (kk, a, gc)
    return qg, kg, w, u, aqk, decay


def _intra_bwd_kernel(q_ref, k_ref, v_ref, beta_ref, u_ref, w_ref, gc_ref, kk_ref, a_ref,
                      dqg_ref, dkg_ref, dw_ref, du_ref, daqk_ref, ddecay_ref, *refs,
                      scale, precision, block_k, segmented):
    """Back through the split intra stage for one chunk of one (batch, head), with 64-row products throughout.

    With ``A = (I + diag(beta) kk)^-1``: ``y = A^T du`` (value blocks: ``dv = beta y``), ``z = A^T dw`` (key
    blocks), ``dakk = -strict(y u^T + z w^T)``, ``dbeta = rowsum(y v) + rowsum(z k 2^G) + rowsum(dakk kk)`` and
    ``dkk = diag(beta) dakk``. The pairwise products are differentiated in the gram kernel's row-block form (row
    block i, reference row n = its first row): with ``F = 2^(G_i - G_n)`` and ``E = 2^(G_n - G)`` (rows up to
    the end of i), ``dq~_i += F (daqk_i (k E))``, ``dk_row_i += F (dkk_i (k E))`` and ``dk_col += E (daqk_i^T
    (q~_i F) + dkk_i^T (k_i F))``. The gate gradient per row is ``dG = q~ dq~ + k (dk_row - dk_col) - dkg kg +
    z beta k 2^G`` (the reference-row terms cancel), reverse-summed over the chunk plus ``dG_L``.

    Full-f32 dots (f32 inputs) take the sub-chunks in a ``fori_loop`` (``rolled``): unrolled, the four sub-chunks'
    64x64 f32 dot operands overflow a GPU's shared memory (requested 264 KiB of 227 on an H200); 16-bit inputs keep
    the unrolled form whose timings were measured.
    """
    if segmented:
        doc_ref, carry_ref, last_ref, dq_ref, dk_ref, dv_ref, dg_ref, dbeta_ref = refs
        carry = carry_ref[...].astype(_F32)[:, None]
        last = last_ref[...].astype(_F32)[:, None]
    else:
        dq_ref, dk_ref, dv_ref, dg_ref, dbeta_ref = refs
        carry = last = None
    s = SUB_CHUNK
    kd, vd = k_ref.shape[-1], v_ref.shape[-1]
    rows_c1 = jnp.arange(CHUNK, dtype=jnp.int32)[:, None]
    cols_1c = jnp.arange(CHUNK, dtype=jnp.int32)[None, :]
    same = (doc_ref[...][:, None] == doc_ref[...][None, :]) if segmented else None
    beta_c1 = beta_ref[...].astype(_F32)[:, None]
    a_cc = a_ref[...]
    rolled = precision == lax.Precision.HIGHEST

    def cols(b):
        return pl.ds(pl.multiple_of(b * block_k, block_k), block_k)

    y_block = value_block_grads(a_ref, du_ref, u_ref, v_ref, dv_ref, beta_c1, block_k=block_k, precision=precision)

    def z_block(kb, acc):
        c = cols(kb)
        z = dot_tn(a_cc, dw_ref[:, c].astype(_F32), precision)
        return key_block_update(acc, z, c, w_ref, k_ref, gc_ref, carry, precision)[0]

    acc = (jnp.zeros((CHUNK, CHUNK), _F32), jnp.zeros((CHUNK,), _F32))
    acc = lax.fori_loop(0, vd // block_k, y_block, acc)
    dakk, dbeta = lax.fori_loop(0, kd // block_k, z_block, acc)
    keep_k = cols_1c < rows_c1
    keep_a = cols_1c <= rows_c1
    if segmented:
        keep_k, keep_a = keep_k & same, keep_a & same
    dakk = jnp.where(keep_k, dakk, 0.0)
    kk = kk_ref[...]
    dbeta_ref[...] = (dbeta + jnp.sum(dakk * kk, axis=1)).astype(dbeta_ref.dtype)
    dkk = beta_c1 * dakk
    daqk = jnp.where(keep_a, daqk_ref[...].astype(_F32), 0.0)

    def grad_block(kb, carry_):
        c = cols(kb)
        q = q_ref[:, c].astype(_F32) * scale
        k = k_ref[:, c].astype(_F32)
        gc = gc_ref[:, c]
        g_last = gc_ref[pl.ds(CHUNK - 1, 1), c]
        gamma = rows_masked(jnp.exp2(gc), carry)
        kg_factor = rows_masked(jnp.exp2(g_last - gc), last)
        z = dot_tn(a_cc, dw_ref[:, c].astype(_F32), precision)

        def sub_chunk(i, acc):
            dqs, dk_row, dk_col = acc
            in_i = (rows_c1 >= i * s) & (rows_c1 < (i + 1) * s)  # [64, 1]: the rows of sub-chunk i
            first = gc_ref[pl.ds(i * s, 1), c]
            f_rows = jnp.exp2(jnp.where(in_i, gc - first, -jnp.inf))  # F on the rows of i, 0 elsewhere
            e_cols = jnp.exp2(jnp.where(rows_c1 < (i + 1) * s, first - gc, -jnp.inf))  # E up to the end of i
            k_e = k * e_cols
            daqk_i = jnp.where(in_i, daqk, 0.0)  # row block i of the [64, 64] cotangents
            dkk_i = jnp.where(in_i, dkk, 0.0)
            dqs = dqs + f_rows * dot(daqk_i, k_e, precision)
            dk_row = dk_row + f_rows * dot(dkk_i, k_e, precision)
            dk_col = dk_col + e_cols * (dot_tn(daqk_i, q * f_rows, precision) + dot_tn(dkk_i, k * f_rows, precision))
            return dqs, dk_row, dk_col

        acc = (dqg_ref[:, c].astype(_F32) * gamma, jnp.zeros_like(k), jnp.zeros_like(k))
        if rolled:  # one sub-chunk's 64x64 operands at a time
            acc = lax.fori_loop(0, _N_SUB, sub_chunk, acc)
        else:
            for i in range(_N_SUB):
                acc = sub_chunk(i, acc)
        dqs, dk_row, dk_col = acc
        dkg = dkg_ref[:, c].astype(_F32)
        dkg_kg = dkg * k * kg_factor
        dgrow = q * dqs + k * (dk_row - dk_col) - dkg_kg + z * beta_c1 * k * gamma
        dg_last = ddecay_ref[c].astype(_F32) * jnp.exp2(jnp.sum(g_last, axis=0)) + jnp.sum(dkg_kg, axis=0)
        total = jnp.sum(dgrow, axis=0) + dg_last
        dg_ref[:, c] = (total[None, :] - jnp.cumsum(dgrow, axis=0) + dgrow).astype(dg_ref.dtype)
        dq_ref[:, c] = (scale * dqs).astype(dq_ref.dtype)
        dk_ref[:, c] = (dk_row + dk_col + dkg * kg_factor + beta_c1 * gamma * z).astype(dk_ref.dtype)
        return carry_

    lax.fori_loop(0, kd // block_k, grad_block, 0)


def intra_bwd_split(q, k, v, beta, u, w, solve_terms, dqg, dkg, dw, dv_new, daqk, d_decay, *, scale, precision,
                    config, interpret, documents=None):
    """Backward of the split intra stage (grid chunk x batch*head): ``(dq, dk, dv, dg, dbeta)`` f32, on
    chunk-padded inputs; ``solve_terms = (kk, A, G)`` from ``intra_chunk_split(..., return_solve=True)``."""
    kk, a, gc = solve_terms
    b, tp, h, kd = q.shape
    vd = v.shape[-1]
    block_k = min(config.block_k, kd, vd)
    doc_ops, doc_specs = document_operands(documents, h)

    spec = ChunkSpecs(h)
    chunk_spec, beta_spec = spec.tile, spec.rows
    decay_spec = spec.per_chunk(kd)
    return pl.pallas_call(
        functools.partial(_intra_bwd_kernel, scale=scale, precision=precision, block_k=block_k,
                          segmented=documents is not None),
        out_shape=(jax.ShapeDtypeStruct((b, tp, h, kd), _F32),
                   jax.ShapeDtypeStruct((b, tp, h, kd), _F32),
                   jax.ShapeDtypeStruct((b, tp, h, vd), _F32),
                   jax.ShapeDtypeStruct((b, tp, h, kd), _F32),
                   jax.ShapeDtypeStruct((b, tp, h), _F32)),
        grid=(tp // CHUNK, b * h),
        in_specs=[chunk_spec(kd), chunk_spec(kd), chunk_spec(vd), beta_spec, chunk_spec(vd), chunk_spec(kd),
                  chunk_spec(kd), chunk_spec(CHUNK), chunk_spec(CHUNK),
                  chunk_spec(kd), chunk_spec(kd), chunk_spec(kd), chunk_spec(vd), chunk_spec(CHUNK), decay_spec]
        + doc_specs,
        out_specs=[chunk_spec(kd), chunk_spec(kd), chunk_spec(vd), chunk_spec(kd), beta_spec],
        interpret=interpret,
        compiler_params=triton_params(interpret, config.warps[0]),
        name="kda_bwd_intra_split",
    )(q, k, v, beta, u, w, gc, kk, a, dqg, dkg, dw, dv_new, daqk, d_decay, *doc_ops)
