"""Backward of the intra-chunk stage as two small-footprint kernels (``KernelConfig.intra_bwd="tiled"``).

Reads the split forward's solve terms (``intra_split.intra_chunk_split(..., return_solve=True)``: pairwise key
products ``kk``, ``A = (I + diag(beta) kk)^-1`` and the chunk-local cumulative gate ``G``, base 2) and the state
gradients (``chunk_bwd.state_grads``), and writes the same ``(dq, dk, dv, dg, dbeta)`` as ``chunk_bwd.intra_bwd``.
Notation as in ``chunk_bwd.py`` (q~ = scale q, ``gamma = 2^G`` on rows of the carried-in document, ``kgf = 2^(G_L
- G)`` on rows of the chunk's last document).

1. ``solve_grads`` (grid chunk x batch*head): the quantities that reduce over all key / value columns, as 64x64 @
   64xBK products: ``y = A^T dv'`` (``dv = beta y``), ``z = A^T dw`` (written, f32), ``dakk = -strict(y u^T + z w^T)``,
   ``dbeta = rowsum(y v) + rowsum(z k gamma) + rowsum(dakk kk)`` and ``dkk = diag(beta) dakk`` (written, f32).
   Live: the 64x64 f32 ``dakk`` accumulator and one column block's tiles.
2. ``pair_grads`` (grid key block x chunk x batch*head, key block fastest so the programs sharing a chunk's 64x64
   cotangents run together): the gradients through the pairwise products for one [64, BK] key block, one 16-row
   block ``r`` per loop step (last to first), each step four [16, 64] x [64, BK] products:

   * rows of ``r`` as the product's row: ``dq~_r = F (daqk[r, :] (k E))``, ``dk_row_r = F (dkk[r, :] (k E))``,
   * rows of ``r`` as the product's column: ``dk_col_r = P (daqk[:, r]^T (q~ R) + dkk[:, r]^T (k R))``,

   with every decay taken relative to the middle row ``m`` of ``r`` (the single kernel's sub-chunk midpoint):
   ``F = 2^(G_r - G_m)``, ``E = 2^(G_m - G_c)`` on columns up to the end of ``r``, ``R = 2^(G_i - G_m)`` on rows
   from the start of ``r``, ``P = 2^(G_m - G_c)`` on ``r``. Within ``r`` every exponent is at most 8 tokens of decay
   (<= 58 in base 2 at the -5 gate bound: finite in f32); outside ``r`` the factor on the far side has exponent <= 0,
   and where it underflows the true product is below 2^(58-126) of its operands (negligible). Looping from the last
   block, ``dk_col_r`` is final when ``r`` is reached, so the gate gradient ``dG = q~ dq~ + k (dk_row - dk_col) -
   dkg k kgf + z beta k gamma`` is reverse-summed per step with the later blocks' total as the carry (starting at
   ``dG_L = d(2^G_L) 2^G_L + sum_rows(dkg k kgf)``).

   Live: a few [64, BK] f32 tiles of one step and the [BK] carry; the 64x64 cotangents are read from memory as
   [16, 64] / [64, 16] dot operands.

Numerics: f32 elementwise and accumulation; matmul precision per ``chunk_fwd._matmul_policy`` (TF32 / full f32).
Packed documents (``chunk_fwd.document_layout``) mask exactly as the other backward kernels.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pallas_kernels.kda.common import (
    CHUNK,
    SUB_CHUNK,
    ChunkSpecs,
    block_cols,
    document_operands,
    dot,
    dot_nt,
    dot_tn,
    rows_masked,
)
from pallas_kernels.tiling import triton_params

__all__ = ["intra_bwd_tiled", "key_block_spec", "key_block_update", "pair_block", "pair_grads", "solve_grads",
           "store_block", "value_block_grads"]

_N_SUB = CHUNK // SUB_CHUNK
_F32 = jnp.float32



def value_block_grads(a_ref, dvnew_ref, u_ref, v_ref, dv_ref, beta_c1, *, block_k, precision):
    """The loop body over value blocks shared by the solve-gradient kernels: ``y = A^T dv'``, ``dv = beta y``
    (stored), and the ``(dakk, dbeta)`` accumulator updated by ``- y u^T`` and ``rowsum(y v)``."""
    def body(vb, acc):
        dakk, dbeta = acc
        c = block_cols(vb, block_k)
        y = dot_tn(a_ref[...], dvnew_ref[:, c].astype(_F32), precision)  # A^T dv'
        dv_ref[:, c] = (beta_c1 * y).astype(dv_ref.dtype)
        dakk = dakk - dot_nt(y, u_ref[:, c].astype(_F32), precision)
        return dakk, dbeta + jnp.sum(y * v_ref[:, c].astype(_F32), axis=1)
    return body


def key_block_update(acc, z, c, w_ref, k_ref, gc_ref, carry, precision):
    """The ``(dakk, dbeta)`` accumulator of the solve-gradient kernels updated for key block ``c`` of ``z = A^T dw``
    (``- z w^T`` and ``rowsum(z k 2^G)``), and ``gamma = 2^G`` (rows outside the carried-in document zero)."""
    dakk, dbeta = acc
    gamma = rows_masked(jnp.exp2(gc_ref[:, c]), carry)
    dakk = dakk - dot_nt(z, w_ref[:, c].astype(_F32), precision)
    return (dakk, dbeta + jnp.sum(z * k_ref[:, c].astype(_F32) * gamma, axis=1)), gamma


def _solve_grads_kernel(a_ref, kk_ref, beta_ref, du_ref, u_ref, v_ref, dw_ref, w_ref, k_ref, gc_ref, *refs,
                        precision, block_k, segmented):
    """One chunk of one (batch, head): ``dv``, ``z``, ``dkk``, ``dbeta`` (see the module docstring, kernel 1)."""
    if segmented:
        doc_ref, carry_ref, dv_ref, z_ref, dkk_ref, dbeta_ref = refs
        carry = carry_ref[...].astype(_F32)[:, None]
    else:
        dv_ref, z_ref, dkk_ref, dbeta_ref = refs
        carry = None
    kd, vd = k_ref.shape[-1], v_ref.shape[-1]
    beta_c1 = beta_ref[...].astype(_F32)[:, None]

    y_block = value_block_grads(a_ref, du_ref, u_ref, v_ref, dv_ref, beta_c1, block_k=block_k, precision=precision)

    def z_block(kb, acc):
        c = block_cols(kb, block_k)
        z = dot_tn(a_ref[...], dw_ref[:, c].astype(_F32), precision)  # A^T dw
        z_ref[:, c] = z.astype(z_ref.dtype)
        return key_block_update(acc, z, c, w_ref, k_ref, gc_ref, carry, precision)[0]

    acc = (jnp.zeros((CHUNK, CHUNK), _F32), jnp.zeros((CHUNK,), _F32))
    acc = lax.fori_loop(0, vd // block_k, y_block, acc)
    dakk, dbeta = lax.fori_loop(0, kd // block_k, z_block, acc)
    rows_c1 = jnp.arange(CHUNK, dtype=jnp.int32)[:, None]
    keep = jnp.arange(CHUNK, dtype=jnp.int32)[None, :] < rows_c1
    if segmented:
        keep = keep & (doc_ref[...][:, None] == doc_ref[...][None, :])
    dakk = jnp.where(keep, dakk, 0.0)
    dbeta_ref[...] = (dbeta + jnp.sum(dakk * kk_ref[...], axis=1)).astype(dbeta_ref.dtype)
    dkk_ref[...] = beta_c1 * dakk


def pair_block(q_ref, k_ref, gc_ref, daqk_ref, dkk_ref, doc_ref, i, *, scale, precision):
    """The pairwise-product gradients of 16-row block ``r = 3 - i`` of one [64, BK] key block (shared by the tiled
    and state_fused pair kernels): ``(rows, q~_r, k_r, dq~_pairs, dk_row, dk_col)``, f32.

    ``dq~_pairs = F (daqk[r, :] (k E))``, ``dk_row = F (dkk[r, :] (k E))``, ``dk_col = P (daqk[:, r]^T (q~ R) +
    dkk[:, r]^T (k R))`` with every decay relative to the middle row m of r (module docstring, kernel 2); the
    cotangent blocks are masked to the causal pairs and, with ``doc_ref``, to pairs inside one document.
    """
    mm = q_ref.dtype if precision == lax.Precision.DEFAULT else _F32  # dot operands (bf16 inputs: bf16)
    s = SUB_CHUNK
    rows_c1 = jnp.arange(CHUNK, dtype=jnp.int32)[:, None]
    cols_1c = jnp.arange(CHUNK, dtype=jnp.int32)[None, :]
    start = pl.multiple_of((_N_SUB - 1 - i) * s, s)
    rows = pl.ds(start, s)
    gc = gc_ref[...]  # [64, BK], reloaded per step (not live across steps)
    k = k_ref[...].astype(_F32)
    gc_r = gc_ref[rows, :]
    mid = gc_ref[pl.ds(start + s // 2, 1), :]  # [1, BK] reference row m
    # Cotangent blocks: row block r [16, 64] (columns j <= i) and column block r [64, 16] (rows i >= j).
    keep_row = cols_1c <= start + jnp.arange(s, dtype=jnp.int32)[:, None]
    keep_col = rows_c1 >= start + jnp.arange(s, dtype=jnp.int32)[None, :]
    if doc_ref is not None:
        doc_all, doc_r = doc_ref[...], doc_ref[rows]
        keep_row = keep_row & (doc_r[:, None] == doc_all[None, :])
        keep_col = keep_col & (doc_all[:, None] == doc_r[None, :])
    daqk_row = jnp.where(keep_row, daqk_ref[rows, :], 0.0).astype(mm)
    daqk_col = jnp.where(keep_col, daqk_ref[:, rows], 0.0).astype(mm)

    # r as the row: columns up to the end of r, referenced to m.
    k_e = (k * jnp.exp2(jnp.where(rows_c1 < start + s, mid - gc, -jnp.inf))).astype(mm)
    f_r = jnp.exp2(gc_r - mid)
    dq_pairs = f_r * dot(daqk_row, k_e, precision)
    dk_row = f_r * dot(dkk_ref[rows, :].astype(mm), k_e, precision)

    # r as the column: rows from the start of r, referenced to m.
    rr = jnp.exp2(jnp.where(rows_c1 >= start, gc - mid, -jnp.inf))
    q_rr = (q_ref[...].astype(_F32) * (scale * rr)).astype(mm)
    dk_col = jnp.exp2(mid - gc_r) * (dot_tn(daqk_col, q_rr, precision)
                                     + dot_tn(dkk_ref[:, rows].astype(mm), (k * rr).astype(mm), precision))
    q_r = q_ref[rows, :].astype(_F32) * scale
    return rows, q_r, k_ref[rows, :].astype(_F32), dq_pairs, dk_row, dk_col


def store_block(dq_ref, dk_ref, dg_ref, rows, acc, q_r, k_r, dqs, dk_row, dk_col, kg_term, z_term, *, scale):
    """Writes one 16-row block's ``dq``, ``dk`` and ``dg`` (the reverse cumulative sum inside the chunk, with the
    later blocks' total ``acc`` as the carry) and returns the new carry. ``kg_term`` = ``dkg 2^(G_L - G)`` (the
    state-product gradient through kg), ``z_term`` = ``beta 2^G z`` (through w)."""
    dgrow = q_r * dqs + k_r * (dk_row - dk_col - kg_term + z_term)
    blk = jnp.sum(dgrow, axis=0)
    dg_ref[rows, :] = ((acc + blk)[None, :] - jnp.cumsum(dgrow, axis=0) + dgrow).astype(dg_ref.dtype)
    dq_ref[rows, :] = (scale * dqs).astype(dq_ref.dtype)
    dk_ref[rows, :] = (dk_row + dk_col + kg_term + z_term).astype(dk_ref.dtype)
    return acc + blk


def _pair_grads_kernel(q_ref, k_ref, gc_ref, beta_ref, z_ref, dqg_ref, dkg_ref, daqk_ref, dkk_ref, ddecay_ref,
                       *refs, scale, precision, segmented):
    """One [64, BK] key block of one chunk of one (batch, head): ``dq``, ``dk``, ``dg`` (module docstring,
    kernel 2)."""
    if segmented:
        doc_ref, carry_ref, last_ref, dq_ref, dk_ref, dg_ref = refs
    else:
        dq_ref, dk_ref, dg_ref = refs
        doc_ref = carry_ref = last_ref = None

    def row_mask(ref, rows):
        return None if not segmented else ref[rows].astype(_F32)[:, None]

    # dG_L: the chunk decay's cotangent and every row's kg term (all rows' dg include it).
    g_last = gc_ref[pl.ds(CHUNK - 1, 1), :]  # [1, BK]
    kgf_all = rows_masked(jnp.exp2(g_last - gc_ref[...]), row_mask(last_ref, Ellipsis))
    dg_last = (ddecay_ref[...].astype(_F32) * jnp.exp2(jnp.sum(g_last, axis=0))
               + jnp.sum(dkg_ref[...].astype(_F32) * k_ref[...].astype(_F32) * kgf_all, axis=0))

    def step(i, acc):
        rows, q_r, k_r, dq_pairs, dk_row, dk_col = pair_block(q_ref, k_ref, gc_ref, daqk_ref, dkk_ref, doc_ref, i,
                                                              scale=scale, precision=precision)
        gc_r = gc_ref[rows, :]
        gamma_r = rows_masked(jnp.exp2(gc_r), row_mask(carry_ref, rows))
        dqs = dqg_ref[rows, :].astype(_F32) * gamma_r + dq_pairs
        kg_term = dkg_ref[rows, :].astype(_F32) * rows_masked(jnp.exp2(g_last - gc_r), row_mask(last_ref, rows))
        z_term = beta_ref[rows].astype(_F32)[:, None] * gamma_r * z_ref[rows, :].astype(_F32)
        return store_block(dq_ref, dk_ref, dg_ref, rows, acc, q_r, k_r, dqs, dk_row, dk_col, kg_term, z_term,
                           scale=scale)

    lax.fori_loop(0, _N_SUB, step, dg_last)


def solve_grads(a, kk, beta, dv_new, u, v, dw, w, k, gc, *, precision, config, interpret, documents=None):
    """Kernel 1 (grid chunk x batch*head): ``(dv, z, dkk, dbeta)`` on chunk-padded inputs (dv in v's dtype, the
    rest f32)."""
    b, tp, h, kd = k.shape
    vd = v.shape[-1]
    block_k = min(config.block_k, kd, vd)
    spec = ChunkSpecs(h)
    segmented = documents is not None
    doc_ops, doc_specs = document_operands(documents, h)
    if segmented:  # doc and carry only
        doc_ops, doc_specs = doc_ops[:2], doc_specs[:2]
    return pl.pallas_call(
        functools.partial(_solve_grads_kernel, precision=precision, block_k=block_k, segmented=segmented),
        out_shape=(jax.ShapeDtypeStruct((b, tp, h, vd), v.dtype),  # dv: stored once, in the gradient's dtype
                   jax.ShapeDtypeStruct((b, tp, h, kd), _F32),
                   jax.ShapeDtypeStruct((b, tp, h, CHUNK), _F32),
                   jax.ShapeDtypeStruct((b, tp, h), _F32)),
        grid=(tp // CHUNK, b * h),
        in_specs=[spec.tile(CHUNK), spec.tile(CHUNK), spec.rows, spec.tile(vd), spec.tile(vd), spec.tile(vd),
                  spec.tile(kd), spec.tile(kd), spec.tile(kd), spec.tile(kd)] + doc_specs,
        out_specs=[spec.tile(vd), spec.tile(kd), spec.tile(CHUNK), spec.rows],
        interpret=interpret,
        compiler_params=triton_params(interpret, config.warps[0]),
        name="kda_bwd_intra_solve_grads",
    )(a, kk, beta, dv_new, u, v, dw, w, k, gc, *doc_ops)


def key_block_spec(h, block_k, width=None):
    """Block spec on the pair kernels' (key block j, chunk c, batch*head) grid: the [64, block_k] columns of key
    block j of a chunk tile, or with ``width`` the whole [64, width] tile."""
    if width is None:
        return pl.BlockSpec((None, CHUNK, None, block_k), lambda j, c, bh: (bh // h, c, bh % h, j))
    return pl.BlockSpec((None, CHUNK, None, width), lambda j, c, bh: (bh // h, c, bh % h, 0))


def pair_grads(q, k, gc, beta, z, dqg, dkg, daqk, dkk, d_decay, *, scale, precision, config, interpret,
               documents=None):
    """Kernel 2 (grid key block x chunk x batch*head): ``(dq, dk, dg)`` on chunk-padded inputs (dq, dk in q's / k's
    dtype: the one rounding the caller would apply, without an f32 round trip; dg f32)."""
    b, tp, h, kd = q.shape
    block_k = min(config.block_k, kd)
    segmented = documents is not None

    def key_block(width=None):
        return key_block_spec(h, block_k, width)

    rows = pl.BlockSpec((None, CHUNK, None), lambda j, c, bh: (bh // h, c, bh % h))
    decay_spec = pl.BlockSpec((None, None, None, block_k), lambda j, c, bh: (bh // h, bh % h, c, j))
    doc_ops = [] if not segmented else [documents["doc"], documents["carry"], documents["last"]]
    doc_specs = [pl.BlockSpec((None, CHUNK), lambda j, c, bh: (bh // h, c))] * len(doc_ops)
    return pl.pallas_call(
        functools.partial(_pair_grads_kernel, scale=scale, precision=precision, segmented=segmented),
        out_shape=(jax.ShapeDtypeStruct((b, tp, h, kd), q.dtype), jax.ShapeDtypeStruct((b, tp, h, kd), k.dtype),
                   jax.ShapeDtypeStruct((b, tp, h, kd), _F32)),
        grid=(kd // block_k, tp // CHUNK, b * h),
        in_specs=[key_block(), key_block(), key_block(), rows, key_block(), key_block(), key_block(),
                  key_block(CHUNK), key_block(CHUNK), decay_spec] + doc_specs,
        out_specs=[key_block()] * 3,
        interpret=interpret,
        compiler_params=triton_params(interpret, config.warps[0]),
        name="kda_bwd_intra_pair_grads",
    )(q, k, gc, beta, z, dqg, dkg, daqk, dkk, d_decay, *doc_ops)


def intra_bwd_tiled(q, k, v, beta, u, w, solve_terms, dqg, dkg, dw, dv_new, daqk, d_decay, *, scale, precision,
                    config, interpret, documents=None):
    """``chunk_bwd.intra_bwd``'s results ``(dq, dk, dv, dg, dbeta)`` (f32, chunk-padded) through the two kernels;
    ``solve_terms = (kk, A, G)`` from ``intra_split.intra_chunk_split(..., return_solve=True)``."""
    kk, a, gc = solve_terms
    kw = {"precision": precision, "config": config, "interpret": interpret, "documents": documents}
    dv, z, dkk, dbeta = solve_grads(a, kk, beta, dv_new, u, v, dw, w, k, gc, **kw)
    dq, dk, dg = pair_grads(q, k, gc, beta, z, dqg, dkg, daqk, dkk, d_decay, scale=scale, **kw)
    return dq, dk, dv, dg, dbeta
