"""Mosaic TPU chunkwise KDA (docs/kernels.md#kda-chunk): one fused forward kernel and one reverse-chunk backward kernel.

A TPU core runs the grid as a sequential loop (``parallel`` axes are only split across the two TensorCores of a
megacore chip), so unlike the GPU kernels (chunk_fwd.py: a parallel intra-chunk kernel, then the chunk loop) there
is nothing to gain from a separate parallel pass: one kernel with grid ``(batch, head, chunk)``, the chunk axis
innermost and ``arbitrary``, does all of a chunk's work with the f32 state ``S [K, V]`` in a VMEM scratch carried
from chunk to chunk (loaded from the initial state at chunk 0, written out after the last). Nothing but ``o`` and
the final state goes back to HBM.

Per chunk of C = 64 rows, with ``G`` the inclusive within-chunk cumulative log-decay in base 2 (``g * log2(e)``):

* gate sums as 0/±1 matmuls (no cumsum on TPU): ``G``, ``G_last - G`` and, for each 16-row sub-chunk ``b`` with
  reference row ``r = 16b + 8``, the relative sums ``G_i - G_r`` taken directly over ``(r, i]`` (no cancellation
  between two large cumulative sums);
* rows of sub-chunk ``b`` of ``aqk`` and ``akk``: ``(q_b 2^(G_b - G_r)) (k 2^(G_r - G))^T`` with the key exponent
  zeroed past the sub-chunk's end (those entries are masked anyway). Every exponent is either <= 0 or spans at most
  8 tokens: finite in f32 for the lower-bounded gate (>= -5 nats/token), as docs/kernels.md#kda-chunk says;
* ``A = (I + akk)^-1``: the 16x16 diagonal blocks (all four at once, as one block-diagonal 64x64 matrix) by
  doubling or forward substitution, then blocked forward substitution over the sub-chunk rows;
* the recurrence in fused WY form: ``v' = A (beta (v - (k 2^G) S))``, ``o = scale (q 2^G) S + aqk v'``,
  ``S <- diag(2^G_last) S + (k 2^(G_last - G))^T v'``.

Backward (``chunk_kda_bwd_tpu``; residuals are the inputs only): the forward kernel again, also storing each
chunk-entry state ``S_n`` (matmul dtype), then ``_backward_kernel`` on the same grid with the chunk axis reversed
(index maps ``N-1-n``) and the f32 state gradient in VMEM scratch: per chunk it recomputes the state-independent
terms (``_chunk_terms``, shared with the forward) and ``v'`` from ``S_n``, and writes dq, dk, dv, dg, dbeta (the
formulas are in its docstring); the last step writes the initial-state gradient.

Numerics as chunk_fwd.py: elementwise math and accumulation in f32; f32 inputs use full-f32 matmuls
(``Precision.HIGHEST``), bf16 inputs feed bf16 operands (the state cast to bf16) to the intra-chunk and recurrence
matmuls with f32 accumulation; the gate sums and the inverse are always full f32.

Layouts (Mosaic: the last two block dims must be multiples of (8, 128) or the full array dims): a feature width
that is a multiple of 128 is read in place from ``[B, T, H*D]`` (free reshape, block ``[64, D]`` at head ``h``);
narrower widths go through a ``[B, H, T, D]`` transpose. ``beta`` and the document masks are ``[.., T, 1]`` columns.

Packing: traced ``segment_ids`` (packed documents, masks from ``chunk_fwd.document_layout``) or static
``cu_seqlens`` (each sequence laid out on whole chunks by ``chunk_fwd.chunk_layout``; the per-chunk sequence /
first / last flags are scalar-prefetch operands in SMEM, and the state blocks hold all sequences of one head).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels.kda.common import (
    CHUNK,
    LOG2E,
    SUB_CHUNK,
    chunk_layout,
    document_layout,
    dot,
    dot_nt,
    dot_tn,
    unit_lower_inverse_doubling,
)

__all__ = ["SOLVES", "chunk_kda_bwd_tpu", "chunk_kda_fwd_tpu"]

SOLVES = ("doubling", "substitution")
_N_SUB = CHUNK // SUB_CHUNK
_F32 = jnp.float32
_HI = lax.Precision.HIGHEST


def _iota(shape, axis, offset=0):
    return lax.broadcasted_iota(jnp.int32, shape, axis) + offset


def _as_column(x_1n):
    """``[1, n] -> [n, 1]`` without a transpose: the diagonal of the row broadcast to ``[n, n]``, summed along
    lanes (Mosaic-friendly)."""
    n = x_1n.shape[1]
    eye_nn = _iota((n, n), 0) == _iota((n, n), 1)
    return jnp.sum(jnp.where(eye_nn, jnp.broadcast_to(x_1n, (n, n)), 0.0), axis=1, keepdims=True)


def _as_row(x_n1):
    """``[n, 1] -> [1, n]`` (as ``_as_column``, summed along sublanes)."""
    n = x_n1.shape[0]
    eye_nn = _iota((n, n), 0) == _iota((n, n), 1)
    return jnp.sum(jnp.where(eye_nn, jnp.broadcast_to(x_n1, (n, n)), 0.0), axis=0, keepdims=True)


def _unit_lower_inverse(l_cc, solve):
    """``(I + L)^-1`` for strictly lower-triangular ``[C, C]`` L (f32, full-precision matmuls).

    The four 16x16 diagonal blocks together (block-diagonal part ``Ld``): ``"doubling"`` multiplies
    ``(I - Ld)(I + Ld^2)(I + Ld^4)(I + Ld^8)`` (exact: ``Ld^16 = 0``; six matmuls, the GPU kernels' default),
    ``"substitution"`` forms row ``s`` of every block as ``e - Ld X`` for s = 1..15. Then block row ``b`` of the
    inverse is ``D_b (E_b - Lo_b X)`` for b = 1..3 (blocked forward substitution; ``Lo`` the off-diagonal blocks).
    """
    c = l_cc.shape[0]
    rows, cols = _iota((c, c), 0), _iota((c, c), 1)
    eye = jnp.where(rows == cols, 1.0, 0.0).astype(_F32)
    shift = SUB_CHUNK.bit_length() - 1
    block_r, block_c = lax.shift_right_logical(rows, shift), lax.shift_right_logical(cols, shift)
    same_block = block_r == block_c
    l_diag = jnp.where(same_block, l_cc, 0.0)
    l_off = jnp.where(same_block, 0.0, l_cc)
    if solve == "doubling":
        inv_diag = unit_lower_inverse_doubling(l_diag)  # the GPU kernels' doubling, on all four blocks at once
    else:
        inv_diag = eye
        row_in_block = jnp.bitwise_and(rows, SUB_CHUNK - 1)
        for s in range(1, SUB_CHUNK):
            inv_diag = jnp.where(row_in_block == s, eye - dot(l_diag, inv_diag, _HI), inv_diag)
    inv = inv_diag
    for b in range(1, c // SUB_CHUNK):
        inv = jnp.where(block_r == b, dot(inv_diag, eye - dot(l_off, inv, _HI), _HI), inv)
    return inv


def _pair_factors(gate, b):
    """Decay factors of sub-chunk ``b`` (reference row ``r = 16b + 8``), from the base-2 gate ``[C, K]``:
    ``up [16, K] = 2^(G_i - G_r)`` for its rows (|exponent| <= 8 tokens) and ``down [C, K] = 2^(G_r - G_j)`` for
    every row, the exponent zeroed past the sub-chunk's end (<= 0 up to r, <= 7 tokens after). The relative sums
    are taken directly over ``(r, i]`` (0/±1 matmul), never as a difference of two large cumulative sums."""
    c, s = CHUNK, SUB_CHUNK
    r, end = b * s + s // 2, (b + 1) * s

    def relative(rows, cols):
        return jnp.where((cols > r) & (cols <= rows), 1.0, jnp.where((cols <= r) & (cols > rows), -1.0, 0.0))

    rel_rows = dot(relative(_iota((s, c), 0, b * s), _iota((s, c), 1)).astype(_F32), gate, _HI)
    rel_all = dot(relative(_iota((c, c), 0), _iota((c, c), 1)).astype(_F32), gate, _HI)
    return jnp.exp2(rel_rows), jnp.exp2(jnp.where(_iota((c, 1), 0) < end, -rel_all, 0.0))


def _pair_masks(b, docs):
    """``(aqk mask j <= i, akk mask j < i)`` ``[16, C]`` of sub-chunk ``b``'s rows, within one document."""
    rows, cols = _iota((SUB_CHUNK, CHUNK), 0, b * SUB_CHUNK), _iota((SUB_CHUNK, CHUNK), 1)
    incl, strict = cols <= rows, cols < rows
    if docs is not None:
        same = docs["doc_ref"][pl.ds(b * SUB_CHUNK, SUB_CHUNK), :] == docs["doc_1c"]
        incl, strict = incl & same, strict & same
    return incl, strict


def _documents(doc_ref, carry_ref, last_ref):
    """Per-row document masks of one chunk (``[C, 1]`` f32 columns), the document ids as a row, and ``keep``."""
    carry_c1 = carry_ref[...]
    return {"doc_ref": doc_ref, "doc_1c": _as_row(doc_ref[...]), "carry": carry_c1, "last": last_ref[...],
            "keep": jnp.min(carry_c1, axis=0, keepdims=True)}  # no document starts inside the chunk


def _chunk_terms(q_ref, k_ref, g_ref, beta_ref, docs, aqk_ref, kk_ref, *, scale, mm_dtype, precision, solve):
    """Everything of one chunk that does not depend on the state: fills ``aqk_ref`` (masked, ``j <= i``) and
    ``kk_ref`` (masked ``k_i 2^(G_i - G_j) k_j``, ``j < i``, without beta) and returns a dict with ``gate`` (base
    2), ``inv = (I + beta kk)^-1`` and the state-side factors ``gamma = 2^G`` (reads the incoming state; carried
    document), ``to_end = 2^(G_L - G)`` (writes the outgoing one; last document) and ``decay_1k = 2^G_L`` (times
    keep), all f32."""
    c, s = CHUNK, SUB_CHUNK
    rows_cc, cols_cc = _iota((c, c), 0), _iota((c, c), 1)
    gate = g_ref[...].astype(_F32) * LOG2E
    cum = dot(jnp.where(cols_cc <= rows_cc, 1.0, 0.0).astype(_F32), gate, _HI)  # G
    to_end_exp = dot(jnp.where(cols_cc > rows_cc, 1.0, 0.0).astype(_F32), gate, _HI)  # G_L - G (<= 0)
    k_all = k_ref[...].astype(_F32)
    for b in range(_N_SUB):
        up, down = _pair_factors(gate, b)
        sub = pl.ds(b * s, s)
        k_down = (k_all * down).astype(mm_dtype)
        q_up = (q_ref[sub, :].astype(_F32) * (scale * up)).astype(mm_dtype)
        k_up = (k_ref[sub, :].astype(_F32) * up).astype(mm_dtype)
        incl, strict = _pair_masks(b, docs)
        aqk_ref[sub, :] = jnp.where(incl, dot_nt(q_up, k_down, precision), 0.0)
        kk_ref[sub, :] = jnp.where(strict, dot_nt(k_up, k_down, precision), 0.0)
    beta_c1 = beta_ref[...].astype(_F32)
    terms = {"gate": gate, "beta": beta_c1, "inv": _unit_lower_inverse(beta_c1 * kk_ref[...], solve),
             "gamma": jnp.exp2(cum), "to_end": jnp.exp2(to_end_exp),
             "decay_1k": jnp.exp2(jnp.sum(gate, axis=0, keepdims=True))}
    if docs is not None:
        terms["gamma"] = terms["gamma"] * docs["carry"]
        terms["to_end"] = terms["to_end"] * docs["last"]
        terms["decay_1k"] = terms["decay_1k"] * docs["keep"]
    return terms


def _split_refs(refs, *, varlen, segmented):
    """(scalar refs or Nones, the five token inputs, document refs or None, the rest)."""
    refs = list(refs)
    scalars = (None, None, None)
    if varlen:
        scalars, refs = tuple(refs[:3]), refs[3:]
    tokens, refs = refs[:5], refs[5:]
    docs = None
    if segmented:
        docs, refs = _documents(*refs[:3]), refs[3:]
    return scalars, tokens, docs, refs


def _forward_kernel(*refs, scale, n_chunks, mm_dtype, solve, segmented, varlen, save_states):
    """One chunk of one (batch, head), chunks in order: ``o`` and the final state (and, ``save_states``, the
    chunk-entry state ``S_n`` in the matmul dtype, for the backward). Scratch: state ``[K, V]`` f32, ``aqk``,
    ``kk`` ``[C, C]``."""
    (seq_ref, first_ref, last_chunk_ref), (q_ref, k_ref, v_ref, g_ref, beta_ref), docs, refs = _split_refs(
        refs, varlen=varlen, segmented=segmented)
    h0_ref, o_ref, sn_ref, *refs = refs
    states_ref = refs.pop(0) if save_states else None
    state_ref, aqk_ref, kk_ref = refs
    n = pl.program_id(2)
    precision = _HI if mm_dtype == _F32 else lax.Precision.DEFAULT

    @pl.when((first_ref[n] != 0) if varlen else (n == 0))
    def _load_initial():
        state_ref[...] = (h0_ref[seq_ref[n]] if varlen else h0_ref[...]).astype(_F32)

    t = _chunk_terms(q_ref, k_ref, g_ref, beta_ref, docs, aqk_ref, kk_ref, scale=scale, mm_dtype=mm_dtype,
                     precision=precision, solve=solve)
    state_kv = state_ref[...]
    state_mm = state_kv.astype(mm_dtype)
    if save_states:
        states_ref[...] = state_mm
    k_all = k_ref[...].astype(_F32)
    rhs = t["beta"] * (v_ref[...].astype(_F32) - dot((k_all * t["gamma"]).astype(mm_dtype), state_mm, precision))
    v_new = dot(t["inv"].astype(mm_dtype), rhs.astype(mm_dtype), precision).astype(mm_dtype)
    q_in = (q_ref[...].astype(_F32) * (scale * t["gamma"])).astype(mm_dtype)
    o = dot(q_in, state_mm, precision) + dot(aqk_ref[...].astype(mm_dtype), v_new, precision)
    o_ref[...] = o.astype(o_ref.dtype)
    state_kv = (_as_column(t["decay_1k"]) * state_kv
                + dot_tn((k_all * t["to_end"]).astype(mm_dtype), v_new, precision))
    state_ref[...] = state_kv

    @pl.when((last_chunk_ref[n] != 0) if varlen else (n == n_chunks - 1))
    def _store_final():
        if varlen:
            sn_ref[seq_ref[n]] = state_kv
        else:
            sn_ref[...] = state_kv


def _backward_kernel(*refs, scale, n_chunks, mm_dtype, solve, segmented, varlen):
    """One chunk of one (batch, head), chunks in reverse, the f32 state gradient ``dS`` (w.r.t. the state leaving
    the chunk) in a VMEM scratch, starting from the final-state cotangent.

    With the forward's ``rhs = beta (v - (k gamma) S_n)``, ``v' = A rhs``, ``o = (q~ gamma) S_n + aqk v'`` and
    ``S_{n+1} = diag(decay) S_n + (k to_end)^T v'`` (q~ = scale q): ``dv' = aqk^T dO + (k to_end) dS``,
    ``y = A^T dv'`` (= d rhs), ``d kk = -beta strict_tril(y v'^T)``, ``daqk = tril(dO v'^T)``, and
    ``dS_n = diag(decay) dS + (q~ gamma)^T dO - (k gamma)^T (beta y)``. The pairwise products are differentiated
    in the forward's factorisation (``_pair_factors``: the reference row cancels), which with the state-side
    factors gives the per-row cotangent ``dG`` of the cumulative decay (natural-log units) and of ``G_L``; then
    ``dg_t = sum_{i >= t} dG_i + dG_L``.
    """
    (seq_ref, first_ref, last_chunk_ref), (q_ref, k_ref, v_ref, g_ref, beta_ref), docs, refs = _split_refs(
        refs, varlen=varlen, segmented=segmented)
    (states_ref, do_ref, dsn_ref, dq_ref, dk_ref, dv_ref, dg_ref, dbeta_ref, ds0_ref,
     ds_ref, aqk_ref, kk_ref, pq_ref, pk_ref) = refs
    n = n_chunks - 1 - pl.program_id(2)
    c, s = CHUNK, SUB_CHUNK
    precision = _HI if mm_dtype == _F32 else lax.Precision.DEFAULT

    def mm(x):
        return x.astype(mm_dtype)

    @pl.when((last_chunk_ref[n] != 0) if varlen else (n == n_chunks - 1))
    def _load_final_cotangent():
        ds_ref[...] = (dsn_ref[seq_ref[n]] if varlen else dsn_ref[...]).astype(_F32)

    t = _chunk_terms(q_ref, k_ref, g_ref, beta_ref, docs, aqk_ref, kk_ref, scale=scale, mm_dtype=mm_dtype,
                     precision=precision, solve=solve)
    beta_c1, inv_cc = t["beta"], t["inv"]
    q_t = q_ref[...].astype(_F32) * scale  # q~
    k_all = k_ref[...].astype(_F32)
    state_mm = states_ref[...]
    state_kv = state_mm.astype(_F32)
    q_in, k_in, k_out = q_t * t["gamma"], k_all * t["gamma"], k_all * t["to_end"]
    rhs_base = v_ref[...].astype(_F32) - dot(mm(k_in), state_mm, precision)
    v_new = mm(dot(mm(inv_cc), mm(beta_c1 * rhs_base), precision))

    ds_kv = ds_ref[...]
    ds_mm = mm(ds_kv)
    d_o = mm(do_ref[...])
    rows_cc, cols_cc = _iota((c, c), 0), _iota((c, c), 1)
    incl_cc, strict_cc = cols_cc <= rows_cc, cols_cc < rows_cc
    if docs is not None:
        same_cc = docs["doc_ref"][...] == docs["doc_1c"]
        incl_cc, strict_cc = incl_cc & same_cc, strict_cc & same_cc
    dv_new = dot_tn(mm(aqk_ref[...]), d_o, precision) + dot(mm(k_out), ds_mm, precision)
    y = dot_tn(inv_cc, dv_new, _HI)  # A^T dv' (A is f32)
    d_akk = -jnp.where(strict_cc, dot_nt(mm(y), v_new, precision), 0.0)
    dbeta = jnp.sum(y * rhs_base, axis=1, keepdims=True) + jnp.sum(d_akk * kk_ref[...], axis=1, keepdims=True)
    beta_y = beta_c1 * y
    dv_ref[...] = beta_y
    dbeta_ref[...] = dbeta
    pq_ref[...] = jnp.where(incl_cc, dot_nt(d_o, v_new, precision), 0.0)  # d aqk
    pk_ref[...] = beta_c1 * d_akk  # d kk

    # Through the state products.
    dq_in = dot_nt(d_o, state_mm, precision)  # d(q~ gamma)
    dk_in = -dot_nt(mm(beta_y), state_mm, precision)  # d(k gamma)
    dk_out = dot_nt(v_new, ds_mm, precision)  # d(k to_end)
    kout_dkout = k_out * dk_out
    d_decay_1k = _as_row(jnp.sum(state_kv * ds_kv, axis=1, keepdims=True))
    dg_last_1k = jnp.sum(kout_dkout, axis=0, keepdims=True) + t["decay_1k"] * d_decay_1k
    dq_t = dq_in * t["gamma"]
    dk = dk_in * t["gamma"] + dk_out * t["to_end"]
    d_cum = q_in * dq_in + k_in * dk_in - kout_dkout  # dG (natural-log units)
    ds_ref[...] = (_as_column(t["decay_1k"]) * ds_kv + dot_tn(mm(q_in), d_o, precision)
                   - dot_tn(mm(k_in), mm(beta_y), precision))
    dq_ref[...] = dq_t
    dk_ref[...] = dk
    dg_ref[...] = d_cum

    # Through the pairwise products, one sub-chunk of rows at a time (the reference row's terms cancel).
    gate = t["gate"]
    for b in range(_N_SUB):
        up, down = _pair_factors(gate, b)
        sub = pl.ds(b * s, s)
        k_down = k_all * down
        q_up = q_ref[sub, :].astype(_F32) * (scale * up)
        k_up = k_ref[sub, :].astype(_F32) * up
        p_q, p_k = mm(pq_ref[sub, :]), mm(pk_ref[sub, :])
        k_down_mm = mm(k_down)
        dq_up = dot(p_q, k_down_mm, precision)
        dk_up = dot(p_k, k_down_mm, precision)
        dq_ref[sub, :] += dq_up * up
        dk_ref[sub, :] += dk_up * up
        dg_ref[sub, :] += q_up * dq_up + k_up * dk_up
        dk_down = dot_tn(p_q, mm(q_up), precision) + dot_tn(p_k, mm(k_up), precision)
        dk_ref[...] += dk_down * down
        dg_ref[...] -= k_down * dk_down

    # dg_t = sum_{i >= t} dG_i + dG_L (dG is per natural-log unit already: 2^(g log2(e)) = e^g).
    suffix = jnp.where(cols_cc >= rows_cc, 1.0, 0.0).astype(_F32)
    dg_ref[...] = dot(suffix, dg_ref[...], _HI) + dg_last_1k
    dq_ref[...] = dq_ref[...] * scale

    @pl.when((first_ref[n] != 0) if varlen else (n == 0))
    def _store_initial_grad():
        if varlen:
            ds0_ref[seq_ref[n]] = ds_ref[...]
        else:
            ds0_ref[...] = ds_ref[...]


def _lane_aligned(d):
    return d % 128 == 0


def _heads_spec(d, n_chunks=None):
    """Block spec of a ``[64, D]`` (chunk, head) tile on the ``(batch, head, chunk)`` grid, for the layout of
    ``_to_kernel_layout``; chunks in reverse when ``n_chunks`` is given (scalar-prefetch refs arrive as extra
    index-map arguments)."""
    def chunk(n):
        return n if n_chunks is None else n_chunks - 1 - n

    if _lane_aligned(d):
        return pl.BlockSpec((None, CHUNK, d), lambda bi, hi, n, *_: (bi, chunk(n), hi))
    return pl.BlockSpec((None, None, CHUNK, d), lambda bi, hi, n, *_: (bi, hi, chunk(n), 0))


def _to_kernel_layout(x):
    """``[B, Tp, H, D]`` -> ``[B, Tp, H*D]`` (free reshape: lane-aligned head slices) when D is a multiple of 128,
    else ``[B, H, Tp, D]`` (transpose)."""
    b, tp, h, d = x.shape
    return x.reshape(b, tp, h * d) if _lane_aligned(d) else jnp.swapaxes(x, 1, 2)


def _kernel_layout_shape(b, tp, h, d):
    return (b, tp, h * d) if _lane_aligned(d) else (b, h, tp, d)


def _from_kernel_layout(y, b, tp, h, d):
    """Inverse of ``_to_kernel_layout``."""
    return y.reshape(b, tp, h, d) if _lane_aligned(d) else jnp.swapaxes(y, 1, 2)


def _column_spec(n_chunks=None, per_head=True):
    """``[.., Tp, 1]`` column blocks: beta ``[B, H, Tp, 1]`` (per_head) or document masks ``[B, Tp, 1]``."""
    def chunk(n):
        return n if n_chunks is None else n_chunks - 1 - n

    if per_head:
        return pl.BlockSpec((None, None, CHUNK, 1), lambda bi, hi, n, *_: (bi, hi, chunk(n), 0))
    return pl.BlockSpec((None, CHUNK, 1), lambda bi, hi, n, *_: (bi, chunk(n), 0))


class _Prepared:
    """Chunk-padded kernel operands shared by the forward and backward calls (see ``_prepare``)."""

    def __init__(self, q, k, v, g, beta, initial_state, *, cu_seqlens, segment_ids):
        if cu_seqlens is not None and segment_ids is not None:
            raise ValueError("chunk_kda: pass cu_seqlens or segment_ids, not both")
        self.b, self.t, self.h, self.kd = q.shape
        self.vd = v.shape[-1]
        self.out_dtype = q.dtype
        self.mm_dtype = jnp.bfloat16 if q.dtype == jnp.bfloat16 else _F32  # (f16: f32, no f16 MXU path)
        self.n, self.layout, self.to_padded, self.from_padded = chunk_layout(self.b, self.t, cu_seqlens)
        self.tp = self.n * CHUNK
        self.varlen = self.layout is not None
        self.segmented = segment_ids is not None
        self.n_states = initial_state.shape[0]
        q, k, v = (self.to_padded(x.astype(self.mm_dtype)) for x in (q, k, v))
        g, beta = (self.to_padded(x.astype(_F32)) for x in (g, beta))
        self.tokens = [_to_kernel_layout(x) for x in (q, k, v, g)] + [jnp.swapaxes(beta, 1, 2)[..., None]]
        self.docs = []
        if self.segmented:
            documents = document_layout(segment_ids, self.n)
            self.docs = [documents[name].astype(_F32)[..., None] for name in ("doc", "carry", "last")]
        self.scalars = ([jnp.asarray(self.layout[name]) for name in ("chunk_seq", "chunk_first", "chunk_last")]
                        if self.varlen else [])

    def token_specs(self, reverse=False):
        n = self.n if reverse else None
        specs = [_heads_spec(self.kd, n), _heads_spec(self.kd, n), _heads_spec(self.vd, n),
                 _heads_spec(self.kd, n), _column_spec(n)]
        return specs + ([_column_spec(n, per_head=False)] * 3 if self.segmented else [])

    def state_spec(self):
        kd, vd = self.kd, self.vd
        if self.varlen:
            return pl.BlockSpec((self.n_states, None, kd, vd), lambda bi, hi, n, *_: (0, hi, 0, 0))
        return pl.BlockSpec((None, None, kd, vd), lambda bi, hi, n, *_: (bi, hi, 0, 0))

    def states_spec(self, reverse=False):
        """Chunk-entry states ``[B, H, N*K, V]``, one ``[K, V]`` block per chunk."""
        n_chunks = self.n
        return pl.BlockSpec((None, None, self.kd, self.vd),
                            lambda bi, hi, n, *_: (bi, hi, n_chunks - 1 - n if reverse else n, 0))

    def empty_sequences(self):
        return jnp.asarray(self.layout["lens"] == 0)[:, None, None, None]


def _call(kernel, prep, *, in_specs, out_specs, out_shape, scratch, interpret, detect_races, interpret_cores,
          vmem_limit_bytes, name):
    return pl.pallas_call(
        kernel,
        out_shape=out_shape,
        grid_spec=pltpu.PrefetchScalarGridSpec(num_scalar_prefetch=len(prep.scalars), grid=(prep.b, prep.h, prep.n),
                                               in_specs=in_specs, out_specs=out_specs, scratch_shapes=scratch),
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "parallel", "arbitrary"),
                                             vmem_limit_bytes=vmem_limit_bytes),
        interpret=(pltpu.InterpretParams(detect_races=detect_races, num_cores_or_threads=interpret_cores)
                   if interpret else False),
        name=name,
    )


