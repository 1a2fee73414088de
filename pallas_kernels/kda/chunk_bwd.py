"""Pallas chunkwise KDA backward: gradients of q, k, v, g, beta and the initial state (issue 6).

Residuals are the forward's inputs only (the forward stays as light as the XLA path's); the backward recomputes.
Notation as in ``chunk_fwd.py``: per chunk of C = 64 rows, ``G`` is the within-chunk inclusive cumulative
log-decay (base 2 inside the kernels, so exponentials are ``exp2``), ``S_n`` the state entering chunk ``n``, and
``v' = u - w S_n``; ``o = qg S_n + aqk v'``; ``S_{n+1} = diag(2^G_L) S_n + kg^T v'``.

Five kernels (all generic Pallas: Triton GPU backend, or ``interpret=True`` on CPU):

1. ``intra`` (forward kernel 1, reused; grid chunk x head): ``qg, kg, w, u, aqk, decay``.
2. ``states`` (chunk_fwd.chunk_states: grid head x value block, chunks in order, f32 state in registers): stores
   every chunk-entry state ``S_n`` (the matmul dtype: bf16 for bf16 inputs, exactly the operand the forward used)
   and ``v'``.
3. ``reverse`` (grid head x value block, chunks in reverse, f32 state gradient ``dS`` in registers; ``dS`` starts
   at the final-state cotangent): per chunk stores ``dS_{n+1}`` and
   ``dv' = aqk^T dO + kg dS_{n+1}``, then ``dS_n = diag(2^G_L) dS_{n+1} + qg^T dO - w^T dv'``; the last ``dS_0``
   is the initial-state gradient.
4. ``state_grads`` (grid chunk x head x key block, parallel): the chunk's gradients through the state products,
   ``dqg = dO S_n^T``, ``dw = -dv' S_n^T``, ``dkg = v' dS_{n+1}^T``, ``daqk = tril(dO v'^T)`` and
   ``d(2^G_L) = rowsum(S_n * dS_{n+1})``.
5. ``intra_bwd`` (grid chunk x head, parallel): back through the intra-chunk algebra. With ``A = (I + akk)^-1``:
   ``y = A^T dv'`` (= d(beta v)) and ``z = A^T dw`` (= d(beta k 2^G)) by blocked back substitution over the 16-row
   sub-chunks; ``dakk = -strict_tril(y u^T + z w^T)``; then the pairwise products ``aqk``/``akk`` are
   differentiated with the forward's factorisation (16-row sub-chunks, midpoint exponents on the diagonal blocks,
   the first row of the later sub-chunk as reference off the diagonal: every factor is finite in f32 for gates
   >= -5), which gives dq, dk, dv, dbeta and the per-row gradient ``dG`` of the cumulative decay:
   ``dG = q~ . dq~ + k . (dk_row - dk_col) - dkg . kg + z . (beta k 2^G)`` (q~ = scale q; ``dk_row``/``dk_col``
   the gradients of the row / column factor of the pairwise products) and ``dG_L = sum_rows(dkg . kg) +
   d(2^G_L) . 2^G_L``. The gate gradient is their reverse cumulative sum inside the chunk,
   ``dg_i = sum_{r >= i} dG_r + dG_L`` (natural-log units: d 2^(G log2 e) / dG = 2^(G log2 e)).
   ``KernelConfig(intra="split")`` uses the split stage's backward (``intra_split.intra_bwd_split``);
   ``KernelConfig(intra_bwd="tiled")`` recomputes through the split kernels and replaces kernel 5 by two
   small-footprint kernels (``intra_bwd_tiled.py``: solve gradients per chunk, then per key block the pairwise
   products one 16-row block at a time); ``KernelConfig(intra_bwd="state_fused")`` also folds kernel 4 into
   those two (``intra_bwd_fused.py``: no f32 round trip of dqg / dkg / dw / z).

Numerics: f32 accumulation everywhere; for f32 inputs full-f32 matmuls and f32 intermediates, for bf16 inputs bf16
intermediates (states, v', dv', dS per chunk, like fla) and default-precision matmuls. Padding (T not a multiple
of 64, or packed sequences laid out on whole chunks) uses zero tokens, which do not change the function of the real
tokens, so the padded gradients are exact.

Packed sequences (``cu_seqlens``): same chunk layout as the forward; ``states`` restarts from the sequence's initial
state at its first chunk, ``reverse`` restarts from the sequence's final-state cotangent at its last chunk and
writes the initial-state gradient at its first chunk.

FLOPs per token per head (matmul products actually formed, 2 per multiply-add; C = 64, s = 16, d = K = V;
``backward_flops_per_token_head``): recomputed ``intra`` 40·s²·d/C (41 k at d = 128), ``states`` 4·d² (66 k),
``reverse`` 6·d² + 2·C·d (115 k), ``state_grads`` 6·d² + 2·C·d (115 k), ``intra_bwd`` 90·s²·d/C (92 k): total
16·d² + 4·C·d + 130·s²·d/C ≈ 428 kFLOP at d = 128, ≈ 2.7× the forward's 156 k by the same count (2.3× the 183 k
nominal figure of docs/kernels.md#kda-chunk). Forward + backward at B·T·H = 8192·96: ≈ 0.45 TFLOP, ≈ 0.6 ms of H200 bf16
matmul time. Recomputation is 41 k + 66 k of the 428 k; saving the forward's intermediates and ``S_n`` instead would
cut it at the price of ≈ 4·K + C + K·V/C extra stored values per token and head.

GPU status (H200, 1x8192x96, bf16; ``benchmarks/kda_stages.py``): reverse loop 1.3 ms, state gradients 1.7 ms,
intra backward 17.6 ms (column-blocked; 74 ms and no f32 build with whole-K tiles). Gradients verified on the GPU
against the token recurrence (``python -m benchmarks.kda_check --run``).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pallas_kernels.kda.chunk_fwd import chunk_states, intra_for_backward
from pallas_kernels.kda.common import (
    CHUNK,
    LOG2E,
    SPLIT_FAMILY,
    SUB_CHUNK,
    UNIT_LOWER_INVERSES,
    ChunkSpecs,
    KernelConfig,
    SequentialSpecs,
    check_dims,
    chunk_layout,
    document_layout,
    document_masks,
    document_operands,
    dot,
    dot_nt,
    dot_tn,
    matmul_policy,
    rows_masked,
    take_row,
)
from pallas_kernels.kda.intra_bwd_fused import intra_bwd_state_fused
from pallas_kernels.kda.intra_bwd_tiled import intra_bwd_tiled
from pallas_kernels.kda.intra_split import intra_bwd_split
from pallas_kernels.tiling import triton_params

__all__ = ["backward_flops_per_token_head", "chunk_kda_bwd"]

_N_SUB = CHUNK // SUB_CHUNK
_F32 = jnp.float32
_DEFAULT_CONFIG = KernelConfig()


# ---------------------------------------------------------------------------------------------------------------
# Kernel 3: state gradient (reverse order)
# ---------------------------------------------------------------------------------------------------------------


def _reverse_kernel(qg_ref, kg_ref, w_ref, aqk_ref, decay_ref, do_ref, *refs, n_chunks, kd, precision, varlen):
    """All chunks of one (head, value block) in reverse; the f32 ``dS [K, BV]`` is the loop carry.

    Stores ``dS_{n+1}`` (rows ``n*K ..``) and ``dv'`` per chunk; writes ``dS_0`` (per sequence with varlen).
    """
    if varlen:
        seq_ref, first_ref, last_ref, dsn_ref, dsend_ref, dvnew_ref, ds0_ref = refs
    else:
        dsn_ref, dsend_ref, dvnew_ref, ds0_ref = refs
    mm_dtype = qg_ref.dtype

    def body(i, ds_kv):
        n = n_chunks - 1 - i
        if varlen:
            seq = seq_ref[n]
            ds_kv = jnp.where(last_ref[n] != 0, dsn_ref[seq].astype(_F32), ds_kv)
        rows = pl.ds(pl.multiple_of(n * CHUNK, CHUNK), CHUNK)
        ds_mm = ds_kv.astype(mm_dtype)
        dsend_ref[pl.ds(pl.multiple_of(n * kd, kd), kd), :] = ds_mm
        do_cv = do_ref[rows, :].astype(mm_dtype)
        dv_new = dot_tn(aqk_ref[rows, :], do_cv, precision) + dot(kg_ref[rows, :], ds_mm, precision)
        dv_new_mm = dv_new.astype(mm_dtype)
        dvnew_ref[rows, :] = dv_new_mm
        ds_kv = (decay_ref[n, :].astype(_F32)[:, None] * ds_kv + dot_tn(qg_ref[rows, :], do_cv, precision)
                 - dot_tn(w_ref[rows, :], dv_new_mm, precision))
        if varlen:
            @pl.when(first_ref[n] != 0)
            def _store_initial_grad():
                ds0_ref[seq] = ds_kv
        return ds_kv

    if varlen:
        lax.fori_loop(0, n_chunks, body, jnp.zeros(ds0_ref.shape[-2:], _F32))
    else:
        ds0_ref[...] = lax.fori_loop(0, n_chunks, body, dsn_ref[...].astype(_F32))


# ---------------------------------------------------------------------------------------------------------------
# Kernel 4: gradients through the state products (parallel over chunks)
# ---------------------------------------------------------------------------------------------------------------


def _state_grads_kernel(do_ref, vnew_ref, dvnew_ref, s_ref, ds_ref,
                        dqg_ref, dkg_ref, dw_ref, daqk_ref, ddecay_ref, *, precision):
    """One chunk of one (batch, head) and one block of BK key rows: the ``[C, BK]`` columns of dqg / dw / dkg and
    ``BK`` entries of d(2^G_L); the key-independent ``daqk`` by the first key block only. Blocking the keys keeps
    the ``[BK, V]`` state tiles small (whole f32 ``[K, V]`` tiles overflow shared memory at K = V = 128)."""
    mm_dtype = vnew_ref.dtype
    do_cv = do_ref[...].astype(mm_dtype)
    vnew_cv = vnew_ref[...]
    s_kv = s_ref[...]
    ds_kv = ds_ref[...]
    dqg_ref[...] = dot_nt(do_cv, s_kv, precision)
    dw_ref[...] = -dot_nt(dvnew_ref[...], s_kv, precision)
    dkg_ref[...] = dot_nt(vnew_cv, ds_kv, precision)
    ddecay_ref[...] = jnp.sum(s_kv.astype(_F32) * ds_kv.astype(_F32), axis=1)

    @pl.when(pl.program_id(2) == 0)
    def _key_independent():
        rows_c1 = jnp.arange(CHUNK, dtype=jnp.int32)[:, None]
        cols_1c = jnp.arange(CHUNK, dtype=jnp.int32)[None, :]
        daqk_ref[...] = jnp.where(rows_c1 >= cols_1c, dot_nt(do_cv, vnew_cv, precision), 0.0)


# ---------------------------------------------------------------------------------------------------------------
# Kernel 5: back through the intra-chunk algebra (parallel over chunks)
# ---------------------------------------------------------------------------------------------------------------


def _intra_bwd_kernel(q_ref, k_ref, v_ref, g_ref, beta_ref, u_ref, w_ref,
                      dqg_ref, dkg_ref, dw_ref, du_ref, daqk_ref, ddecay_ref, *refs, scale, precision, solve, block_k,
                      segmented):
    """One chunk of one (batch, head). See the module docstring (kernel 5) for the formulas.

    Column-blocked like the forward's intra kernel (everything but the 16x16 sub-chunk products is elementwise in
    the key / value column, the decay bookkeeping included): pass A accumulates the pairwise key products ``kk``
    over key blocks; pass B (value blocks) forms ``y = A^T du``, writes ``dv`` and accumulates its part of ``dakk``
    and ``dbeta``; pass C (key blocks) does the same for ``z = A^T dw``; pass D (key blocks) recomputes the decay
    factors and ``z`` and writes ``dq``, ``dk``, ``dg``. Only [16, block_k] tiles and 16x16 blocks are live.

    ``segmented``: the forward's document masks (fixed 0/1 factors) multiply the same terms here: pairwise
    products and their cotangents across documents, ``2^G`` on rows outside the carried-in document and the
    chunk-end factor on rows outside the last document (the chunk decay's cotangent is masked by the caller).
    """
    if segmented:
        doc_ref, carry_ref, last_ref, dq_ref, dk_ref, dv_ref, dg_ref, dbeta_ref = refs
    else:
        dq_ref, dk_ref, dv_ref, dg_ref, dbeta_ref = refs
    s = SUB_CHUNK
    kd = q_ref.shape[-1]
    vd = v_ref.shape[-1]
    rows_s1 = jnp.arange(s, dtype=jnp.int32)[:, None]
    cols_1s = jnp.arange(s, dtype=jnp.int32)[None, :]
    incl_ss = rows_s1 >= cols_1s
    strict_ss = rows_s1 > cols_1s
    subs = range(_N_SUB)
    pairs = [(i, j) for i in subs for j in range(i + 1)]
    beta = [beta_ref[pl.ds(i * s, s)].astype(_F32)[:, None] for i in subs]
    zeros_ss = jnp.zeros((s, s), _F32)
    zeros_s = jnp.zeros((s,), _F32)
    masks = document_masks(doc_ref, carry_ref, last_ref) if segmented else None
    carry_rows = masks["carry"] if segmented else [None] * _N_SUB
    last_rows = masks["last"] if segmented else [None] * _N_SUB

    def same_doc(blocks):
        return blocks if not segmented else {p: jnp.where(masks["same"][p], x, 0.0) for p, x in blocks.items()}

    def cols(kb):
        return pl.ds(pl.multiple_of(kb * block_k, block_k), block_k)

    def load(ref, i, c):
        return ref[pl.ds(i * s, s), c].astype(_F32)

    def factors(kb):
        """Decay bookkeeping of one key block, as in the forward kernel (base 2)."""
        c = cols(kb)
        g = [load(g_ref, i, c) * LOG2E for i in subs]
        local = [jnp.cumsum(gi, axis=0) for gi in g]
        total = [jnp.sum(gi, axis=0) for gi in g]
        first = [take_row(x, 0) for x in local]
        mid = [take_row(x, s // 2) for x in local]
        zeros_k = jnp.zeros_like(total[0])
        before = [sum(total[:i], zeros_k) for i in subs]
        after = [sum(total[i + 1:], zeros_k) for i in subs]
        to_end = [jnp.exp2(jnp.minimum(total[i][None, :] - local[i], 0.0)) for i in subs]  # 2^(G_end - G)
        f = dict(g_last=before[-1] + total[-1],
                 kg_factor=[to_end[i] * jnp.exp2(after[i])[None, :] for i in subs],  # 2^(G_L - G)
                 gamma=[rows_masked(jnp.exp2(before[i][None, :] + local[i]), carry_rows[i]) for i in subs],  # 2^G
                 left=[jnp.exp2(local[i] - mid[i][None, :]) for i in subs],
                 right=[jnp.exp2(mid[i][None, :] - local[i]) for i in subs],
                 from_first=[jnp.exp2(jnp.minimum(local[i] - first[i][None, :], 0.0)) for i in subs])  # 2^(G - G_n)
        # col[i, j] (i > j): 2^(G_n(i) - G) on the rows of sub-chunk j.
        f["col"] = {(i, j): to_end[j] * jnp.exp2(sum(total[j + 1:i], zeros_k) + first[i])[None, :]
                    for i in subs for j in range(i)}
        return f


    # Pass A: kk = akk / beta (pairwise key products) over key blocks.
    def pass_a(kb, acc):
        kk = dict(zip(pairs, acc))
        f = factors(kb)
        k = [load(k_ref, i, cols(kb)) for i in subs]
        for i in subs:
            kk[i, i] = kk[i, i] + dot_nt(k[i] * f["left"][i], k[i] * f["right"][i], precision)
            k_first = k[i] * f["from_first"][i]
            for j in range(i):
                kk[i, j] = kk[i, j] + dot_nt(k_first, k[j] * f["col"][i, j], precision)
        return [kk[p] for p in pairs]

    kk = same_doc(dict(zip(pairs, lax.fori_loop(0, kd // block_k, pass_a, [zeros_ss] * len(pairs)))))
    kk = {(i, j): jnp.where(strict_ss, x, 0.0) if i == j else x for (i, j), x in kk.items()}
    akk = {(i, j): beta[i] * x for (i, j), x in kk.items()}
    inv = [UNIT_LOWER_INVERSES[solve](akk[i, i]) for i in subs]

    def back_substitute(rhs):
        """``A^T rhs`` with ``A = (I + akk)^-1``: x_i = inv_ii^T (rhs_i - sum_{m > i} akk_mi^T x_m)."""
        x = [None] * _N_SUB
        for i in reversed(subs):
            r = rhs[i]
            for m in range(i + 1, _N_SUB):
                r = r - dot_tn(akk[m, i], x[m], precision)
            x[i] = dot_tn(inv[i], r, precision)
        return x

    # Pass B (value blocks): y = A^T du, dv = beta y; dakk -= y u^T; dbeta += rowsum(y v).
    def pass_b(vb, carry):
        dakk, dbeta = dict(zip(pairs, carry[0])), list(carry[1])
        c = cols(vb)
        y = back_substitute([load(du_ref, i, c) for i in subs])
        u = [load(u_ref, i, c) for i in subs]
        for i in subs:
            dv_ref[pl.ds(i * s, s), c] = (beta[i] * y[i]).astype(dv_ref.dtype)
            dbeta[i] = dbeta[i] + jnp.sum(y[i] * load(v_ref, i, c), axis=1)
            for j in range(i + 1):
                dakk[i, j] = dakk[i, j] - dot_nt(y[i], u[j], precision)
        return [dakk[p] for p in pairs], dbeta

    def z_block(kb):
        return back_substitute([load(dw_ref, i, cols(kb)) for i in subs])

    # Pass C (key blocks): z = A^T dw; dakk -= z w^T; dbeta += rowsum(z k 2^G).
    def pass_c(kb, carry):
        dakk, dbeta = dict(zip(pairs, carry[0])), list(carry[1])
        c = cols(kb)
        z = z_block(kb)
        w = [load(w_ref, i, c) for i in subs]
        gamma = factors(kb)["gamma"]
        for i in subs:
            dbeta[i] = dbeta[i] + jnp.sum(z[i] * load(k_ref, i, c) * gamma[i], axis=1)
            for j in range(i + 1):
                dakk[i, j] = dakk[i, j] - dot_nt(z[i], w[j], precision)
        return [dakk[p] for p in pairs], dbeta

    carry = ([zeros_ss] * len(pairs), [zeros_s] * _N_SUB)
    carry = lax.fori_loop(0, vd // block_k, pass_b, carry)
    dakk_acc, dbeta = lax.fori_loop(0, kd // block_k, pass_c, carry)
    dakk = same_doc({(i, j): jnp.where(strict_ss, x, 0.0) if i == j else x for (i, j), x in zip(pairs, dakk_acc)})
    for i in subs:
        db = dbeta[i]
        for j in range(i + 1):
            db = db + jnp.sum(dakk[i, j] * kk[i, j], axis=1)
        dbeta_ref[pl.ds(i * s, s)] = db.astype(dbeta_ref.dtype)
    p_blk = {(i, j): beta[i] * x for (i, j), x in dakk.items()}
    daqk = {(i, j): daqk_ref[pl.ds(i * s, s), pl.ds(j * s, s)].astype(_F32) for (i, j) in pairs}
    daqk = same_doc({(i, j): jnp.where(incl_ss, x, 0.0) if i == j else x for (i, j), x in daqk.items()})

    # Pass D (key blocks): dq, dk, dg through the pairwise products and the decay factors.
    def pass_d(kb, carry):
        c = cols(kb)
        f = factors(kb)
        q = [load(q_ref, i, c) * scale for i in subs]  # q~ = scale q
        k = [load(k_ref, i, c) for i in subs]
        z = z_block(kb)
        left, right, from_first, col = f["left"], f["right"], f["from_first"], f["col"]
        q_first = [q[i] * from_first[i] for i in subs]
        k_first = [k[i] * from_first[i] for i in subs]
        q_left = [q[i] * left[i] for i in subs]
        k_left = [k[i] * left[i] for i in subs]
        k_right = [k[i] * right[i] for i in subs]
        dqs = [load(dqg_ref, i, c) * f["gamma"][i] for i in subs]  # qg = q~ 2^G
        dk_row = [jnp.zeros_like(k[i]) for i in subs]
        dk_col = [jnp.zeros_like(k[i]) for i in subs]
        for i in subs:
            dqs[i] = dqs[i] + left[i] * dot(daqk[i, i], k_right[i], precision)
            dk_row[i] = dk_row[i] + left[i] * dot(p_blk[i, i], k_right[i], precision)
            dk_col[i] = dk_col[i] + right[i] * (dot_tn(daqk[i, i], q_left[i], precision)
                                                + dot_tn(p_blk[i, i], k_left[i], precision))
            for j in range(i):
                k_bridged = k[j] * col[i, j]
                dqs[i] = dqs[i] + from_first[i] * dot(daqk[i, j], k_bridged, precision)
                dk_row[i] = dk_row[i] + from_first[i] * dot(p_blk[i, j], k_bridged, precision)
                dk_col[j] = dk_col[j] + col[i, j] * (dot_tn(daqk[i, j], q_first[i], precision)
                                                     + dot_tn(p_blk[i, j], k_first[i], precision))
        dkg = [load(dkg_ref, i, c) for i in subs]
        kg_factor = [rows_masked(f["kg_factor"][i], last_rows[i]) for i in subs]  # 2^(G_L - G)
        dg_last = ddecay_ref[c].astype(_F32) * jnp.exp2(f["g_last"])
        dgrow = []
        for i in subs:
            dkg_kg = dkg[i] * k[i] * kg_factor[i]
            dg_last = dg_last + jnp.sum(dkg_kg, axis=0)
            dgrow.append(q[i] * dqs[i] + k[i] * (dk_row[i] - dk_col[i]) - dkg_kg
                         + z[i] * beta[i] * k[i] * f["gamma"][i])
        # dg_r = sum_{r' >= r} dG_r' + dG_L: reverse cumsum inside each sub-chunk plus the later sub-chunks' totals.
        acc = dg_last
        for i in reversed(subs):
            blk_total = jnp.sum(dgrow[i], axis=0)
            dg_i = (acc + blk_total)[None, :] - jnp.cumsum(dgrow[i], axis=0) + dgrow[i]
            acc = acc + blk_total
            rows = pl.ds(i * s, s)
            dg_ref[rows, c] = dg_i.astype(dg_ref.dtype)
            dq_ref[rows, c] = (scale * dqs[i]).astype(dq_ref.dtype)
            dk_ref[rows, c] = (dk_row[i] + dk_col[i] + dkg[i] * kg_factor[i]
                               + beta[i] * f["gamma"][i] * z[i]).astype(dk_ref.dtype)
        return carry

    lax.fori_loop(0, kd // block_k, pass_d, 0)


# ---------------------------------------------------------------------------------------------------------------
# Wrapper
# ---------------------------------------------------------------------------------------------------------------


def backward_flops_per_token_head(d: int = 128, chunk: int = CHUNK, sub: int = SUB_CHUNK) -> dict[str, float]:
    """Matmul FLOPs per token per head of each backward kernel and their total (2 per multiply-add; K = V = d).

    Counts the products the kernels actually form (lower sub-chunk blocks only; the 16x16 substitution inverse
    and elementwise work are not counted).
    """
    c, s, n_sub = chunk, sub, chunk // sub
    pairs = n_sub * (n_sub - 1) // 2  # sub-chunk pairs i > j
    block = 2 * s * s * d  # one [s, s] x [s, d] (or [s, d] x [d, s]) product
    per_chunk = {
        # aqk, akk (diagonal + pairs); u and w blocked substitution (pairs) and diagonal inverse products.
        "intra (recompute)": (2 * (n_sub + pairs) + 2 * pairs + 2 * n_sub) * block,
        "states": 2 * 2 * c * d * d,  # w S, kg^T v'
        "reverse": 3 * 2 * c * d * d + 2 * c * c * d,  # kg dS, qg^T dO, w^T dv'; aqk^T dO
        "state_grads": 3 * 2 * c * d * d + 2 * c * c * d,  # dO S^T, dv' S^T, v' dS^T; dO v'^T
        # kk; y and z substitution (pairs) and inverse products; dakk (2 per block); dq~, dk_row, 2 for dk_col.
        "intra_bwd": ((n_sub + pairs) + (2 * pairs + 2 * n_sub) + 2 * (n_sub + pairs) + 4 * (n_sub + pairs)) * block,
    }
    flops = {name: x / c for name, x in per_chunk.items()}
    flops["total"] = sum(flops.values())
    return flops


def reverse_states(qg, kg, w, aqk, decay, d_o, d_final_state, specs: SequentialSpecs, *, precision, config,
                   interpret):
    """Kernel 3: ``(dS_{n+1} per chunk [B, H, N*K, V], dv' [B, Tp, H, V], d initial state f32)``."""
    b, tp, h, kd = qg.shape
    vd = d_o.shape[-1]
    mm_dtype = qg.dtype
    return pl.pallas_call(
        functools.partial(_reverse_kernel, n_chunks=specs.n, kd=kd, precision=precision,
                          varlen=specs.layout is not None),
        out_shape=(jax.ShapeDtypeStruct((b, h, specs.n * kd, vd), mm_dtype),
                   jax.ShapeDtypeStruct((b, tp, h, vd), mm_dtype),
                   jax.ShapeDtypeStruct((specs.n_states, h, kd, vd), _F32)),
        grid=specs.grid,
        in_specs=[specs.seq(kd), specs.seq(kd), specs.seq(kd), specs.seq(CHUNK), specs.decay,
                  specs.seq(specs.block_v, True)] + specs.meta_specs + [specs.state],
        out_specs=[specs.per_chunk_states, specs.seq(specs.block_v, True), specs.state],
        interpret=interpret,
        compiler_params=triton_params(interpret, config.warps[1], config.stages_for(qg.dtype)),
        name="kda_bwd_reverse",
    )(qg, kg, w, aqk, decay, d_o, *specs.meta_ops, d_final_state.astype(_F32))


def state_grads(d_o, v_new, dv_new, states, ds_end, *, precision, config, interpret, block_k=32):
    """Kernel 4 (grid chunk x batch*head x key block): ``(dqg, dkg, dw, daqk, d(2^G_L))``, all f32."""
    b, tp, h, vd = d_o.shape
    kd = states.shape[2] // (tp // CHUNK)
    n = tp // CHUNK
    block_k = min(block_k, kd)
    kb = kd // block_k

    def chunk_spec(width, key_block=False):
        if key_block:
            return pl.BlockSpec((None, CHUNK, None, width), lambda c, bh, j: (bh // h, c, bh % h, j))
        return pl.BlockSpec((None, CHUNK, None, width), lambda c, bh, j: (bh // h, c, bh % h, 0))

    state_spec = pl.BlockSpec((None, None, block_k, vd), lambda c, bh, j: (bh // h, bh % h, c * kb + j, 0))
    return pl.pallas_call(
        functools.partial(_state_grads_kernel, precision=precision),
        out_shape=(jax.ShapeDtypeStruct((b, tp, h, kd), _F32),
                   jax.ShapeDtypeStruct((b, tp, h, kd), _F32),
                   jax.ShapeDtypeStruct((b, tp, h, kd), _F32),
                   jax.ShapeDtypeStruct((b, tp, h, CHUNK), _F32),
                   jax.ShapeDtypeStruct((b, h, n, kd), _F32)),
        grid=(n, b * h, kb),
        in_specs=[chunk_spec(vd), chunk_spec(vd), chunk_spec(vd), state_spec, state_spec],
        out_specs=[chunk_spec(block_k, True), chunk_spec(block_k, True), chunk_spec(block_k, True),
                   chunk_spec(CHUNK),
                   pl.BlockSpec((None, None, None, block_k), lambda c, bh, j: (bh // h, bh % h, c, j))],
        interpret=interpret,
        compiler_params=triton_params(interpret, config.warps[0]),
        name="kda_bwd_state_grads",
    )(d_o, v_new, dv_new, states, ds_end)


def intra_bwd(q, k, v, g, beta, u, w, dqg, dkg, dw, dv_new, daqk, d_decay, *, scale, precision, config, interpret,
              documents=None):
    """Kernel 5 (grid chunk x batch*head): ``(dq, dk, dv, dg, dbeta)``, f32, on chunk-padded inputs.
    ``documents``: the forward's ``document_layout`` for packed documents."""
    b, tp, h, kd = q.shape
    vd = v.shape[-1]

    spec = ChunkSpecs(h)
    chunk_spec, decay_chunk_spec, beta_chunk_spec = spec.tile, spec.per_chunk(kd), spec.rows
    doc_ops, doc_specs = document_operands(documents, h)
    return pl.pallas_call(
        functools.partial(_intra_bwd_kernel, scale=scale, precision=precision, solve=config.solve,
                          block_k=min(config.block_k, kd, vd), segmented=documents is not None),
        out_shape=(jax.ShapeDtypeStruct((b, tp, h, kd), _F32),
                   jax.ShapeDtypeStruct((b, tp, h, kd), _F32),
                   jax.ShapeDtypeStruct((b, tp, h, vd), _F32),
                   jax.ShapeDtypeStruct((b, tp, h, kd), _F32),
                   jax.ShapeDtypeStruct((b, tp, h), _F32)),
        grid=(tp // CHUNK, b * h),
        in_specs=[chunk_spec(kd), chunk_spec(kd), chunk_spec(vd), chunk_spec(kd), beta_chunk_spec,
                  chunk_spec(vd), chunk_spec(kd),
                  chunk_spec(kd), chunk_spec(kd), chunk_spec(kd), chunk_spec(vd), chunk_spec(CHUNK),
                  decay_chunk_spec] + doc_specs,
        out_specs=[chunk_spec(kd), chunk_spec(kd), chunk_spec(vd), chunk_spec(kd), beta_chunk_spec],
        interpret=interpret,
        compiler_params=triton_params(interpret, config.warps[0]),
        name="kda_bwd_intra",
    )(q, k, v, g, beta, u, w, dqg, dkg, dw, dv_new, daqk, d_decay, *doc_ops)


@functools.partial(jax.jit, static_argnames=("scale", "interpret", "config", "cu_seqlens"))
def chunk_kda_bwd(q, k, v, g, beta, initial_state, d_o, d_final_state, *, scale, interpret=False,
                  config=_DEFAULT_CONFIG, cu_seqlens=None, segment_ids=None, intra=None):
    """Gradients of ``chunk_kda_fwd`` (same arguments) for the cotangents ``d_o`` ``[B, T, H, V]`` and
    ``d_final_state`` (the final-state shape). ``intra``: the forward's ``return_intra`` results (same config);
    None recomputes them.

    Returns ``(dq, dk, dv, dg, dbeta, d_initial_state)`` in the input shapes: dg, dbeta and d_initial_state f32;
    dq, dk, dv in q's / k's / v's dtype on the tiled and state_fused paths (stored once by the kernel: the same
    single rounding the caller applies), f32 on the single and split paths.
    """
    b, t, h, kd = q.shape
    vd = v.shape[-1]
    block_v = check_dims(kd, vd, config)
    inter_dtype, precision = matmul_policy(q.dtype)
    g = g.astype(_F32)
    beta = beta.astype(_F32)
    d_o = d_o.astype(inter_dtype)

    n, layout, to_padded, from_padded = chunk_layout(b, t, cu_seqlens)
    q, k, v, g, beta, d_o = (to_padded(x) for x in (q, k, v, g, beta, d_o))

    # 1. Recompute the forward's per-chunk quantities (through the split kernels when the backward reads their
    # solve terms).
    documents = None if segment_ids is None else document_layout(segment_ids, n)
    if config.intra_bwd not in ("auto", "tiled", "state_fused"):
        raise ValueError(f"KernelConfig.intra_bwd must be 'auto', 'tiled' or 'state_fused', got {config.intra_bwd!r}")
    tiled = config.intra_bwd == "tiled"
    split = config.intra in SPLIT_FAMILY or tiled
    if intra is None:
        intra = intra_for_backward(q, k, v, g, beta, scale=scale, config=config, interpret=interpret,
                                   documents=documents)
    qg, kg, w, u, aqk, decay, solve_terms = intra

    specs = SequentialSpecs(b=b, h=h, n=n, kd=kd, vd=vd, block_v=block_v, layout=layout)
    kw = dict(precision=precision, config=config, interpret=interpret)

    # 2. Chunk-entry states and v' (the forward's chunk loop storing S_n; its final state is not needed here).
    states, v_new, _ = chunk_states(kg, w, u, decay, initial_state, specs, **kw)
    # 3. Reverse chunk loop: dS per chunk, dv', d initial state.
    ds_end, dv_new, d_initial = reverse_states(qg, kg, w, aqk, decay, d_o, d_final_state, specs, **kw)
    if config.intra_bwd == "state_fused":  # 4 + 5 in two kernels (intra_bwd_fused.py)
        dq, dk, dv, dg, dbeta = intra_bwd_state_fused(q, k, v, beta, u, w, solve_terms, d_o, v_new, dv_new, states,
                                                      ds_end, scale=scale, documents=documents, **kw)
        return _finish_grads((dq, dk, dv, dg, dbeta), d_initial, d_final_state, layout, from_padded)
    # 4. Gradients through the state products.
    dqg, dkg, dw, daqk, d_decay = state_grads(d_o, v_new, dv_new, states, ds_end, **kw)
    if documents is not None:  # the forward's chunk decay is masked where a document starts inside the chunk
        d_decay = d_decay * documents["keep"][:, None, :, None]
    # 5. Back through the intra-chunk algebra.
    if tiled:
        dq, dk, dv, dg, dbeta = intra_bwd_tiled(q, k, v, beta, u, w, solve_terms, dqg, dkg, dw, dv_new, daqk,
                                                d_decay, scale=scale, documents=documents, **kw)
    elif split:
        dq, dk, dv, dg, dbeta = intra_bwd_split(q, k, v, beta, u, w, solve_terms, dqg, dkg, dw, dv_new, daqk, d_decay,
                                                scale=scale, documents=documents, **kw)
    else:
        dq, dk, dv, dg, dbeta = intra_bwd(q, k, v, g, beta, u, w, dqg, dkg, dw, dv_new, daqk, d_decay, scale=scale,
                                          documents=documents, **kw)

    return _finish_grads((dq, dk, dv, dg, dbeta), d_initial, d_final_state, layout, from_padded)


def _finish_grads(grads, d_initial, d_final_state, layout, from_padded):
    """Chunk-padded gradients back to the input layout, plus the initial-state gradient."""
    grads = tuple(from_padded(x) for x in grads)
    if layout is not None:  # empty sequences own no chunk: their state passes straight through
        empty = jnp.asarray(layout["lens"] == 0)[:, None, None, None]
        d_initial = jnp.where(empty, d_final_state.astype(_F32), d_initial)
    return (*grads, d_initial)
