"""Intra-chunk stage with the gram products formed per pair of 16-row sub-chunks (``KernelConfig.intra="pairs"``).

Same contract and results as ``intra_fused.intra_chunk_fused`` for ``intra="fused2"`` (``qg, kg, w, u, aqk, decay``
and, with ``return_solve``, the backward's ``(kk, A, G)``): one gram + solve kernel writing ``A`` and ``G``, then
the split stage's apply kernel for ``u`` and ``w``. The difference is how the pairwise decays
are formed. "fused2" exponentiates the key operand ``k 2^(G_n - G)`` over all 64 rows for every row block (256 rows
of ``exp2`` per key block). Here the pair blocks ``(i, j)``, ``i >= j``, of one key sub-chunk ``j`` are stacked as a
[64, 16] column block (rows above ``j`` zero), each referenced to the LAST row ``e_j`` of sub-chunk ``j``:

* column side: ``k_j 2^(G_e_j - G_j)`` (exponent <= 0, >= -15 tokens of decay);
* row side: ``x_r 2^(G_r - G_e_j)`` for rows ``r >= n_j`` (``x`` = ``q`` scaled, or ``k``): ``>= 0`` and at most
  15 tokens (<= ~108 in base 2 at the -5 nats/token gate bound: finite in f32) inside ``j``, ``<= 0`` after it.
  One ``exp2`` over the chunk gives every row's factor to the end of its own sub-chunk; the factor for column block
  ``j`` is that of block ``j + 1`` times the [1, BK] bridge ``2^(G_e_j+1 - G_e_j)`` (16 tokens: normal in f32) on
  the rows after ``j``. Every factor after the first is a true partial decay <= 1, so a product underflows only where
  the pairwise decay itself is below f32's range.

The product is ``2^(G_r - G_c)`` as in "fused2" (only the rounding of the factorisation differs). ``exp2`` work per
key block: 2 x 64 rows for the pair factors plus ``qg`` / ``kg`` (as "fused2"), against 4 x 64 + 64 there. The [64,
16] column blocks are split into the 16x16 ``akk`` pair blocks for a blocked forward substitution
(``A_jj = inv_j``, ``A_ij = -inv_i sum_{j <= m < i} akk_im A_mj``); ``aqk`` / ``kk`` are written by column block and
``A`` by 16x16 block.

(Accumulating each pair as its own [16, 16] tile, the first form tried, makes Triton replicate the 16x16 MMA over
the 4 warps of a program: 20 accumulators plus operands spilled ~550-1300 bytes per thread in the ptxas proxy.)
"""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pallas_kernels.kda.common import (
    CHUNK,
    SUB_CHUNK,
    block_lower_inverse,
    cumulative_gate_tile,
    dot_nt,
    rows_masked,
    take_row,
)
from pallas_kernels.kda.intra_fused import gram_solve_then_apply, unpack_refs

__all__ = ["intra_chunk_pairs"]

_N_SUB = CHUNK // SUB_CHUNK
_F32 = jnp.float32


