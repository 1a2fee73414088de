"""State-product gradients fused into the tiled intra-chunk backward (``KernelConfig.intra_bwd="state_fused"``).

Same results as ``chunk_bwd.state_grads`` followed by ``intra_bwd_tiled.intra_bwd_tiled`` (``dq, dk, dv, dg,
dbeta``), in two kernels instead of three and without the f32 round trips of ``dqg``, ``dkg``, ``dw`` and ``z``
(notation as in ``chunk_bwd.py`` / ``intra_bwd_tiled.py``; ``S_n`` the chunk-entry state, ``dS`` the state
gradient at the chunk end, ``v'`` / ``dv'`` the new values and their gradient):

1. ``state_solve`` (grid chunk x batch*head; state_grads + solve_grads): ``daqk = tril(dO v'^T)``; per key block
   of BK rows of ``S_n`` / ``dS``: ``dqg = dO S^T``, ``dkg = v' dS^T``, ``d(2^G_L) = rowsum(S dS)``, written as the
   three terms the pair kernel adds to its own products (each exactly the product the tiled pair kernel forms):
   ``dqg gamma``, ``dkg kgf`` and (next loop) ``beta gamma z``, plus the per-column chunk-end gate cotangent
   ``dG_L = d(2^G_L) 2^G_L + sum_rows(dkg k kgf)``; per value block ``y = A^T dv'`` (``dv = beta y``, ``dakk -=
   y u^T``, ``dbeta += rowsum(y v)``); per key block ``z = A^T dw`` with ``dw = -dv' S^T`` (``dakk -= z w^T``,
   ``dbeta += rowsum(z k gamma)``). Three loops rather than one keep the live set at one loop's tiles (one loop:
   255 registers and spills; three: 255 and 4 bytes at BK = 32, 238 and none at BK = 16, bf16, sm_90 offline
   estimate). ``dO``, ``v'`` and ``dv'`` are read from HBM once per chunk (the separate state_grads kernel read
   them once per key block).
2. ``pair`` (grid key block x chunk x batch*head): ``intra_bwd_tiled``'s pair kernel reading those terms instead
   of ``dqg, dkg, z, beta`` and the row masks (no ``gamma`` / ``kgf`` exponentials, fewer loads per step).

HBM at 1x8192x96, K = V = 128, bf16 (one [T, H, 128] tensor: 0.2 GB bf16, 0.4 GB f32): state_grads +
solve_grads + pair_grads move ~11.1 GB (4.2 + 3.2 + 3.6; state_grads re-reads dO / v' / dv' per key block, and
dqg, dkg, dw and z make f32 round trips); these two kernels ~8.5 GB (4.8 + 3.6). Numerics: the same f32
products in the same order as the tiled path (f32 accumulation; matmul precision per
``chunk_fwd._matmul_policy``).
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
    dot_nt,
    dot_tn,
    rows_masked,
)
from pallas_kernels.kda.intra_bwd_tiled import (
    key_block_spec,
    key_block_update,
    pair_block,
    store_block,
    value_block_grads,
)
from pallas_kernels.tiling import triton_params

__all__ = ["intra_bwd_state_fused", "pair_grads_fused", "state_solve_grads"]

_N_SUB = CHUNK // SUB_CHUNK
_F32 = jnp.float32


def _state_solve_kernel(a_ref, kk_ref, beta_ref, dvnew_ref, u_ref, v_ref, w_ref, k_ref, gc_ref, do_ref, vnew_ref,
                        s_ref, ds_ref, *refs, precision, block_k, segmented):
    """One chunk of one (batch, head): ``dv, dkk, dbeta, daqk`` and the pair kernel's per-row terms (module
    docstring, kernel 1). ``s_ref`` / ``ds_ref`` are the chunk's ``[K, V]`` entry state and end-state gradient."""
    if segmented:
        doc_ref, carry_ref, last_ref, keep_ref, dv_ref, dkk_ref, dbeta_ref, daqk_ref, dqs_ref, dkgf_ref, bgz_ref, \
            dgl_ref = refs
        carry = carry_ref[...].astype(_F32)[:, None]
        last = last_ref[...].astype(_F32)[:, None]
        chunk_keep = keep_ref[pl.program_id(0)]  # 0 where a document starts inside the chunk
    else:
        dv_ref, dkk_ref, dbeta_ref, daqk_ref, dqs_ref, dkgf_ref, bgz_ref, dgl_ref = refs
        carry = last = None
    mm_dtype = vnew_ref.dtype
    kd, vd = k_ref.shape[-1], v_ref.shape[-1]
    beta_c1 = beta_ref[...].astype(_F32)[:, None]
    rows_c1 = jnp.arange(CHUNK, dtype=jnp.int32)[:, None]
    cols_1c = jnp.arange(CHUNK, dtype=jnp.int32)[None, :]

    # daqk = tril(dO v'^T) (state_grads' key-independent part).
    daqk_ref[...] = jnp.where(rows_c1 >= cols_1c,
                              dot_nt(do_ref[...].astype(mm_dtype), vnew_ref[...], precision), 0.0)

    y_block = value_block_grads(a_ref, dvnew_ref, u_ref, v_ref, dv_ref, beta_c1, block_k=block_k,
                                precision=precision)

    def state_block(kb, carry_):
        """dqg, dkg, d(2^G_L) of key block ``kb``: the pair kernel's ``dqg gamma``, ``dkg kgf`` and ``dG_L``."""
        c = block_cols(kb, block_k)
        s_kv = s_ref[c, :]  # [BK, V] rows of S_n
        ds_kv = ds_ref[c, :]
        dqg = dot_nt(do_ref[...].astype(mm_dtype), s_kv, precision)
        dkg = dot_nt(vnew_ref[...], ds_kv, precision)
        d_decay = jnp.sum(s_kv.astype(_F32) * ds_kv.astype(_F32), axis=1)
        if segmented:  # the forward's chunk decay is masked where a document starts inside the chunk
            d_decay = d_decay * chunk_keep
        gc = gc_ref[:, c]
        g_last = gc_ref[pl.ds(CHUNK - 1, 1), c]  # [1, BK]
        kgf = rows_masked(jnp.exp2(g_last - gc), last)
        k = k_ref[:, c].astype(_F32)
        dgl_ref[c] = d_decay * jnp.exp2(jnp.sum(g_last, axis=0)) + jnp.sum(dkg * k * kgf, axis=0)
        dqs_ref[:, c] = dqg * rows_masked(jnp.exp2(gc), carry)
        dkgf_ref[:, c] = dkg * kgf
        return carry_

    def z_block(kb, acc):
        """z = A^T dw with dw = -dv' S^T for key block ``kb``: dakk, dbeta and the pair kernel's ``beta gamma z``."""
        c = block_cols(kb, block_k)
        dw = -dot_nt(dvnew_ref[...], s_ref[c, :], precision)
        z = dot_tn(a_ref[...], dw, precision)  # A^T dw
        acc, gamma = key_block_update(acc, z, c, w_ref, k_ref, gc_ref, carry, precision)
        bgz_ref[:, c] = beta_c1 * gamma * z
        return acc

    lax.fori_loop(0, kd // block_k, state_block, 0)
    acc = (jnp.zeros((CHUNK, CHUNK), _F32), jnp.zeros((CHUNK,), _F32))
    acc = lax.fori_loop(0, vd // block_k, y_block, acc)
    dakk, dbeta = lax.fori_loop(0, kd // block_k, z_block, acc)
    keep = cols_1c < rows_c1
    if segmented:
        keep = keep & (doc_ref[...][:, None] == doc_ref[...][None, :])
    dakk = jnp.where(keep, dakk, 0.0)
    dbeta_ref[...] = (dbeta + jnp.sum(dakk * kk_ref[...], axis=1)).astype(dbeta_ref.dtype)
    dkk_ref[...] = beta_c1 * dakk


def _pair_kernel(q_ref, k_ref, gc_ref, dqs_ref, dkgf_ref, bgz_ref, daqk_ref, dkk_ref, dgl_ref, *refs, scale,
                 precision, segmented):
    """One [64, BK] key block of one chunk of one (batch, head): ``dq``, ``dk``, ``dg`` (``intra_bwd_tiled``'s
    pair kernel with the state-product terms precombined by ``state_solve``)."""
    if segmented:
        doc_ref, dq_ref, dk_ref, dg_ref = refs
    else:
        dq_ref, dk_ref, dg_ref = refs
        doc_ref = None

    def step(i, acc):
        rows, q_r, k_r, dq_pairs, dk_row, dk_col = pair_block(q_ref, k_ref, gc_ref, daqk_ref, dkk_ref, doc_ref, i,
                                                              scale=scale, precision=precision)
        return store_block(dq_ref, dk_ref, dg_ref, rows, acc, q_r, k_r, dqs_ref[rows, :] + dq_pairs, dk_row, dk_col,
                           dkgf_ref[rows, :], bgz_ref[rows, :], scale=scale)

    lax.fori_loop(0, _N_SUB, step, dgl_ref[...])


def state_solve_grads(a, kk, beta, dv_new, u, v, w, k, gc, d_o, v_new, states, ds_end, *, precision, config,
                      interpret, documents=None):
    """Kernel 1 (grid chunk x batch*head) on chunk-padded inputs; ``states`` / ``ds_end`` ``[B, H, N*K, V]``.

    Returns f32 ``(dv, dkk, dbeta, daqk, dqs, dkgf, bgz, dgl)``: ``dqs = dqg gamma``, ``dkgf = dkg kgf``,
    ``bgz = beta gamma z`` (``[B, Tp, H, K]``) and ``dgl [B, H, N, K]`` the chunk-end gate cotangent (document
    ``keep`` mask applied)."""
    b, tp, h, kd = k.shape
    vd = v.shape[-1]
    n = tp // CHUNK
    block_k = min(config.block_k, kd, vd)
    spec = ChunkSpecs(h)
    segmented = documents is not None
    doc_ops, doc_specs = [], []
    if segmented:
        doc_ops = [documents["doc"], documents["carry"], documents["last"], documents["keep"]]
        row_spec = pl.BlockSpec((None, CHUNK), lambda c, bh: (bh // h, c))
        doc_specs = [row_spec] * 3 + [pl.BlockSpec((None, n), lambda c, bh: (bh // h, 0))]
    state_spec = pl.BlockSpec((None, None, kd, vd), lambda c, bh: (bh // h, bh % h, c, 0))
    return pl.pallas_call(
        functools.partial(_state_solve_kernel, precision=precision, block_k=block_k, segmented=segmented),
        out_shape=(jax.ShapeDtypeStruct((b, tp, h, vd), v.dtype),  # dv (in v's dtype)
                   jax.ShapeDtypeStruct((b, tp, h, CHUNK), _F32),  # dkk
                   jax.ShapeDtypeStruct((b, tp, h), _F32),  # dbeta
                   jax.ShapeDtypeStruct((b, tp, h, CHUNK), _F32),  # daqk
                   jax.ShapeDtypeStruct((b, tp, h, kd), _F32),  # dqs
                   jax.ShapeDtypeStruct((b, tp, h, kd), _F32),  # dkgf
                   jax.ShapeDtypeStruct((b, tp, h, kd), _F32),  # bgz
                   jax.ShapeDtypeStruct((b, h, n, kd), _F32)),  # dgl
        grid=(n, b * h),
        in_specs=[spec.tile(CHUNK), spec.tile(CHUNK), spec.rows, spec.tile(vd), spec.tile(vd), spec.tile(vd),
                  spec.tile(kd), spec.tile(kd), spec.tile(kd), spec.tile(vd), spec.tile(vd), state_spec,
                  state_spec] + doc_specs,
        out_specs=[spec.tile(vd), spec.tile(CHUNK), spec.rows, spec.tile(CHUNK), spec.tile(kd), spec.tile(kd),
                   spec.tile(kd), spec.per_chunk(kd)],
        interpret=interpret,
        compiler_params=triton_params(interpret, config.warps[0]),
        name="kda_bwd_state_solve",
    )(a, kk, beta, dv_new, u, v, w, k, gc, d_o, v_new, states, ds_end, *doc_ops)


def pair_grads_fused(q, k, gc, dqs, dkgf, bgz, daqk, dkk, dgl, *, scale, precision, config, interpret,
                     documents=None):
    """Kernel 2 (grid key block x chunk x batch*head): ``(dq, dk, dg)`` on chunk-padded inputs (dq, dk in q's / k's
    dtype, dg f32)."""
    b, tp, h, kd = q.shape
    block_k = min(config.block_k, kd)
    segmented = documents is not None

    def key_block(width=None):
        return key_block_spec(h, block_k, width)

    gl_spec = pl.BlockSpec((None, None, None, block_k), lambda j, c, bh: (bh // h, bh % h, c, j))
    doc_ops = [documents["doc"]] if segmented else []
    doc_specs = [pl.BlockSpec((None, CHUNK), lambda j, c, bh: (bh // h, c))] * len(doc_ops)
    return pl.pallas_call(
        functools.partial(_pair_kernel, scale=scale, precision=precision, segmented=segmented),
        out_shape=(jax.ShapeDtypeStruct((b, tp, h, kd), q.dtype), jax.ShapeDtypeStruct((b, tp, h, kd), k.dtype),
                   jax.ShapeDtypeStruct((b, tp, h, kd), _F32)),
        grid=(kd // block_k, tp // CHUNK, b * h),
        in_specs=[key_block(), key_block(), key_block(), key_block(), key_block(), key_block(),
                  key_block(CHUNK), key_block(CHUNK), gl_spec] + doc_specs,
        out_specs=[key_block()] * 3,
        interpret=interpret,
        compiler_params=triton_params(interpret, config.warps[0]),
        name="kda_bwd_pair_fused",
    )(q, k, gc, dqs, dkgf, bgz, daqk, dkk, dgl, *doc_ops)


def intra_bwd_state_fused(q, k, v, beta, u, w, solve_terms, d_o, v_new, dv_new, states, ds_end, *, scale,
                          precision, config, interpret, documents=None):
    """``chunk_bwd.state_grads`` + ``intra_bwd_tiled.intra_bwd_tiled`` in two kernels: ``(dq, dk, dv, dg, dbeta)``
    f32 on chunk-padded inputs; ``solve_terms = (kk, A, G)`` from ``intra_split.intra_chunk_split(...,
    return_solve=True)``; ``states`` / ``ds_end`` from ``chunk_fwd.chunk_states`` / ``chunk_bwd.reverse_states``."""
    kk, a, gc = solve_terms
    kw = {"precision": precision, "config": config, "interpret": interpret, "documents": documents}
    dv, dkk, dbeta, daqk, dqs, dkgf, bgz, dgl = state_solve_grads(a, kk, beta, dv_new, u, v, w, k, gc, d_o, v_new,
                                                                  states, ds_end, **kw)
    dq, dk, dg = pair_grads_fused(q, k, gc, dqs, dkgf, bgz, daqk, dkk, dgl, scale=scale, **kw)
    return dq, dk, dv, dg, dbeta
