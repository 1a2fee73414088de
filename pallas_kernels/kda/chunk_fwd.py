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

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pallas_kernels.kda.common import (
    _N_SUB,
    CHUNK,
    GATE_IN_KERNEL,
    LOG2E,
    SPLIT_FAMILY,
    SUB_CHUNK,
    UNIT_LOWER_INVERSES,
    ChunkSpecs,
    KernelConfig,
    SequentialSpecs,
    activate_gate,
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
from pallas_kernels.kda.intra_split import intra_chunk_split
from pallas_kernels.tiling import triton_params

__all__ = ["chunk_kda_fwd", "chunk_states", "fused_recurrence", "intra_chunk", "intra_for_backward"]

_F32 = jnp.float32


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
        g = [g_ref[pl.ds(i * s, s), cols(kb, block_k)].astype(_F32) * LOG2E for i in subs]
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
        first = [take_row(x, 0) for x in local]
        mid = [take_row(x, s // 2) for x in local]
        # Keys decayed to the end of their own sub-chunk (exponent: sum over (j, end] <= 0).
        k_to_end = [k[i] * jnp.exp2(jnp.minimum(total[i][None, :] - local[i], 0.0)) for i in subs]
        for i in subs:
            left = jnp.exp2(local[i] - mid[i][None, :])  # |exponent| <= 8 tokens of decay
            right = jnp.exp2(mid[i][None, :] - local[i])
            q_left, k_left, k_right = q[i] * left, k[i] * left, k[i] * right
            aqk[i, i] = aqk[i, i] + dot_nt(q_left, k_right, precision)
            kk[i, i] = kk[i, i] + dot_nt(k_left, k_right, precision)
            # Re-reference rows of sub-chunk i to its first row n: 2^(G_i - G_n), exponent <= 0.
            shift = jnp.exp2(jnp.minimum(mid[i] - first[i], 0.0))[None, :]
            q_first, k_first = q_left * shift, k_left * shift
            for j in range(i):
                # 2^(G_n - G_end_j) = decay over whole sub-chunks strictly between j and i, then row n.
                k_bridged = k_to_end[j] * jnp.exp2(sum(total[j + 1:i], zeros_k) + first[i])[None, :]
                aqk[i, j] = aqk[i, j] + dot_nt(q_first, k_bridged, precision)
                kk[i, j] = kk[i, j] + dot_nt(k_first, k_bridged, precision)
            rows = pl.ds(i * s, s)
            qg_ref[rows, c] = rows_masked(q[i] * jnp.exp2(before[i][None, :] + local[i]),
                                           carry_rows[i]).astype(inter_dtype)
            kg_ref[rows, c] = rows_masked(k_to_end[i] * jnp.exp2(after[i])[None, :], last_rows[i]).astype(inter_dtype)
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
    inv = [UNIT_LOWER_INVERSES[solve](akk[i, i]) for i in subs]

    def substitute(rhs):
        """``(I + akk)^-1 rhs`` for per-sub-chunk right-hand sides: blocked forward substitution."""
        out = []
        for i in subs:
            r = rhs[i]
            for j in range(i):
                r = r - dot(akk[i, j], out[j], precision)
            out.append(dot(inv[i], r, precision))
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
        w = substitute([rows_masked(beta[i] * k_ref[pl.ds(i * s, s), c].astype(_F32)
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
        v_new_mm = (u_ref[rows, :].astype(_F32) - dot(w_ref[rows, :], s_mm, precision)).astype(mm_dtype)
        if with_output:
            o = dot(qg_ref[rows, :], s_mm, precision) + dot(aqk_ref[rows, :], v_new_mm, precision)
            o_ref[rows, :] = o.astype(o_ref.dtype)
        else:
            vnew_ref[rows, :] = v_new_mm
        s_kv = decay_ref[n, :].astype(_F32)[:, None] * s_kv + dot_tn(kg_ref[rows, :], v_new_mm, precision)
        if varlen:
            @pl.when(last_ref[n] != 0)
            def _store_final():
                sn_ref[seq] = s_kv
        return s_kv

    if varlen:
        lax.fori_loop(0, n_chunks, body, jnp.zeros(sn_ref.shape[1:], _F32))
    else:
        sn_ref[...] = lax.fori_loop(0, n_chunks, body, s0_ref[...].astype(_F32))


def intra_chunk(q, k, v, g, beta, *, scale, config=None, interpret=False, documents=None, gate=None):
    """Kernel 1 on chunk-padded inputs ``[B, Tp, H, *]`` (Tp a multiple of 64; g, beta f32).

    Returns ``(qg, kg, w, u, aqk)`` as ``[B, Tp, H, *]`` (bf16 for bf16/f16 q, else f32) and ``decay [B, H, N, K]``.
    ``documents``: ``document_layout(...)`` for packed documents (decay is then zero where ``keep`` is).
    ``gate``: None (``g`` is the activated gate) or ``(a_hk, bias_hk, lower_bound)`` with ``g`` the raw gate input,
    activated inside the kernels (``config.intra`` in ``GATE_IN_KERNEL``; see ``activate_gate``).
    """
    config = config or KernelConfig()
    if config.intra in SPLIT_FAMILY:
        return intra_chunk_split(q, k, v, g, beta, scale=scale, config=config, interpret=interpret,
                                 documents=documents, gate=gate)
    if gate is not None:
        raise ValueError(f"intra_chunk: an in-kernel gate needs KernelConfig.intra in {GATE_IN_KERNEL}")
    b, tp, h, kd = q.shape
    vd = v.shape[-1]
    n = tp // CHUNK
    inter_dtype, precision = matmul_policy(q.dtype)
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
    if config.intra in SPLIT_FAMILY or config.intra_bwd in ("tiled", "state_fused"):
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
    _, precision = matmul_policy(q.dtype)
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