def _forward_call(prep, initial_state, *, scale, solve, save_states, **call_kw):
    """``(o in kernel layout, final state f32[, chunk-entry states [B, H, N*K, V]])``."""
    kd, vd = prep.kd, prep.vd
    out_shape = [jax.ShapeDtypeStruct(_kernel_layout_shape(prep.b, prep.tp, prep.h, vd), prep.out_dtype),
                 jax.ShapeDtypeStruct((prep.n_states, prep.h, kd, vd), _F32)]
    out_specs = [_heads_spec(vd), prep.state_spec()]
    if save_states:
        out_shape.append(jax.ShapeDtypeStruct((prep.b, prep.h, prep.n * kd, vd), prep.mm_dtype))
        out_specs.append(prep.states_spec())
    kernel = functools.partial(_forward_kernel, scale=scale, n_chunks=prep.n, mm_dtype=prep.mm_dtype, solve=solve,
                               segmented=prep.segmented, varlen=prep.varlen, save_states=save_states)
    scratch = [pltpu.VMEM((kd, vd), _F32), pltpu.VMEM((CHUNK, CHUNK), _F32), pltpu.VMEM((CHUNK, CHUNK), _F32)]
    return _call(kernel, prep, in_specs=prep.token_specs() + [prep.state_spec()], out_specs=out_specs,
                 out_shape=tuple(out_shape), scratch=scratch, name="kda_chunk_tpu", **call_kw)(
        *prep.scalars, *prep.tokens, *prep.docs, initial_state.astype(_F32))