def _pairs_kernel(q_ref, k_ref, g_ref, beta_ref, *refs, scale, precision, solve, block_k, segmented, with_solve,
                  lower_bound):
    """One chunk of one (batch, head): phase 1 accumulates the [64, 16] column blocks of ``aqk`` / ``kk`` (the
    pair blocks of one key sub-chunk, stacked) over key blocks, writing ``qg``, ``kg``, ``decay``, ``G`` as
    "fused2"; phase 2 masks them and solves for ``A``. Outputs ``qg, kg, aqk, decay, A, G`` (+ ``kk`` with
    ``with_solve``). ``lower_bound`` not None: ``g_ref`` is the raw gate input, activated in-kernel
    (``chunk_fwd.cumulative_gate_tile``) with the next two refs."""
    gate_refs, doc_ref, carry_all, last_all, outs = unpack_refs(refs, lower_bound, segmented, with_solve)
    qg_ref, kg_ref, aqk_ref, decay_ref, a_ref, gc_ref, kk_ref = outs
    s = SUB_CHUNK
    kd = k_ref.shape[-1]
    inter_dtype = qg_ref.dtype
    subs = range(_N_SUB)

    rows_c1 = jnp.arange(CHUNK, dtype=jnp.int32)[:, None]

    # 1. Column blocks of the gram products (the pairs (i, j) of column block j stacked over i), qg, kg, decay, G.
    def gram_block(kb, acc):
        aqk, kk = list(acc[0]), list(acc[1])
        c = pl.ds(pl.multiple_of(kb * block_k, block_k), block_k)
        gc_all = cumulative_gate_tile(g_ref, c, gate_refs)  # [64, BK]
        gc_ref[:, c] = gc_all
        gc_sub = jnp.split(gc_all, _N_SUB, axis=0)  # four [16, BK] row blocks
        ends = [take_row(x, s - 1)[None, :] for x in gc_sub]  # [1, BK]: G at the last row e_j of each sub-chunk
        q_all = q_ref[:, c].astype(_F32) * scale
        k_all = k_ref[:, c].astype(_F32)
        qg_ref[:, c] = rows_masked(q_all * jnp.exp2(gc_all), carry_all).astype(inter_dtype)
        kg_ref[:, c] = rows_masked(k_all * jnp.exp2(ends[-1] - gc_all), last_all).astype(inter_dtype)
        decay_ref[c] = jnp.exp2(ends[-1][0])
        # 2^(G_r - G_e(r)), e(r) the last row of r's own sub-chunk: exponent >= 0, <= 15 tokens of decay.
        own_end = jnp.where(rows_c1 < s, ends[0],
                            jnp.where(rows_c1 < 2 * s, ends[1], jnp.where(rows_c1 < 3 * s, ends[2], ends[3])))
        to_end = jnp.exp2(gc_all - own_end)
        rows_factor = None
        for j in reversed(subs):
            # rows_factor = 2^(G_r - G_e_j) for rows r >= n_j, 0 above: rows after sub-chunk j from the factor of
            # column block j + 1 times the bridge 2^(G_e_j+1 - G_e_j) (both <= 1), sub-chunk j's own rows from to_end.
            own = jnp.where(rows_c1 >= j * s, to_end, 0.0)
            if rows_factor is not None:
                bridge = jnp.exp2(ends[j + 1] - ends[j])  # [1, BK], 16 tokens of decay: normal in f32
                own = jnp.where(rows_c1 >= (j + 1) * s, rows_factor * bridge, own)
            rows_factor = own
            # Keys of sub-chunk j decayed to its last row: exponent <= 0, >= -15 tokens of decay.
            k_end = k_ref[pl.ds(j * s, s), c].astype(_F32) * jnp.exp2(ends[j] - gc_sub[j])
            aqk[j] = aqk[j] + dot_nt(q_all * rows_factor, k_end, precision)
            kk[j] = kk[j] + dot_nt(k_all * rows_factor, k_end, precision)
        return aqk, kk

    zeros = [jnp.zeros((CHUNK, s), _F32)] * _N_SUB
    aqk_cols, kk_cols = lax.fori_loop(0, kd // block_k, gram_block, (zeros, zeros))

    # 2. Masks (causal, documents), then A = (I + diag(beta) kk)^-1 from the 16x16 pair blocks.
    cols_1s = jnp.arange(s, dtype=jnp.int32)[None, :]
    beta_all = beta_ref[...].astype(_F32)[:, None]
    doc_all = doc_ref[...] if segmented else None
    akk = {}
    for j in subs:
        cols = pl.ds(j * s, s)
        keep_a, keep_k = j * s + cols_1s <= rows_c1, j * s + cols_1s < rows_c1
        if segmented:
            same = doc_all[:, None] == doc_ref[cols][None, :]
            keep_a, keep_k = keep_a & same, keep_k & same
        aqk_ref[:, cols] = jnp.where(keep_a, aqk_cols[j], 0.0).astype(inter_dtype)
        kk_j = jnp.where(keep_k, kk_cols[j], 0.0)
        if with_solve:
            kk_ref[:, cols] = kk_j
        for i, akk_ij in enumerate(jnp.split(beta_all * kk_j, _N_SUB, axis=0)):
            if i >= j:
                akk[i, j] = akk_ij
    a_blocks = block_lower_inverse(akk, solve=solve, precision=precision)
    zeros_ss = jnp.zeros((s, s), _F32)
    for i in subs:
        for j in subs:
            a_ref[pl.ds(i * s, s), pl.ds(j * s, s)] = a_blocks.get((i, j), zeros_ss)


def intra_chunk_pairs(q, k, v, g, beta, *, scale, config, interpret=False, documents=None, return_solve=False,
                      gate=None):
    """``intra_split.intra_chunk_split`` (same arguments and results) through the pair-block gram + solve kernel
    (writing ``A`` and ``G``), then the split stage's apply kernel for ``u`` and ``w``.
    ``gate``: see ``chunk_fwd.intra_chunk``."""
    return gram_solve_then_apply(_pairs_kernel, "kda_chunk_gram_pairs", q, k, v, g, beta, scale=scale,
                                 config=config, interpret=interpret, documents=documents,
                                 return_solve=return_solve, gate=gate)
