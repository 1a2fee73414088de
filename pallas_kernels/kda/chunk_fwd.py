"""Pallas chunkwise KDA forward (docs/kernels.md#kda-chunk).

Kernel 1, ``intra`` (grid: chunk x batch*head, fully parallel) turns one chunk of 64 tokens into the quantities the
sequential pass needs; kernel 2, the chunk loop (grid: batch*head x value block) walks the chunks in order with the
f32 state ``S [K, BV]`` in registers and writes the output (a variant split into a states loop plus a parallel
output kernel measured slower on an H200: 0.84 + 0.58 ms vs 1.02 ms at 1x8192x96). With ``G`` the inclusive
within-chunk cumulative log-decay in base 2 (``g * log2(e)``, so every exponential is ``exp2``):

* ``qg = scale * q * 2^G``                       reads the incoming state
* ``kg = k * 2^(G_last - G)``                    key decayed to the chunk end
* ``aqk[i, j] = scale <q_i 2^(G_i - G_j), k_j>`` for ``j <= i``
* ``akk[i, j] = beta_i <k_i 2^(G_i - G_j), k_j>`` for ``j < i`` (kept on chip)
* ``u = (I + akk)^-1 (beta v)``, ``w = (I + akk)^-1 (beta k 2^G)``
* ``decay = 2^G_last``

and per chunk the recurrence does ``v' = u - w S``; ``o = qg S + aqk v'``; ``S <- diag(decay) S + kg^T v'``.

Numerics. All elementwise math and accumulation is f32. Pairwise decays are never formed as ``2^G`` times ``2^-G``
over a whole chunk: inside each 16-row sub-chunk the exponents are taken relative to the sub-chunk midpoint (both
signs stay within ±8 tokens of decay: finite in f32 while the gate is >= -5 nats/token, the lower-bounded K3 gate),
and sub-chunk pairs ``I > J`` factor through the first row ``n`` of ``I`` with both exponents <= 0. The 16x16 diagonal
blocks of ``I + akk`` are inverted by forward substitution; the rest is blocked forward substitution with matmuls.
Matmul operands: f32 inputs use full f32 (``Precision.HIGHEST``); bf16 inputs store the intermediates in bf16 and
feed bf16 operands (state cast to bf16) to the recurrence's matmuls with f32 accumulation, like fla.

Only generic Pallas (``pl.ds`` ref slices, ``lax.fori_loop``, 2-D dots with all dims >= 16, power-of-two tiles), so
the same kernels lower to the Pallas Triton GPU backend and run on CPU with ``interpret=True``.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl

from pallas_kernels.tiling import is_pow2

__all__ = ["CHUNK", "ChunkSpecs", "GATE_IN_KERNEL", "KernelConfig", "SUB_CHUNK", "SequentialSpecs", "activate_gate",
           "block_lower_inverse", "check_dims", "chunk_kda_fwd", "chunk_layout", "chunk_states",
           "cumulative_gate_tile", "document_layout", "document_operands", "fused_recurrence", "gate_operands",
           "intra_chunk", "triton_params", "varlen_layout"]

CHUNK = 64
SUB_CHUNK = 16
_N_SUB = CHUNK // SUB_CHUNK
_LOG2E = 1.4426950408889634
_F32 = jnp.float32


INTRA_MODES = ("single", "split", "fused2", "pairs")
GATE_IN_KERNEL = ("fused2", "pairs")  # intra modes that can apply K3's gate activation while loading g
_SPLIT_FAMILY = ("split", "fused2", "pairs")  # intra modes producing the split stage's solve terms


@dataclasses.dataclass(frozen=True)
class KernelConfig:
    """GPU tuning knobs (results do not depend on them beyond rounding).

    block_v: value columns per program of the sequential (chunk-loop) kernels (power of two >= 16).
    warps: Triton warps per program of (parallel kernels, sequential kernels).
    solve: inverse of the 16x16 diagonal blocks of I + Akk: "substitution" (row by row) or "doubling" (matmuls).
    stages: Triton ``num_stages`` of the sequential kernels (> 1 lets Triton software-pipeline the chunk loop's
      loads).
    block_k: key / value columns per step of the intra-chunk kernel's column loops (power of two >= 16).
    intra: "fused2" (intra_fused.py: cumulative gate, gram products and 64x64 solve in one kernel, then the split
      apply kernel; can activate K3's raw gate in-kernel), "pairs" (intra_pairs.py: as "fused2" with the gram
      products formed per pair of 16-row sub-chunks, 43% fewer exp2), "split" (intra_split.py: cumulative gate
      in XLA, then gram / solve / apply kernels) or "single" (one intra-chunk kernel per chunk and head).
    intra_bwd: backward intra-chunk kernels: "auto" (the one kernel matching ``intra``) or "tiled" (recompute
      through the split kernels, then two kernels: solve gradients per chunk, then per key block the dq / dk / dg
      products in 16-row steps; intra_bwd_tiled.py) or "state_fused" (as "tiled" with the state-product gradients
      computed inside its two kernels instead of a separate state_grads kernel; intra_bwd_fused.py).
    residuals: what the forward keeps for the backward: "intra" (its intra-chunk results ``qg, kg, w, u, aqk``,
      the chunk decays and the split solve terms — already written to HBM by the forward, so keeping them costs
      memory, ~2.3 KB per token and head at K = V = 128 bf16, and saves the backward's recompute of the intra
      stage) or "inputs" (q, k, v, g, beta only; the backward recomputes the intra stage).

    Defaults = the fastest measured on an H200 at 1x8192x96 bf16 (``benchmarks/kda_stages.py``, RESULTS.md):
    forward intra fused2 (block_k 64) 2.46 ms, split 3.92, single 4.53; tiled backward intra 1.80 + 3.42 ms at
    block_k 64 (2.20 + 3.92 at 32; single 18.1). Whole op (``kda_bench.py``, pipelined): stages 3 vs 1 forward
    2.49 vs 2.64 ms at 1x8192x96 and 1.57 vs 1.94 ms at 1x8192x64 (block_v 32: 2.72 / 1.79).
    """

    block_v: int = 64
    warps: tuple[int, int] = (4, 4)
    solve: str = "doubling"
    stages: int = 3
    block_k: int = 64
    intra: str = "fused2"
    intra_bwd: str = "tiled"
    residuals: str = "intra"

    @classmethod
    def parse(cls, text: str) -> "KernelConfig":
        """``block_v-warps-warps[-solve[-stages[-block_k[-intra[-intra_bwd]]]]]``, e.g. ``64-4-4`` or
        ``32-4-4-doubling-2-64-split-tiled`` (the benchmarks' variant syntax)."""
        parts = text.split("-")
        if len(parts) < 3 or len(parts) > 8:
            raise ValueError("KernelConfig.parse: expected block_v-warps-warps[-solve[-stages[-block_k[-intra"
                             f"[-intra_bwd]]]]], got {text!r}")
        kw = dict(block_v=int(parts[0]), warps=(int(parts[1]), int(parts[2])))
        for name, value in zip(("solve", "stages", "block_k", "intra", "intra_bwd"), parts[3:]):
            kw[name] = int(value) if name in ("stages", "block_k") else value
        return cls(**kw)

    def stages_for(self, dtype) -> int:
        """``stages`` for operands of ``dtype``: 16-bit as configured; 32-bit operands pipeline one stage (three
        stages of f32 [64, 128] tiles need 288 KiB of shared memory, over an H200's 227 KiB)."""
        return self.stages if jnp.dtype(dtype).itemsize <= 2 else 1

    def __post_init__(self):
        if self.solve not in ("substitution", "doubling"):
            raise ValueError(f"KernelConfig.solve must be 'substitution' or 'doubling', got {self.solve!r}")
        if self.intra not in INTRA_MODES:
            raise ValueError(f"KernelConfig.intra must be one of {INTRA_MODES}, got {self.intra!r}")
        if self.intra_bwd not in ("auto", "tiled", "state_fused"):
            raise ValueError("KernelConfig.intra_bwd must be 'auto', 'tiled' or 'state_fused', got "
                             f"{self.intra_bwd!r}")
        if self.residuals not in ("intra", "inputs"):
            raise ValueError(f"KernelConfig.residuals must be 'intra' or 'inputs', got {self.residuals!r}")
        if self.stages < 1:
            raise ValueError(f"KernelConfig.stages must be >= 1, got {self.stages}")


def _dot(a, b, precision):
    """``a @ b`` with f32 accumulation."""
    return lax.dot_general(a, b, (((1,), (0,)), ((), ())), precision=precision, preferred_element_type=_F32)


def _dot_nt(a, b, precision):
    """``a @ b^T`` with f32 accumulation."""
    return lax.dot_general(a, b, (((1,), (1,)), ((), ())), precision=precision, preferred_element_type=_F32)


def _dot_tn(a, b, precision):
    """``a^T @ b`` with f32 accumulation."""
    return lax.dot_general(a, b, (((0,), (0,)), ((), ())), precision=precision, preferred_element_type=_F32)


def _row(x_ck, r):
    """Row ``r`` (static) of a register tile ``[c, K]`` as ``[K]`` (masked sum: tiles cannot be indexed)."""
    rows_c1 = jnp.arange(x_ck.shape[0], dtype=jnp.int32)[:, None]
    return jnp.sum(jnp.where(rows_c1 == r, x_ck, 0.0), axis=0)


def _unit_lower_inverse(l_cc):
    """``(I + L)^-1`` for a strictly lower-triangular ``[c, c]`` tile, by forward substitution.

    Row ``i`` of ``X = (I + L)^-1`` is ``e_i - L[i, :i] X[:i]`` (rows above ``i`` are final when it is formed).
    """
    c = l_cc.shape[0]
    rows_c1 = jnp.arange(c, dtype=jnp.int32)[:, None]
    cols_1c = jnp.arange(c, dtype=jnp.int32)[None, :]
    x_cc = jnp.where(rows_c1 == cols_1c, 1.0, 0.0).astype(_F32)
    for i in range(1, c):
        l_row_c = _row(l_cc, i)
        new_row_c = jnp.where(cols_1c[0] == i, 1.0, 0.0) - jnp.sum(l_row_c[:, None] * x_cc, axis=0)
        x_cc = jnp.where(rows_c1 == i, new_row_c[None, :], x_cc)
    return x_cc


def _unit_lower_inverse_doubling(l_cc):
    """``(I + L)^-1 = (I - L)(I + L^2)(I + L^4)(I + L^8)`` for ``L^16 = 0``: a strictly lower ``[16, 16]`` tile,
    or a block-diagonal of such tiles (the TPU kernel inverts its four diagonal blocks at once).

    Six matmuls instead of 15 dependent row steps (full f32 matmuls).
    """
    c = l_cc.shape[0]
    if c % SUB_CHUNK:
        raise ValueError(f"doubling inverse needs a multiple of {SUB_CHUNK} rows (L^16 = 0), got {c}")
    rows_c1 = jnp.arange(c, dtype=jnp.int32)[:, None]
    eye_cc = jnp.where(rows_c1 == jnp.arange(c, dtype=jnp.int32)[None, :], 1.0, 0.0).astype(_F32)
    hi = lax.Precision.HIGHEST
    x_cc = eye_cc - l_cc
    power_cc = _dot(l_cc, l_cc, hi)  # L^2
    for step in range(3):
        x_cc = x_cc + _dot(x_cc, power_cc, hi)
        if step < 2:
            power_cc = _dot(power_cc, power_cc, hi)
    return x_cc


_INVERSES = {"substitution": _unit_lower_inverse, "doubling": _unit_lower_inverse_doubling}


def _rows_masked(x_rc, mask_r1):
    """``x`` with rows zeroed where the ``[rows, 1]`` 0/1 mask is 0 (``mask=None``: unchanged)."""
    return x_rc if mask_r1 is None else x_rc * mask_r1


def document_masks(doc_ref, carry_ref, last_ref):
    """Per sub-chunk row masks of one chunk (packed documents): ``carry``/``last`` ``[16, 1]`` f32 and ``same``
    ``{(i, j): [16, 16] bool}`` for the sub-chunk pairs ``j <= i``."""
    s = SUB_CHUNK
    doc = [doc_ref[pl.ds(i * s, s)] for i in range(_N_SUB)]
    return {
        "carry": [carry_ref[pl.ds(i * s, s)].astype(_F32)[:, None] for i in range(_N_SUB)],
        "last": [last_ref[pl.ds(i * s, s)].astype(_F32)[:, None] for i in range(_N_SUB)],
        "same": {(i, j): doc[i][:, None] == doc[j][None, :] for i in range(_N_SUB) for j in range(i + 1)},
    }


def document_layout(segment_ids, n_chunks):
    """Packed-document masks for the kernels from traced segment ids ``[B, T]`` (a document starts wherever the
    id changes; T <= n_chunks * 64, padding joins the last document).

    Returns f32/int32 arrays: ``doc [B, Tp]`` document index, ``carry [B, Tp]`` (token is in the document running
    before its chunk began: it may read the incoming state), ``last [B, Tp]`` (token is in its chunk's last
    document: it writes the outgoing state) and ``keep [B, N]`` (no document starts inside the chunk: the
    incoming state survives it), the same masks as ``k3jax.ops.kda``'s chunked path.
    """
    b, t = segment_ids.shape
    tp = n_chunks * CHUNK
    starts = jnp.concatenate([jnp.zeros((b, 1), bool), segment_ids[:, 1:] != segment_ids[:, :-1]], axis=1)
    doc = jnp.pad(jnp.cumsum(starts, axis=1, dtype=jnp.int32), ((0, 0), (0, tp - t)), mode="edge")
    doc_bnc = doc.reshape(b, n_chunks, CHUNK)
    before_bn = jnp.concatenate([doc_bnc[:, :1, 0], doc_bnc[:, :-1, -1]], axis=1)
    return {"doc": doc,
            "carry": (doc_bnc == before_bn[..., None]).astype(_F32).reshape(b, tp),
            "last": (doc_bnc == doc_bnc[..., -1:]).astype(_F32).reshape(b, tp),
            "keep": (doc_bnc[..., -1] == before_bn).astype(_F32)}


def _intra_kernel(q_ref, k_ref, v_ref, g_ref, beta_ref, *refs, scale, precision, solve, block_k, segmented):
    """One chunk of one (batch, head): refs are ``[C, K]`` / ``[C, V]`` / ``[C]``; outputs per module docstring.

    Columns are processed ``block_k`` at a time (the decay bookkeeping is per key column, so every column block is
    independent): pass 1 accumulates the ten 16x16 sub-chunk blocks of ``aqk`` and ``akk`` over key blocks and
    writes ``qg``, ``kg``, ``decay``; then the diagonal blocks of ``I + akk`` are inverted and ``u`` (value blocks)
    and ``w`` (key blocks, gate recomputed) come from blocked forward substitution. Only [16, block_k] tiles and
    the 16x16 blocks are live at a time, which keeps register pressure (and so occupancy) independent of K.

    ``segmented`` (packed documents, ``document_layout``): three more inputs per row (document index, "in the
    document carried into the chunk", "in the chunk's last document") mask the pairwise products across
    documents, the rows reading the incoming state (qg, w) and the rows writing the outgoing one (kg).
    """
    if segmented:
        doc_ref, carry_ref, last_ref, qg_ref, kg_ref, w_ref, u_ref, aqk_ref, decay_ref = refs
    else:
        qg_ref, kg_ref, w_ref, u_ref, aqk_ref, decay_ref = refs
    s = SUB_CHUNK
    kd = q_ref.shape[-1]
    vd = v_ref.shape[-1]
    inter_dtype = qg_ref.dtype
    rows_s1 = jnp.arange(s, dtype=jnp.int32)[:, None]
    cols_1s = jnp.arange(s, dtype=jnp.int32)[None, :]
    incl_ss = rows_s1 >= cols_1s
    strict_ss = rows_s1 > cols_1s
    subs = range(_N_SUB)
    pairs = [(i, j) for i in subs for j in range(i + 1)]
    beta = [beta_ref[pl.ds(i * s, s)].astype(_F32)[:, None] for i in subs]
    masks = document_masks(doc_ref, carry_ref, last_ref) if segmented else None
    carry_rows = masks["carry"] if segmented else [None] * _N_SUB
    last_rows = masks["last"] if segmented else [None] * _N_SUB

    def cols(kb, width):
        return pl.ds(pl.multiple_of(kb * width, width), width)

    def decay_terms(kb):
        """Per sub-chunk (base 2, this key block): inclusive local cumsum, sub-chunk total, sums before / after."""
        g = [g_ref[pl.ds(i * s, s), cols(kb, block_k)].astype(_F32) * _LOG2E for i in subs]
        local = [jnp.cumsum(gi, axis=0) for gi in g]
        total = [jnp.sum(gi, axis=0) for gi in g]
        zeros_k = jnp.zeros_like(total[0])
        before = [sum(total[:i], zeros_k) for i in subs]  # chunk start .. sub-chunk start
        after = [sum(total[i + 1:], zeros_k) for i in subs]  # sub-chunk end .. chunk end
        return local, total, before, after

    def pass1(kb, acc):
        aqk, kk = dict(zip(pairs, acc[0])), dict(zip(pairs, acc[1]))
        c = cols(kb, block_k)
        q = [q_ref[pl.ds(i * s, s), c].astype(_F32) * scale for i in subs]
        k = [k_ref[pl.ds(i * s, s), c].astype(_F32) for i in subs]
        local, total, before, after = decay_terms(kb)
        zeros_k = jnp.zeros_like(total[0])
        first = [_row(x, 0) for x in local]
        mid = [_row(x, s // 2) for x in local]
        # Keys decayed to the end of their own sub-chunk (exponent: sum over (j, end] <= 0).
        k_to_end = [k[i] * jnp.exp2(jnp.minimum(total[i][None, :] - local[i], 0.0)) for i in subs]
        for i in subs:
            left = jnp.exp2(local[i] - mid[i][None, :])  # |exponent| <= 8 tokens of decay
            right = jnp.exp2(mid[i][None, :] - local[i])
            q_left, k_left, k_right = q[i] * left, k[i] * left, k[i] * right
            aqk[i, i] = aqk[i, i] + _dot_nt(q_left, k_right, precision)
            kk[i, i] = kk[i, i] + _dot_nt(k_left, k_right, precision)
            # Re-reference rows of sub-chunk i to its first row n: 2^(G_i - G_n), exponent <= 0.
            shift = jnp.exp2(jnp.minimum(mid[i] - first[i], 0.0))[None, :]
            q_first, k_first = q_left * shift, k_left * shift
            for j in range(i):
                # 2^(G_n - G_end_j) = decay over whole sub-chunks strictly between j and i, then row n.
                k_bridged = k_to_end[j] * jnp.exp2(sum(total[j + 1:i], zeros_k) + first[i])[None, :]
                aqk[i, j] = aqk[i, j] + _dot_nt(q_first, k_bridged, precision)
                kk[i, j] = kk[i, j] + _dot_nt(k_first, k_bridged, precision)
            rows = pl.ds(i * s, s)
            qg_ref[rows, c] = _rows_masked(q[i] * jnp.exp2(before[i][None, :] + local[i]),
                                           carry_rows[i]).astype(inter_dtype)
            kg_ref[rows, c] = _rows_masked(k_to_end[i] * jnp.exp2(after[i])[None, :], last_rows[i]).astype(inter_dtype)
        decay_ref[c] = jnp.exp2(before[-1] + total[-1])
        return [aqk[p] for p in pairs], [kk[p] for p in pairs]

    zeros_ss = jnp.zeros((s, s), _F32)
    init = ([zeros_ss] * len(pairs), [zeros_ss] * len(pairs))
    aqk_acc, kk_acc = lax.fori_loop(0, kd // block_k, pass1, init)
    aqk, kk = dict(zip(pairs, aqk_acc)), dict(zip(pairs, kk_acc))
    if segmented:
        aqk = {p: jnp.where(masks["same"][p], x, 0.0) for p, x in aqk.items()}
        kk = {p: jnp.where(masks["same"][p], x, 0.0) for p, x in kk.items()}
    akk = {(i, j): beta[i] * (jnp.where(strict_ss, x, 0.0) if i == j else x) for (i, j), x in kk.items()}
    for i in subs:
        for j in subs:
            blk = aqk.get((i, j), zeros_ss)
            blk = jnp.where(incl_ss, blk, 0.0) if i == j else blk
            aqk_ref[pl.ds(i * s, s), pl.ds(j * s, s)] = blk.astype(inter_dtype)
    inv = [_INVERSES[solve](akk[i, i]) for i in subs]

    def substitute(rhs):
        """``(I + akk)^-1 rhs`` for per-sub-chunk right-hand sides: blocked forward substitution."""
        out = []
        for i in subs:
            r = rhs[i]
            for j in range(i):
                r = r - _dot(akk[i, j], out[j], precision)
            out.append(_dot(inv[i], r, precision))
        return out

    def u_block(vb, carry):
        c = cols(vb, block_k)
        u = substitute([beta[i] * v_ref[pl.ds(i * s, s), c].astype(_F32) for i in subs])
        for i in subs:
            u_ref[pl.ds(i * s, s), c] = u[i].astype(inter_dtype)
        return carry

    def w_block(kb, carry):
        c = cols(kb, block_k)
        local, _, before, _ = decay_terms(kb)
        w = substitute([_rows_masked(beta[i] * k_ref[pl.ds(i * s, s), c].astype(_F32)
                                     * jnp.exp2(before[i][None, :] + local[i]), carry_rows[i]) for i in subs])
        for i in subs:
            w_ref[pl.ds(i * s, s), c] = w[i].astype(inter_dtype)
        return carry

    lax.fori_loop(0, vd // block_k, u_block, 0)
    lax.fori_loop(0, kd // block_k, w_block, 0)


def _chunk_loop_kernel(*refs, n_chunks, kd, precision, varlen, with_output):
    """All chunks of one (batch, head, value block), in order; the f32 state ``[K, BV]`` is the loop carry. Per
    chunk ``v' = u - w S``, then ``S <- diag(decay) S + kg^T v'``; the final state is written at the end.

    ``with_output`` (the forward): inputs ``qg, kg, w, u, aqk, decay``, also forms ``o = qg S + aqk v'``. Without
    (the backward's recompute): inputs ``kg, w, u, decay``, stores each chunk-entry state ``S_n`` (rows
    ``n*K ..``, in the matmul dtype: exactly the operand used) and ``v'``.
    Varlen (packed sequences laid out so each starts on a chunk): three per-chunk int32 inputs give the chunk's
    sequence, whether it is that sequence's first chunk (state <- its initial state) and whether it is its last
    (state -> its final-state slot); the state refs are then ``[N_seq, K, BV]``.
    """
    n_in = 6 if with_output else 4
    ins, rest = refs[:n_in], list(refs[n_in:])
    if with_output:
        qg_ref, kg_ref, w_ref, u_ref, aqk_ref, decay_ref = ins
    else:
        kg_ref, w_ref, u_ref, decay_ref = ins
    if varlen:
        seq_ref, first_ref, last_ref = rest[:3]
        rest = rest[3:]
    s0_ref, *outs = rest
    if with_output:
        o_ref, sn_ref = outs
    else:
        states_ref, vnew_ref, sn_ref = outs
    mm_dtype = kg_ref.dtype

    def body(n, s_kv):
        if varlen:
            seq = seq_ref[n]
            s_kv = jnp.where(first_ref[n] != 0, s0_ref[seq].astype(_F32), s_kv)
        rows = pl.ds(pl.multiple_of(n * CHUNK, CHUNK), CHUNK)
        s_mm = s_kv.astype(mm_dtype)
        if not with_output:
            states_ref[pl.ds(pl.multiple_of(n * kd, kd), kd), :] = s_mm
        v_new_mm = (u_ref[rows, :].astype(_F32) - _dot(w_ref[rows, :], s_mm, precision)).astype(mm_dtype)
        if with_output:
            o = _dot(qg_ref[rows, :], s_mm, precision) + _dot(aqk_ref[rows, :], v_new_mm, precision)
            o_ref[rows, :] = o.astype(o_ref.dtype)
        else:
            vnew_ref[rows, :] = v_new_mm
        s_kv = decay_ref[n, :].astype(_F32)[:, None] * s_kv + _dot_tn(kg_ref[rows, :], v_new_mm, precision)
        if varlen:
            @pl.when(last_ref[n] != 0)
            def _store_final():
                sn_ref[seq] = s_kv
        return s_kv

    if varlen:
        lax.fori_loop(0, n_chunks, body, jnp.zeros(sn_ref.shape[1:], _F32))
    else:
        sn_ref[...] = lax.fori_loop(0, n_chunks, body, s0_ref[...].astype(_F32))


def varlen_layout(cu_seqlens, t):
    """Host-side layout for packed sequences: each sequence padded to whole chunks, starting on a chunk.

    Args:
      cu_seqlens: host ints ``[N_seq + 1]``: 0, cumulative lengths, T.
      t: packed length T.

    Returns a dict of numpy int32 arrays: ``dest [T]`` (padded position of each token), ``chunk_seq``,
    ``chunk_first``, ``chunk_last`` (per padded chunk) and ``lens [N_seq]``.
    """
    cu = np.asarray(cu_seqlens, np.int64)
    if cu.ndim != 1 or cu.size < 2 or cu[0] != 0 or cu[-1] != t or np.any(np.diff(cu) < 0):
        raise ValueError(f"chunk_kda: cu_seqlens must be [0, ..., T={t}] non-decreasing, got {cu.tolist()}")
    lens = np.diff(cu)
    n_chunks_seq = -(-lens // CHUNK)
    start_chunk = np.concatenate([[0], np.cumsum(n_chunks_seq)])
    seq_of_token = np.repeat(np.arange(lens.size), lens)
    dest = start_chunk[seq_of_token] * CHUNK + np.arange(t) - cu[seq_of_token]
    n_chunks = max(int(start_chunk[-1]), 1)
    chunk_seq = np.repeat(np.arange(lens.size), n_chunks_seq)
    chunk_first = np.zeros(n_chunks, np.int32)
    chunk_last = np.zeros(n_chunks, np.int32)
    nonempty = n_chunks_seq > 0
    chunk_first[start_chunk[:-1][nonempty]] = 1
    chunk_last[start_chunk[1:][nonempty] - 1] = 1
    chunk_seq = np.pad(chunk_seq, (0, n_chunks - chunk_seq.size))
    return {"dest": dest.astype(np.int32), "chunk_seq": chunk_seq.astype(np.int32), "chunk_first": chunk_first,
            "chunk_last": chunk_last, "lens": lens.astype(np.int32)}


def activate_gate(g_raw, gate):
    """K3's lower-bounded gate in f32, ``lower_bound * sigmoid(a_hk * (g_raw + bias_hk))`` with ``gate = (a_hk,
    bias_hk, lower_bound)`` (``a_hk = exp(A_log)`` broadcast to ``[H, K]``); the in-kernel gate computes the same
    expression as each tile of ``g_raw [B, T, H, K]`` is loaded."""
    a_hk, bias_hk, lower_bound = gate
    return lower_bound / (1.0 + jnp.exp(-(a_hk * (g_raw.astype(_F32) + bias_hk))))


def intra_chunk(q, k, v, g, beta, *, scale, config=None, interpret=False, documents=None, gate=None):
    """Kernel 1 on chunk-padded inputs ``[B, Tp, H, *]`` (Tp a multiple of 64; g, beta f32).

    Returns ``(qg, kg, w, u, aqk)`` as ``[B, Tp, H, *]`` (bf16 for bf16/f16 q, else f32) and ``decay [B, H, N, K]``.
    ``documents``: ``document_layout(...)`` for packed documents (decay is then zero where ``keep`` is).
    ``gate``: None (``g`` is the activated gate) or ``(a_hk, bias_hk, lower_bound)`` with ``g`` the raw gate input,
    activated inside the kernels (``config.intra`` in ``GATE_IN_KERNEL``; see ``activate_gate``).
    """
    config = config or KernelConfig()
    if config.intra in _SPLIT_FAMILY:
        from pallas_kernels.kda.intra_split import intra_chunk_split  # imports this module

        return intra_chunk_split(q, k, v, g, beta, scale=scale, config=config, interpret=interpret,
                                 documents=documents, gate=gate)
    if gate is not None:
        raise ValueError(f"intra_chunk: an in-kernel gate needs KernelConfig.intra in {GATE_IN_KERNEL}")
    b, tp, h, kd = q.shape
    vd = v.shape[-1]
    n = tp // CHUNK
    inter_dtype, precision = _matmul_policy(q.dtype)
    block_k = min(config.block_k, kd, vd)
    params = triton_params(interpret, config.warps[0])
    spec = ChunkSpecs(h)

    inter_shapes = (
        jax.ShapeDtypeStruct((b, tp, h, kd), inter_dtype),  # qg
        jax.ShapeDtypeStruct((b, tp, h, kd), inter_dtype),  # kg
        jax.ShapeDtypeStruct((b, tp, h, kd), inter_dtype),  # w
        jax.ShapeDtypeStruct((b, tp, h, vd), inter_dtype),  # u
        jax.ShapeDtypeStruct((b, tp, h, CHUNK), inter_dtype),  # aqk
        jax.ShapeDtypeStruct((b, h, n, kd), _F32),  # decay
    )
    segmented = documents is not None
    doc_ops, doc_specs = document_operands(documents, h)
    qg, kg, w, u, aqk, decay = pl.pallas_call(
        functools.partial(_intra_kernel, scale=scale, precision=precision, solve=config.solve, block_k=block_k,
                          segmented=segmented),
        out_shape=inter_shapes,
        grid=(n, b * h),
        in_specs=[spec.tile(kd), spec.tile(kd), spec.tile(vd), spec.tile(kd), spec.rows] + doc_specs,
        out_specs=[spec.tile(kd), spec.tile(kd), spec.tile(kd), spec.tile(vd), spec.tile(CHUNK),
                   spec.per_chunk(kd)],
        interpret=interpret,
        compiler_params=params,
        name="kda_chunk_intra",
    )(q, k, v, g, beta, *doc_ops)
    if segmented:
        decay = decay * documents["keep"][:, None, :, None]
    return qg, kg, w, u, aqk, decay


@dataclasses.dataclass(frozen=True)
class ChunkSpecs:
    """Block specs on the parallel (chunk, batch*head) grid, shared by every per-chunk kernel: ``tile(width)`` is one
    chunk of one (batch, head) of a ``[B, Tp, H, width]`` array, ``rows`` its ``[C]`` of a ``[B, Tp, H]`` array
    (beta), ``per_chunk(width)`` its row of a ``[B, H, N, width]`` array (decay)."""

    h: int

    def tile(self, width):
        h = self.h
        return pl.BlockSpec((None, CHUNK, None, width), lambda c, bh: (bh // h, c, bh % h, 0))

    @property
    def rows(self):
        h = self.h
        return pl.BlockSpec((None, CHUNK, None), lambda c, bh: (bh // h, c, bh % h))

    def per_chunk(self, width):
        h = self.h
        return pl.BlockSpec((None, None, None, width), lambda c, bh: (bh // h, bh % h, c, 0))


def cumulative_gate_tile(g_ref, c, gate_refs=None):
    """``[64, BK]`` f32 in-kernel: inclusive cumulative sum of ``g * log2(e)`` over the chunk's rows (columns ``c``).

    ``gate_refs = (a_ref, bias_ref, lower_bound)``: ``g_ref`` holds K3's raw gate input, activated here as
    ``activate_gate`` (``lower_bound * sigmoid(a * (g_raw + bias))``, this head's ``[K]`` rows)."""
    g = g_ref[:, c].astype(_F32)
    if gate_refs is not None:
        a_ref, bias_ref, lower_bound = gate_refs
        g = activate_gate(g, (a_ref[c][None, :], bias_ref[c][None, :], lower_bound))
    return jnp.cumsum(g * _LOG2E, axis=0)


def gate_operands(gate, h):
    """``(operands, block specs)`` of an in-kernel gate's ``[H, K]`` coefficients (``intra_chunk``'s ``gate``)
    for the (chunk, batch*head) grid: each program reads its head's ``a`` and ``bias`` rows."""
    if gate is None:
        return [], []
    a_hk, bias_hk, _ = gate
    spec = pl.BlockSpec((None, a_hk.shape[-1]), lambda c, bh: (bh % h, 0))
    return [a_hk, bias_hk], [spec, spec]


def document_operands(documents, h):
    """``(operands, block specs)`` of the per-row document masks for the (chunk, batch*head) grid."""
    if documents is None:
        return [], []
    spec = pl.BlockSpec((None, CHUNK), lambda c, bh: (bh // h, c))
    return [documents["doc"], documents["carry"], documents["last"]], [spec] * 3


def block_lower_inverse(akk, *, solve, precision):
    """``{(i, j): [16, 16]}`` blocks (``j <= i``) of ``(I + akk)^-1`` from the 16x16 blocks ``akk[i, j]`` (``j <=
    i``) of a strictly lower-triangular 64x64 ``akk``: diagonal blocks by ``_INVERSES[solve]``, the others by
    blocked forward substitution ``A_ij = -inv_i sum_{j <= m < i} akk_im A_mj``."""
    n_sub = CHUNK // SUB_CHUNK
    inv = [_INVERSES[solve](akk[i, i]) for i in range(n_sub)]
    blocks = {}
    for j in range(n_sub):
        blocks[j, j] = inv[j]
        for i in range(j + 1, n_sub):
            acc = _dot(akk[i, j], inv[j], precision)
            for m in range(j + 1, i):
                acc = acc + _dot(akk[i, m], blocks[m, j], precision)
            blocks[i, j] = -_dot(inv[i], acc, precision)
    return blocks


def _matmul_policy(dtype):
    """(intermediate dtype, matmul precision): bf16/f16 inputs keep 16-bit intermediates and TF32/bf16 matmuls;
    f32 inputs keep f32 intermediates and full-f32 matmuls."""
    if dtype in (jnp.bfloat16, jnp.float16):
        return dtype, lax.Precision.DEFAULT
    return _F32, lax.Precision.HIGHEST


def check_dims(kd: int, vd: int, config) -> int:
    """The value-block width for K = kd, V = vd (all powers of two, as the kernels' tiles need)."""
    block_v = min(config.block_v, vd)
    block_k = min(config.block_k, kd, vd)
    if not all(is_pow2(d, 16) for d in (kd, vd, block_v, block_k)):
        raise ValueError(f"chunk_kda (Pallas): K={kd}, V={vd}, block_v={block_v}, block_k={block_k} must be "
                         "powers of two >= 16")
    return block_v


def chunk_layout(b: int, t: int, cu_seqlens):
    """How tokens sit on whole chunks: `(n_chunks, varlen layout or None, to_padded, from_padded)`.

    Without `cu_seqlens` the sequence is zero-padded to a chunk multiple; with it (B = 1) each packed sequence is
    scattered to start on its own chunk, the gaps being zero tokens. `from_padded` undoes `to_padded` on [B, T', ...].
    """
    if cu_seqlens is not None:
        if b != 1:
            raise ValueError(f"chunk_kda: cu_seqlens needs batch size 1 (packed sequences), got B={b}")
        layout = varlen_layout(cu_seqlens, t)
        n = layout["chunk_seq"].size
        dest = jnp.asarray(layout["dest"])

        def to_padded(x):
            return jnp.zeros((1, n * CHUNK) + x.shape[2:], x.dtype).at[0, dest].set(x[0])

        def from_padded(x):
            return x[:, dest]

        return n, layout, to_padded, from_padded
    n = -(-t // CHUNK)
    pad = n * CHUNK - t

    def to_padded(x):
        return jnp.pad(x, [(0, 0), (0, pad)] + [(0, 0)] * (x.ndim - 2)) if pad else x

    def from_padded(x):
        return x[:, :t]

    return n, None, to_padded, from_padded


def triton_params(interpret: bool, warps: int, stages: int = 1):
    """Triton compiler parameters (None in interpret mode)."""
    if interpret:
        return None
    from jax.experimental.pallas import triton as pl_triton
    return pl_triton.CompilerParams(num_warps=warps, num_stages=stages)


@dataclasses.dataclass(frozen=True)
class SequentialSpecs:
    """Block specs of the chunk-loop kernels (grid: batch*head x value block), shared by forward and backward.

    ``state`` is one (batch, head)'s ``[K, BV]`` state block (all ``[N_seq, K, BV]`` with varlen); ``meta_ops`` /
    ``meta_specs`` are the varlen per-chunk (sequence, first, last) arrays (empty without varlen).
    """

    b: int
    h: int
    n: int
    kd: int
    vd: int
    block_v: int
    layout: dict | None

    @property
    def grid(self):
        return (self.b * self.h, self.n_value_blocks)

    @property
    def n_value_blocks(self):
        return self.vd // self.block_v

    def seq(self, width, col_block=False):
        """A whole (batch, head) sequence ``[Tp, width]``; value-blocked when ``col_block``."""
        h, tp = self.h, self.n * CHUNK
        if col_block:
            return pl.BlockSpec((None, tp, None, width), lambda bh, j: (bh // h, 0, bh % h, j))
        return pl.BlockSpec((None, tp, None, width), lambda bh, j: (bh // h, 0, bh % h, 0))

    @property
    def per_chunk_states(self):
        h = self.h
        return pl.BlockSpec((None, None, self.n * self.kd, self.block_v), lambda bh, j: (bh // h, bh % h, 0, j))

    @property
    def decay(self):
        h = self.h
        return pl.BlockSpec((None, None, self.n, self.kd), lambda bh, j: (bh // h, bh % h, 0, 0))

    @property
    def n_states(self):
        return self.b if self.layout is None else self.layout["lens"].size

    @property
    def state(self):
        h = self.h
        if self.layout is None:
            return pl.BlockSpec((None, None, self.kd, self.block_v), lambda bh, j: (bh // h, bh % h, 0, j))
        return pl.BlockSpec((self.n_states, None, self.kd, self.block_v), lambda bh, j: (0, bh, 0, j))

    @property
    def meta_ops(self):
        if self.layout is None:
            return []
        return [jnp.asarray(self.layout[name]) for name in ("chunk_seq", "chunk_first", "chunk_last")]

    @property
    def meta_specs(self):
        return [] if self.layout is None else [pl.BlockSpec((self.n,), lambda bh, j: (0,))] * 3


def chunk_states(kg, w, u, decay, initial_state, specs: SequentialSpecs, *, precision, config, interpret):
    """The chunk loop storing each chunk-entry state (the backward's recompute):
    ``(states [B, H, N*K, V], v' [B, Tp, H, V], final state f32)``."""
    b, tp, h, kd = kg.shape
    vd = u.shape[-1]
    mm_dtype = kg.dtype
    return pl.pallas_call(
        functools.partial(_chunk_loop_kernel, n_chunks=specs.n, kd=kd, precision=precision,
                          varlen=specs.layout is not None, with_output=False),
        out_shape=(jax.ShapeDtypeStruct((b, h, specs.n * kd, vd), mm_dtype),
                   jax.ShapeDtypeStruct((b, tp, h, vd), mm_dtype),
                   jax.ShapeDtypeStruct((specs.n_states, h, kd, vd), _F32)),
        grid=specs.grid,
        in_specs=[specs.seq(kd), specs.seq(kd), specs.seq(specs.block_v, True), specs.decay]
        + specs.meta_specs + [specs.state],
        out_specs=[specs.per_chunk_states, specs.seq(specs.block_v, True), specs.state],
        interpret=interpret,
        compiler_params=triton_params(interpret, config.warps[1], config.stages_for(kg.dtype)),
        name="kda_chunk_states",
    )(kg, w, u, decay, *specs.meta_ops, initial_state.astype(_F32))


def fused_recurrence(qg, kg, w, u, aqk, decay, initial_state, specs: SequentialSpecs, *, out_dtype, precision,
                     config, interpret):
    """The forward's chunk loop: ``(o [B, Tp, H, V], final state f32)``."""
    b, tp, h, kd = qg.shape
    vd = u.shape[-1]
    return pl.pallas_call(
        functools.partial(_chunk_loop_kernel, n_chunks=specs.n, kd=kd, precision=precision,
                          varlen=specs.layout is not None, with_output=True),
        out_shape=(jax.ShapeDtypeStruct((b, tp, h, vd), out_dtype),
                   jax.ShapeDtypeStruct((specs.n_states, h, kd, vd), _F32)),
        grid=specs.grid,
        in_specs=[specs.seq(kd), specs.seq(kd), specs.seq(kd), specs.seq(specs.block_v, True), specs.seq(CHUNK),
                  specs.decay] + specs.meta_specs + [specs.state],
        out_specs=[specs.seq(specs.block_v, True), specs.state],
        interpret=interpret,
        compiler_params=triton_params(interpret, config.warps[1], config.stages_for(qg.dtype)),
        name="kda_chunk_recurrence",
    )(qg, kg, w, u, aqk, decay, *specs.meta_ops, initial_state.astype(_F32))


def intra_for_backward(q, k, v, g, beta, *, scale, config, interpret, documents, gate=None):
    """The intra-chunk results the backward reads, on chunk-padded inputs: ``(qg, kg, w, u, aqk, decay, solve)``
    with ``solve`` the split stage's ``(kk, A, G)`` when the backward's intra kernels need them (``intra="split"``
    or ``intra_bwd="tiled"``), else None. The forward calls it when it keeps these as residuals; the backward calls
    it to recompute them otherwise."""
    if config.intra in _SPLIT_FAMILY or config.intra_bwd in ("tiled", "state_fused"):
        from pallas_kernels.kda.intra_split import intra_chunk_split  # imports this module

        return intra_chunk_split(q, k, v, g, beta, scale=scale, config=config, interpret=interpret,
                                 documents=documents, return_solve=True, gate=gate)
    return (*intra_chunk(q, k, v, g, beta, scale=scale, config=config, interpret=interpret, documents=documents,
                         gate=gate), None)


@functools.partial(jax.jit, static_argnames=("scale", "interpret", "config", "cu_seqlens", "return_intra",
                                             "gate_lower_bound"))
def chunk_kda_fwd(q, k, v, g, beta, initial_state, *, scale, interpret=False, config=KernelConfig(),
                  cu_seqlens=None, segment_ids=None, return_intra=False, gate_hk=None, gate_lower_bound=None):
    """Chunkwise KDA forward through the Pallas kernels (intra-chunk, then the chunk loop).

    Args:
      q, k: ``[B, T, H, K]`` (L2-normalised); v: ``[B, T, H, V]``; g: ``[B, T, H, K]`` activated log-decay (<= 0,
        >= -5 for f32 safety of the sub-chunk factorisation); beta: ``[B, T, H]``; initial_state: ``[B, H, K, V]``
        (``[N_seq, H, K, V]`` with cu_seqlens).
      scale: multiplier for q. interpret: run the kernels with the Pallas interpreter (CPU tests).
      config: GPU tuning knobs (KernelConfig).
      cu_seqlens: None, or a tuple of host ints ``(0, ..., T)`` for B = 1 packed sequences (state reset at each).
      segment_ids: None, or traced int ``[B, T]`` packed documents (state reset wherever the id changes; the
        initial state belongs to each row's first document, the final state is its last document's), by masks
        inside the kernels (no relayout); exclusive with cu_seqlens.

      return_intra: also return the intra-chunk results for the backward (``intra_for_backward``'s tuple, on the
        chunk-padded layout): ``((o, final_state), intra)``.
      gate_hk, gate_lower_bound: None, or ``(a_hk, bias_hk)`` ``[H, K]`` f32 and the static lower bound: ``g`` is
        then K3's raw gate input, activated as ``activate_gate`` inside the intra kernel when ``config.intra`` is
        in ``GATE_IN_KERNEL`` and the tokens fill whole chunks (no padding to keep decay-free), else in XLA first.

    Returns:
      ``(o [B, T, H, V] in q.dtype, final_state [B or N_seq, H, K, V] f32)``.
    """
    if cu_seqlens is not None and segment_ids is not None:
        raise ValueError("chunk_kda: pass cu_seqlens or segment_ids, not both")
    b, t, h, kd = q.shape
    vd = v.shape[-1]
    block_v = check_dims(kd, vd, config)
    _, precision = _matmul_policy(q.dtype)
    beta = beta.astype(_F32)

    n, layout, to_padded, from_padded = chunk_layout(b, t, cu_seqlens)
    gate = None
    if gate_hk is not None:
        gate = (*(x.astype(_F32) for x in gate_hk), float(gate_lower_bound))
        if config.intra not in GATE_IN_KERNEL or layout is not None or n * CHUNK != t:
            g, gate = activate_gate(g, gate), None  # padded tokens must not decay: activate before padding
    if gate is None:
        g = g.astype(_F32)
    q, k, v, g, beta = (to_padded(x) for x in (q, k, v, g, beta))  # zero tokens neither decay nor write the state

    documents = None if segment_ids is None else document_layout(segment_ids, n)
    if return_intra:
        intra = intra_for_backward(q, k, v, g, beta, scale=scale, config=config, interpret=interpret,
                                   documents=documents, gate=gate)
        qg, kg, w, u, aqk, decay = intra[:6]
    else:
        qg, kg, w, u, aqk, decay = intra_chunk(q, k, v, g, beta, scale=scale, config=config, interpret=interpret,
                                               documents=documents, gate=gate)
    specs = SequentialSpecs(b=b, h=h, n=n, kd=kd, vd=vd, block_v=block_v, layout=layout)
    o, final_state = fused_recurrence(qg, kg, w, u, aqk, decay, initial_state, specs, out_dtype=q.dtype,
                                      precision=precision, config=config, interpret=interpret)
    if layout is not None:  # empty sequences own no chunk: their final state is their initial state
        empty = jnp.asarray(layout["lens"] == 0)[:, None, None, None]
        final_state = jnp.where(empty, initial_state.astype(_F32), final_state)
    out = (from_padded(o), final_state)
    return (out, intra) if return_intra else out