_STATIC = ("scale", "interpret", "detect_races", "interpret_cores", "cu_seqlens", "solve", "vmem_limit_bytes")


@functools.partial(jax.jit, static_argnames=_STATIC)
def chunk_kda_fwd_tpu(q, k, v, g, beta, initial_state, *, scale, interpret=False, detect_races=False,
                      interpret_cores=1, cu_seqlens=None, segment_ids=None, solve="doubling", vmem_limit_bytes=None):
    """Chunkwise KDA forward through the Mosaic TPU kernel.

    Args:
      q, k: ``[B, T, H, K]`` (L2-normalised); v: ``[B, T, H, V]``; g: ``[B, T, H, K]`` activated log-decay (<= 0,
        >= -5 for f32 safety of the sub-chunk factorisation); beta: ``[B, T, H]``; initial_state ``[B, H, K, V]``
        (``[N_seq, H, K, V]`` with cu_seqlens).
      scale: q multiplier. interpret: run under the TPU interpreter (``pltpu.InterpretParams``, CPU tests);
        detect_races: its race detector; interpret_cores: TensorCores it simulates (2: a megacore chip, the
        ``parallel`` grid axes split between them).
      cu_seqlens: None or host ints ``(0, ..., T)`` (B = 1 packed sequences; state restarts per sequence).
      segment_ids: None or traced int ``[B, T]`` packed documents (state reset where the id changes; as
        ``chunk_fwd.chunk_kda_fwd``). Exclusive with cu_seqlens.
      solve: ``"doubling"`` or ``"substitution"`` for the 16x16 diagonal blocks of ``(I + akk)^-1``.
      vmem_limit_bytes: Mosaic's scoped-VMEM limit (None: the compiler default).

    Returns:
      ``(o [B, T, H, V] in q.dtype, final_state [B or N_seq, H, K, V] f32)``.
    """
    if solve not in SOLVES:
        raise ValueError(f"chunk_kda (TPU): solve must be one of {SOLVES}, got {solve!r}")
    prep = _Prepared(q, k, v, g, beta, initial_state, cu_seqlens=cu_seqlens, segment_ids=segment_ids)
    o, final_state = _forward_call(prep, initial_state, scale=scale, solve=solve, save_states=False,
                                   interpret=interpret, detect_races=detect_races, interpret_cores=interpret_cores,
                                   vmem_limit_bytes=vmem_limit_bytes)
    o = prep.from_padded(_from_kernel_layout(o, prep.b, prep.tp, prep.h, prep.vd))
    if not prep.varlen:
        return o, final_state
    return o, jnp.where(prep.empty_sequences(), initial_state.astype(_F32), final_state)  # no chunk: unchanged


