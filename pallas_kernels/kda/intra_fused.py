"""Intra-chunk stage as a fused gram + solve kernel, then the split apply kernel (``KernelConfig.intra="fused2"``,
the default).

Same results as ``intra_split.intra_chunk_split`` (``qg, kg, w, u, aqk, decay`` and, with ``return_solve``, the
backward's ``(kk, A, G)``); the split stage's XLA cumulative gate, gram and solve passes become one kernel, so the
pairwise products never leave the chip:

1. per key block: ``G`` = chunk-local inclusive cumulative sum of ``g * log2(e)`` (in-kernel scan; with ``gate``
   the raw K3 gate is activated first), ``qg``, ``kg``, ``decay`` and the four 16-row blocks of ``aqk`` / ``kk`` as
   [16, BK] x [BK, 64] products, every row block referenced to its first row (the split gram's exponent ranges);
2. ``A = (I + akk)^-1`` by rows of 16: ``A_i = inv_i (E_i - sum_{j<i} akk_ij A_j)`` with ``inv_i`` the 16x16
   diagonal inverse and ``E_i`` the rows ``16 i ..`` of the identity (the product with ``E_i`` places ``inv_i`` in
   its columns, so no 64x64 tile is ever assembled from blocks); writes ``A`` and ``G``;
3. ``apply_call``: ``u = A (beta v)``, ``w = A (beta k 2^G)`` with 64-row products (few registers).

(Phase 3 inside the same kernel, once ``intra="fused"``, measured slower on an H200 — 4.51 vs 2.46 ms at 1x8192x96
bf16 — and was removed.) Packed documents are masked exactly as in the split kernels.
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
    UNIT_LOWER_INVERSES,
    ChunkSpecs,
    cumulative_gate_tile,
    document_operands,
    dot,
    dot_nt,
    gate_operands,
    matmul_policy,
    rows_masked,
    take_row,
)
from pallas_kernels.tiling import triton_params

__all__ = ["apply_call", "intra_chunk_fused"]

_N_SUB = CHUNK // SUB_CHUNK
_F32 = jnp.float32


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
    operand = u_ref.dtype  # dot operands: bf16 for bf16 inputs (A rounded to bf16, as fla's w/u kernel), f32 for f32
    a_op = a_cc.astype(operand)

    def u_block(vb, carry_):
        c = pl.ds(pl.multiple_of(vb * block_k, block_k), block_k)
        rhs = (beta_c1 * v_ref[:, c].astype(_F32)).astype(operand)
        u_ref[:, c] = dot(a_op, rhs, precision).astype(u_ref.dtype)
        return carry_

    def w_block(kb, carry_):
        c = pl.ds(pl.multiple_of(kb * block_k, block_k), block_k)
        rhs = rows_masked(beta_c1 * k_ref[:, c].astype(_F32) * jnp.exp2(gc_ref[:, c]), carry)
        w_ref[:, c] = dot(a_op, rhs.astype(operand), precision).astype(w_ref.dtype)
        return carry_

    lax.fori_loop(0, v_ref.shape[-1] // block_k, u_block, 0)
    lax.fori_loop(0, k_ref.shape[-1] // block_k, w_block, 0)


def apply_call(a, v, k, gc, beta, documents, *, inter_dtype, precision, config, interpret):
    """Kernel 3 (grid chunk x batch*head): ``(u, w)`` in ``inter_dtype`` from the 64x64 inverse ``a`` and the
    cumulative gate ``gc`` (shared by the split and "fused2" intra stages)."""
    b, tp, h, kd = k.shape
    vd = v.shape[-1]
    tile = ChunkSpecs(h).tile
    doc_ops, doc_specs = document_operands(documents, h)
    return pl.pallas_call(
        functools.partial(_apply_kernel, precision=precision, block_k=min(config.block_k, kd, vd),
                          segmented=documents is not None),
        out_shape=(jax.ShapeDtypeStruct((b, tp, h, vd), inter_dtype),
                   jax.ShapeDtypeStruct((b, tp, h, kd), inter_dtype)),
        grid=(tp // CHUNK, b * h),
        in_specs=[tile(CHUNK), tile(vd), tile(kd), tile(kd), ChunkSpecs(h).rows] + doc_specs,
        out_specs=[tile(vd), tile(kd)],
        interpret=interpret,
        compiler_params=triton_params(interpret, config.warps[0]),
        name="kda_chunk_apply",
    )(a, v, k, gc, beta, *doc_ops)


def unpack_refs(refs, lower_bound, segmented, with_solve):
    """The refs of a gram + solve kernel after q, k, g, beta, in call order: ``(gate_refs, doc_ref,
    carry [64, 1] f32, last [64, 1] f32, (qg, kg, aqk, decay, A, G, kk) output refs)``; gate / document entries
    and ``kk`` (without ``with_solve``) are None when absent."""
    refs = list(refs)
    gate_refs = doc_ref = carry_all = last_all = None
    if lower_bound is not None:  # in-kernel gate: g_ref is the raw gate input
        gate_refs, refs = (refs[0], refs[1], lower_bound), refs[2:]
    if segmented:
        doc_ref, carry_ref, last_ref = refs[:3]
        refs = refs[3:]
        carry_all = carry_ref[...].astype(_F32)[:, None]
        last_all = last_ref[...].astype(_F32)[:, None]
    outs = (*refs[:6], refs[6] if with_solve else None)
    return gate_refs, doc_ref, carry_all, last_all, outs


def _gram_solve_kernel(q_ref, k_ref, g_ref, beta_ref, *refs, scale, precision, solve, block_k, segmented,
                       with_solve, lower_bound):
    """One chunk of one (batch, head), phases 1 and 2 of the module docstring: outputs ``qg, kg, aqk, decay, A,
    G`` (+ ``kk`` with ``with_solve``). ``lower_bound`` not None: ``g_ref`` is the raw gate input, activated
    in-kernel with the first two of ``refs``."""
    gate_refs, doc_ref, carry_all, last_all, outs = unpack_refs(refs, lower_bound, segmented, with_solve)
    qg_ref, kg_ref, aqk_ref, decay_ref, a_ref, gc_ref, kk_ref = outs
    s = SUB_CHUNK
    kd = k_ref.shape[-1]
    inter_dtype = qg_ref.dtype
    operand = inter_dtype  # gram dot operands: bf16 for bf16 inputs, f32 for f32
    subs = range(_N_SUB)
    rows_c1 = jnp.arange(CHUNK, dtype=jnp.int32)[:, None]
    cols_1c = jnp.arange(CHUNK, dtype=jnp.int32)[None, :]
    rows_s1 = jnp.arange(s, dtype=jnp.int32)[:, None]

    def cols(b):
        return pl.ds(pl.multiple_of(b * block_k, block_k), block_k)

    # 1. Gram rows, qg, kg, decay.
    def gram_block(kb, acc):
        aqk, kk = list(acc[0]), list(acc[1])
        c = cols(kb)
        gc_all = cumulative_gate_tile(g_ref, c, gate_refs)  # [64, BK]
        gc_ref[:, c] = gc_all
        gc_sub = jnp.split(gc_all, _N_SUB, axis=0)  # four [16, BK] row blocks
        g_last = take_row(gc_sub[-1], s - 1)[None, :]  # [1, BK]
        k_all = k_ref[:, c].astype(_F32)
        q_all = q_ref[:, c].astype(_F32) * scale
        qg_ref[:, c] = rows_masked(q_all * jnp.exp2(gc_all), carry_all).astype(inter_dtype)
        kg_ref[:, c] = rows_masked(k_all * jnp.exp2(g_last - gc_all), last_all).astype(inter_dtype)
        for i in subs:
            rows = pl.ds(i * s, s)
            first = take_row(gc_sub[i], 0)[None, :]  # G at the first row of sub-chunk i
            from_first = jnp.exp2(gc_sub[i] - first)  # exponent <= 0
            # Columns up to the end of sub-chunk i, referenced to its first row (<= 15 tokens of growth).
            k_cols = k_all * jnp.exp2(jnp.where(rows_c1 < (i + 1) * s, first - gc_all, -jnp.inf))
            q_i = q_ref[rows, c].astype(_F32) * scale
            k_i = k_ref[rows, c].astype(_F32)
            k_cols_op = k_cols.astype(operand)  # 16-bit operands for 16-bit inputs (as the recurrence's dots)
            aqk[i] = aqk[i] + dot_nt((q_i * from_first).astype(operand), k_cols_op, precision)
            kk[i] = kk[i] + dot_nt((k_i * from_first).astype(operand), k_cols_op, precision)
        decay_ref[c] = jnp.exp2(g_last[0])
        return aqk, kk

    zeros = [jnp.zeros((s, CHUNK), _F32)] * _N_SUB
    aqk_rows, kk_rows = lax.fori_loop(0, kd // block_k, gram_block, (zeros, zeros))

    # 2. Masks, then A = (I + diag(beta) kk)^-1 by rows of 16.
    doc_all = doc_ref[...] if segmented else None
    a_rows = []
    for i in subs:
        rows = pl.ds(i * s, s)
        row_ids = i * s + rows_s1
        keep_a, keep_k = cols_1c <= row_ids, cols_1c < row_ids
        if segmented:
            same = doc_ref[rows][:, None] == doc_all[None, :]
            keep_a, keep_k = keep_a & same, keep_k & same
        aqk_ref[rows, :] = jnp.where(keep_a, aqk_rows[i], 0.0).astype(inter_dtype)
        kk_i = jnp.where(keep_k, kk_rows[i], 0.0)
        if with_solve:
            kk_ref[rows, :] = kk_i
        akk_blocks = jnp.split(beta_ref[rows].astype(_F32)[:, None] * kk_i, _N_SUB, axis=1)  # [16, 16] each
        rhs = jnp.where(cols_1c == row_ids, 1.0, 0.0).astype(_F32)  # E_i
        for j in range(i):
            rhs = rhs - dot(akk_blocks[j], a_rows[j], precision)
        a_i = dot(UNIT_LOWER_INVERSES[solve](akk_blocks[i]), rhs, precision)
        a_ref[rows, :] = a_i
        a_rows.append(a_i)



def gram_solve_then_apply(kernel, name, q, k, v, g, beta, *, scale, config, interpret, documents, return_solve,
                          gate):
    """Runs a gram + solve ``kernel`` (grid chunk x batch*head; outputs ``qg, kg, aqk, decay, A, G`` + ``kk`` with
    ``return_solve``; keyword arguments as ``_gram_solve_kernel``'s), then ``apply_call``: the results
    of ``intra_split.intra_chunk_split``. Shared by "fused2" and "pairs"."""
    b, tp, h, kd = q.shape
    vd = v.shape[-1]
    n = tp // CHUNK
    inter_dtype, precision = matmul_policy(q.dtype)
    segmented = documents is not None
    doc_ops, doc_specs = document_operands(documents, h)
    gate_ops, gate_specs = gate_operands(gate, h)
    spec = ChunkSpecs(h)
    tile = spec.tile

    def shape(width, dtype=inter_dtype):
        return jax.ShapeDtypeStruct((b, tp, h, width), dtype)

    out_shape = [shape(kd), shape(kd), shape(CHUNK), jax.ShapeDtypeStruct((b, h, n, kd), _F32),
                 shape(CHUNK, _F32), shape(kd, _F32)]  # qg kg aqk decay A G
    out_specs = [tile(kd), tile(kd), tile(CHUNK), spec.per_chunk(kd), tile(CHUNK), tile(kd)]
    if return_solve:
        out_shape.append(shape(CHUNK, _F32))  # kk
        out_specs.append(tile(CHUNK))
    outs = pl.pallas_call(
        functools.partial(kernel, scale=scale, precision=precision, solve=config.solve,
                          block_k=min(config.block_k, kd, vd), segmented=segmented, with_solve=return_solve,
                          lower_bound=None if gate is None else gate[2]),
        out_shape=tuple(out_shape),
        grid=(n, b * h),
        in_specs=[tile(kd), tile(kd), tile(kd), spec.rows] + gate_specs + doc_specs,
        out_specs=out_specs,
        interpret=interpret,
        compiler_params=triton_params(interpret, config.warps[0]),
        name=name,
    )(q, k, g, beta, *gate_ops, *doc_ops)
    qg, kg, aqk, decay, a, gc = outs[:6]
    u, w = apply_call(a, v, k, gc, beta, documents, inter_dtype=inter_dtype, precision=precision, config=config,
                      interpret=interpret)
    if segmented:
        decay = decay * documents["keep"][:, None, :, None]
    if return_solve:
        return qg, kg, w, u, aqk, decay, (outs[6], a, gc)
    return qg, kg, w, u, aqk, decay


def intra_chunk_fused(q, k, v, g, beta, *, scale, config, interpret=False, documents=None, return_solve=False,
                      gate=None):
    """``intra_split.intra_chunk_split`` (same arguments and results) through the gram + solve kernel (writing
    ``A`` and ``G``), then the split stage's apply kernel. ``gate``: see ``chunk_fwd.intra_chunk``."""
    return gram_solve_then_apply(_gram_solve_kernel, "kda_chunk_gram_solve", q, k, v, g, beta, scale=scale,
                                 config=config, interpret=interpret, documents=documents,
                                 return_solve=return_solve, gate=gate)
