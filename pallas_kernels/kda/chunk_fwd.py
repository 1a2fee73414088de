"""Pallas chunkwise KDA forward: two kernels (KERNELS.md §1).

Kernel 1, ``intra`` (grid: chunk x batch*head, fully parallel) turns one chunk of 64 tokens into the quantities the
sequential pass needs; kernel 2, ``recurrence`` (grid: batch*head x value-block) walks the chunks in order with the
f32 state ``S [K, BV]`` in registers and writes the output. With ``G`` the inclusive within-chunk cumulative
log-decay in base 2 (``g * log2(e)``, so every exponential is ``exp2``):

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

__all__ = ["CHUNK", "SUB_CHUNK", "KernelConfig", "check_dims", "chunk_kda_fwd", "chunk_layout", "intra_chunk",
           "varlen_layout"]

CHUNK = 64
SUB_CHUNK = 16
_N_SUB = CHUNK // SUB_CHUNK
_LOG2E = 1.4426950408889634
_F32 = jnp.float32


@dataclasses.dataclass(frozen=True)
class KernelConfig:
    """GPU tuning knobs (results do not depend on them beyond rounding).

    block_v: value columns per program of the recurrence kernel (power of two >= 16).
    warps: Triton warps per program of (intra-chunk kernel, recurrence kernel).
    solve: inverse of the 16x16 diagonal blocks of I + Akk: "substitution" (row by row) or "doubling" (matmuls).
    """

    block_v: int = 64
    warps: tuple[int, int] = (4, 4)
    solve: str = "substitution"

    def __post_init__(self):
        if self.solve not in ("substitution", "doubling"):
            raise ValueError(f"KernelConfig.solve must be 'substitution' or 'doubling', got {self.solve!r}")


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
    """``(I + L)^-1 = (I - L)(I + L^2)(I + L^4)(I + L^8)`` for strictly lower ``[16, 16]`` L (``L^16 = 0``).

    Six 16x16 matmuls instead of 15 dependent row steps (a GPU tuning alternative; full f32 matmuls).
    """
    c = l_cc.shape[0]
    if c != 16:
        raise ValueError(f"doubling inverse is written for 16x16 tiles, got {c}")
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


def _intra_kernel(q_ref, k_ref, v_ref, g_ref, beta_ref,
                  qg_ref, kg_ref, w_ref, u_ref, aqk_ref, decay_ref, *, scale, precision, solve):
    """One chunk of one (batch, head): refs are ``[C, K]`` / ``[C, V]`` / ``[C]``; outputs per module docstring."""
    s = SUB_CHUNK
    inter_dtype = qg_ref.dtype
    rows_s1 = jnp.arange(s, dtype=jnp.int32)[:, None]
    cols_1s = jnp.arange(s, dtype=jnp.int32)[None, :]
    incl_ss = rows_s1 >= cols_1s
    strict_ss = rows_s1 > cols_1s

    def load(ref, i):
        return ref[pl.ds(i * s, s), :].astype(_F32)

    q = [load(q_ref, i) * scale for i in range(_N_SUB)]
    k = [load(k_ref, i) for i in range(_N_SUB)]
    v = [load(v_ref, i) for i in range(_N_SUB)]
    beta = [beta_ref[pl.ds(i * s, s)].astype(_F32)[:, None] for i in range(_N_SUB)]
    g = [load(g_ref, i) * _LOG2E for i in range(_N_SUB)]

    local = [jnp.cumsum(gi, axis=0) for gi in g]  # sum over [start of sub-chunk, i]
    total = [jnp.sum(gi, axis=0) for gi in g]  # [K] whole sub-chunk
    first = [_row(c, 0) for c in local]
    mid = [_row(c, s // 2) for c in local]
    zeros_k = jnp.zeros_like(total[0])
    before = [sum(total[:i], zeros_k) for i in range(_N_SUB)]  # chunk start .. sub-chunk start
    after = [sum(total[i + 1:], zeros_k) for i in range(_N_SUB)]  # sub-chunk end .. chunk end

    # Keys decayed to the end of their own sub-chunk (exponent: sum over (j, end] <= 0).
    k_to_end = [k[i] * jnp.exp2(jnp.minimum(total[i][None, :] - local[i], 0.0)) for i in range(_N_SUB)]
    gamma = [jnp.exp2(before[i][None, :] + local[i]) for i in range(_N_SUB)]  # 2^G, G chunk-relative

    aqk = {}
    akk = {}
    for i in range(_N_SUB):
        left = jnp.exp2(local[i] - mid[i][None, :])  # |exponent| <= 8 tokens of decay
        right = jnp.exp2(mid[i][None, :] - local[i])
        q_left, k_left, k_right = q[i] * left, k[i] * left, k[i] * right
        aqk[i, i] = jnp.where(incl_ss, _dot_nt(q_left, k_right, precision), 0.0)
        akk[i, i] = jnp.where(strict_ss, beta[i] * _dot_nt(k_left, k_right, precision), 0.0)
        # Re-reference rows of sub-chunk i to its first row n: 2^(G_i - G_n), exponent <= 0.
        shift = jnp.exp2(jnp.minimum(mid[i] - first[i], 0.0))[None, :]
        q_first, k_first = q_left * shift, k_left * shift
        for j in range(i):
            # 2^(G_n - G_end_j) = decay over whole sub-chunks strictly between j and i, then row n.
            bridge = jnp.exp2(sum(total[j + 1:i], zeros_k) + first[i])[None, :]
            k_bridged = k_to_end[j] * bridge
            aqk[i, j] = _dot_nt(q_first, k_bridged, precision)
            akk[i, j] = beta[i] * _dot_nt(k_first, k_bridged, precision)

    # u = (I + akk)^-1 beta v, w = (I + akk)^-1 beta k 2^G: blocked forward substitution.
    u, w = [], []
    for i in range(_N_SUB):
        rhs_u = beta[i] * v[i]
        rhs_w = beta[i] * k[i] * gamma[i]
        for j in range(i):
            rhs_u = rhs_u - _dot(akk[i, j], u[j], precision)
            rhs_w = rhs_w - _dot(akk[i, j], w[j], precision)
        inv_ss = _INVERSES[solve](akk[i, i])
        u.append(_dot(inv_ss, rhs_u, precision))
        w.append(_dot(inv_ss, rhs_w, precision))

    zeros_ss = jnp.zeros((s, s), _F32)
    for i in range(_N_SUB):
        rows = pl.ds(i * s, s)
        qg_ref[rows, :] = (q[i] * gamma[i]).astype(inter_dtype)
        kg_ref[rows, :] = (k_to_end[i] * jnp.exp2(after[i])[None, :]).astype(inter_dtype)
        w_ref[rows, :] = w[i].astype(inter_dtype)
        u_ref[rows, :] = u[i].astype(inter_dtype)
        for j in range(_N_SUB):
            aqk_ref[rows, pl.ds(j * s, s)] = aqk.get((i, j), zeros_ss).astype(inter_dtype)
    decay_ref[...] = jnp.exp2(before[-1] + total[-1])


def _recurrence_kernel(qg_ref, kg_ref, w_ref, u_ref, aqk_ref, decay_ref, *refs, n_chunks, precision, varlen):
    """All chunks of one (batch, head, value block), in order; the f32 state ``[K, BV]`` is the loop carry.

    Varlen (``varlen=True``, packed sequences laid out so each starts on a chunk): three extra per-chunk int32
    inputs give the chunk's sequence, whether it is that sequence's first chunk (state <- its initial state) and
    whether it is its last (state -> its final-state slot); the state refs are then ``[N_seq, K, BV]``.
    """
    if varlen:
        seq_ref, first_ref, last_ref, s0_ref, o_ref, sn_ref = refs
    else:
        s0_ref, o_ref, sn_ref = refs
    mm_dtype = qg_ref.dtype

    def body(n, s_kv):
        if varlen:
            seq = seq_ref[n]
            s_kv = jnp.where(first_ref[n] != 0, s0_ref[seq].astype(_F32), s_kv)
        rows = pl.ds(pl.multiple_of(n * CHUNK, CHUNK), CHUNK)
        s_mm = s_kv.astype(mm_dtype)
        v_new = u_ref[rows, :].astype(_F32) - _dot(w_ref[rows, :], s_mm, precision)
        v_new_mm = v_new.astype(mm_dtype)
        o = _dot(qg_ref[rows, :], s_mm, precision) + _dot(aqk_ref[rows, :], v_new_mm, precision)
        o_ref[rows, :] = o.astype(o_ref.dtype)
        decay_k1 = decay_ref[n, :].astype(_F32)[:, None]
        s_kv = decay_k1 * s_kv + _dot_tn(kg_ref[rows, :], v_new_mm, precision)
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


def _is_pow2(n):
    return n >= 16 and n & (n - 1) == 0


def intra_chunk(q, k, v, g, beta, *, scale, interpret=False, num_warps=4, solve="substitution"):
    """Kernel 1 on chunk-padded inputs ``[B, Tp, H, *]`` (Tp a multiple of 64; g, beta f32).

    Returns ``(qg, kg, w, u, aqk)`` as ``[B, Tp, H, *]`` (bf16 for bf16/f16 q, else f32) and ``decay [B, H, N, K]``.
    """
    b, tp, h, kd = q.shape
    vd = v.shape[-1]
    n = tp // CHUNK
    inter_dtype, precision = _matmul_policy(q.dtype)
    params = None
    if not interpret:
        from jax.experimental.pallas import triton as pl_triton
        params = pl_triton.CompilerParams(num_warps=num_warps, num_stages=1)

    def chunk_spec(width):
        return pl.BlockSpec((None, CHUNK, None, width), lambda c, bh: (bh // h, c, bh % h, 0))

    inter_shapes = (
        jax.ShapeDtypeStruct((b, tp, h, kd), inter_dtype),  # qg
        jax.ShapeDtypeStruct((b, tp, h, kd), inter_dtype),  # kg
        jax.ShapeDtypeStruct((b, tp, h, kd), inter_dtype),  # w
        jax.ShapeDtypeStruct((b, tp, h, vd), inter_dtype),  # u
        jax.ShapeDtypeStruct((b, tp, h, CHUNK), inter_dtype),  # aqk
        jax.ShapeDtypeStruct((b, h, n, kd), _F32),  # decay
    )
    return pl.pallas_call(
        functools.partial(_intra_kernel, scale=scale, precision=precision, solve=solve),
        out_shape=inter_shapes,
        grid=(n, b * h),
        in_specs=[chunk_spec(kd), chunk_spec(kd), chunk_spec(vd), chunk_spec(kd),
                  pl.BlockSpec((None, CHUNK, None), lambda c, bh: (bh // h, c, bh % h))],
        out_specs=[chunk_spec(kd), chunk_spec(kd), chunk_spec(kd), chunk_spec(vd), chunk_spec(CHUNK),
                   pl.BlockSpec((None, None, None, kd), lambda c, bh: (bh // h, bh % h, c, 0))],
        interpret=interpret,
        compiler_params=params,
        name="kda_chunk_intra",
    )(q, k, v, g, beta)


def _matmul_policy(dtype):
    """(intermediate dtype, matmul precision): bf16/f16 inputs keep 16-bit intermediates and TF32/bf16 matmuls;
    f32 inputs keep f32 intermediates and full-f32 matmuls."""
    if dtype in (jnp.bfloat16, jnp.float16):
        return dtype, lax.Precision.DEFAULT
    return _F32, lax.Precision.HIGHEST


def check_dims(kd: int, vd: int, config) -> int:
    """The value-block width for K = kd, V = vd (all powers of two, as the kernels' tiles need)."""
    block_v = min(config.block_v, vd)
    if not (_is_pow2(kd) and _is_pow2(vd) and _is_pow2(block_v)):
        raise ValueError(f"chunk_kda (Pallas): K={kd}, V={vd}, block_v={block_v} must be powers of two >= 16")
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


@functools.partial(jax.jit, static_argnames=("scale", "interpret", "config", "cu_seqlens"))
def chunk_kda_fwd(q, k, v, g, beta, initial_state, *, scale, interpret=False, config=KernelConfig(),
                  cu_seqlens=None):
    """Chunkwise KDA forward through the two Pallas kernels.

    Args:
      q, k: ``[B, T, H, K]`` (L2-normalised); v: ``[B, T, H, V]``; g: ``[B, T, H, K]`` activated log-decay (<= 0,
        >= -5 for f32 safety of the sub-chunk factorisation); beta: ``[B, T, H]``; initial_state: ``[B, H, K, V]``
        (``[N_seq, H, K, V]`` with cu_seqlens).
      scale: multiplier for q. interpret: run the kernels with the Pallas interpreter (CPU tests).
      config: GPU tuning knobs (KernelConfig).
      cu_seqlens: None, or a tuple of host ints ``(0, ..., T)`` for B = 1 packed sequences (state reset at each).

    Returns:
      ``(o [B, T, H, V] in q.dtype, final_state [B or N_seq, H, K, V] f32)``.
    """
    b, t, h, kd = q.shape
    vd = v.shape[-1]
    block_v = check_dims(kd, vd, config)
    _, precision = _matmul_policy(q.dtype)
    g = g.astype(_F32)
    beta = beta.astype(_F32)

    n, layout, to_padded, from_padded = chunk_layout(b, t, cu_seqlens)
    q, k, v, g, beta = (to_padded(x) for x in (q, k, v, g, beta))  # zero tokens neither decay nor write the state
    tp = n * CHUNK

    qg, kg, w, u, aqk, decay = intra_chunk(q, k, v, g, beta, scale=scale, interpret=interpret,
                                           num_warps=config.warps[0], solve=config.solve)
    params = None
    if not interpret:
        from jax.experimental.pallas import triton as pl_triton
        params = pl_triton.CompilerParams(num_warps=config.warps[1], num_stages=1)

    def seq_spec(width, col_block):
        if col_block:
            return pl.BlockSpec((None, tp, None, width), lambda bh, j: (bh // h, 0, bh % h, j))
        return pl.BlockSpec((None, tp, None, width), lambda bh, j: (bh // h, 0, bh % h, 0))

    in_specs = [seq_spec(kd, False), seq_spec(kd, False), seq_spec(kd, False), seq_spec(block_v, True),
                seq_spec(CHUNK, False), pl.BlockSpec((None, None, n, kd), lambda bh, j: (bh // h, bh % h, 0, 0))]
    operands = [qg, kg, w, u, aqk, decay]
    n_states = b
    if layout is None:
        state_spec = pl.BlockSpec((None, None, kd, block_v), lambda bh, j: (bh // h, bh % h, 0, j))
    else:
        n_states = layout["lens"].size
        state_spec = pl.BlockSpec((n_states, None, kd, block_v), lambda bh, j: (0, bh, 0, j))
        meta_spec = pl.BlockSpec((n,), lambda bh, j: (0,))
        in_specs += [meta_spec] * 3
        operands += [jnp.asarray(layout[name]) for name in ("chunk_seq", "chunk_first", "chunk_last")]
    o, final_state = pl.pallas_call(
        functools.partial(_recurrence_kernel, n_chunks=n, precision=precision, varlen=layout is not None),
        out_shape=(jax.ShapeDtypeStruct((b, tp, h, vd), q.dtype),
                   jax.ShapeDtypeStruct((n_states, h, kd, vd), _F32)),
        grid=(b * h, vd // block_v),
        in_specs=in_specs + [state_spec],
        out_specs=[seq_spec(block_v, True), state_spec],
        interpret=interpret,
        compiler_params=params,
        name="kda_chunk_recurrence",
    )(*operands, initial_state.astype(_F32))
    if layout is None:
        return from_padded(o), final_state
    # Empty sequences own no chunk: their final state is their initial state.
    empty = jnp.asarray(layout["lens"] == 0)[:, None, None, None]
    return from_padded(o), jnp.where(empty, initial_state.astype(_F32), final_state)