@functools.partial(jax.jit, static_argnames=_STATIC)
def chunk_kda_bwd_tpu(q, k, v, g, beta, initial_state, d_o, d_final_state, *, scale, interpret=False,
                      detect_races=False, interpret_cores=1, cu_seqlens=None, segment_ids=None, solve="doubling",
                      vmem_limit_bytes=None):
    """Gradients of ``chunk_kda_fwd_tpu`` (same arguments) for the cotangents ``d_o [B, T, H, V]`` and
    ``d_final_state``: the forward kernel again, saving each chunk-entry state ``S_n`` (matmul dtype), then the
    reverse-chunk kernel (``_backward_kernel``).

    Returns f32 ``(dq, dk, dv, dg, dbeta, d_initial_state)`` in the input shapes.
    """
    if solve not in SOLVES:
        raise ValueError(f"chunk_kda (TPU): solve must be one of {SOLVES}, got {solve!r}")
    prep = _Prepared(q, k, v, g, beta, initial_state, cu_seqlens=cu_seqlens, segment_ids=segment_ids)
    call_kw = {"interpret": interpret, "detect_races": detect_races, "interpret_cores": interpret_cores,
               "vmem_limit_bytes": vmem_limit_bytes}
    _, _, states = _forward_call(prep, initial_state, scale=scale, solve=solve, save_states=True, **call_kw)
    b, tp, h, kd, vd, n = prep.b, prep.tp, prep.h, prep.kd, prep.vd, prep.n
    d_o_k = _to_kernel_layout(prep.to_padded(d_o.astype(prep.mm_dtype)))
    kernel = functools.partial(_backward_kernel, scale=scale, n_chunks=n, mm_dtype=prep.mm_dtype, solve=solve,
                               segmented=prep.segmented, varlen=prep.varlen)
    out_shape = (jax.ShapeDtypeStruct(_kernel_layout_shape(b, tp, h, kd), _F32),  # dq
                 jax.ShapeDtypeStruct(_kernel_layout_shape(b, tp, h, kd), _F32),  # dk
                 jax.ShapeDtypeStruct(_kernel_layout_shape(b, tp, h, vd), _F32),  # dv
                 jax.ShapeDtypeStruct(_kernel_layout_shape(b, tp, h, kd), _F32),  # dg
                 jax.ShapeDtypeStruct((b, h, tp, 1), _F32),  # dbeta
                 jax.ShapeDtypeStruct((prep.n_states, h, kd, vd), _F32))  # d initial state
    out_specs = [_heads_spec(kd, n), _heads_spec(kd, n), _heads_spec(vd, n), _heads_spec(kd, n), _column_spec(n),
                 prep.state_spec()]
    scratch = [pltpu.VMEM((kd, vd), _F32)] + [pltpu.VMEM((CHUNK, CHUNK), _F32)] * 4
    dq, dk, dv, dg, dbeta, dh0 = _call(
        kernel, prep, in_specs=prep.token_specs(reverse=True) + [prep.states_spec(reverse=True),
                                                                  _heads_spec(vd, n), prep.state_spec()],
        out_specs=out_specs, out_shape=out_shape, scratch=scratch, name="kda_chunk_bwd_tpu", **call_kw)(
        *prep.scalars, *prep.tokens, *prep.docs, states, d_o_k, d_final_state.astype(_F32))

    def back(x, d):
        return prep.from_padded(_from_kernel_layout(x, b, tp, h, d))

    dbeta = prep.from_padded(jnp.swapaxes(dbeta[..., 0], 1, 2))
    if prep.varlen:
        dh0 = jnp.where(prep.empty_sequences(), d_final_state.astype(_F32), dh0)
    return back(dq, kd), back(dk, kd), back(dv, vd), back(dg, kd), dbeta, dh0
