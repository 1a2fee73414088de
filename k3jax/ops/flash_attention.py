"""Blockwise (flash) causal softmax attention in plain JAX: MLA's training / prefill core without a T x T array.

Queries and keys are cut into blocks; each query block runs an online softmax over the key blocks up to the
diagonal (a triangular schedule: a `while` loop whose trip count depends on the block index, so no key block wholly
above the diagonal is computed and no shape is dynamic). Running max, sum and the output accumulate in at least f32
(`numerics.wide`); the output is f32 [B, T, H, V]. The backward (`jax.custom_vjp`) keeps only the inputs, the output
and the per-row logsumexp and recomputes each block's probabilities: one pass over key blocks, each looping over the
query blocks at or below the diagonal, carrying its dK, dV and adding into a dQ buffer. The largest intermediate is
one [B, H, block_q, block_k] tile.

Matmul operands are in the operands' dtype (probabilities and the output cotangent are rounded to it before their
matmuls, as flash kernels do), accumulation in at least f32; with f32 operands everything is f32. T that is not a
multiple of the blocks is padded at the end: padded keys lie after every real query, so the causal mask hides them,
and padded query rows see themselves (no empty row) and get a zero cotangent.

TPU: the maintained splash kernel (`jax.experimental.pallas.ops.tpu.splash_attention`) takes segment ids and a value
head dim unlike the key's, but writes its output (and saves it for the backward) in the query dtype: bf16 operands
give a bf16 output, where training keeps the attention output in f32 (docs/spec.md, numerics). It is therefore not
dispatched to; TPU runs this blockwise path too.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp

from k3jax.numerics import wide

__all__ = ["flash_causal_attention"]

DEFAULT_BLOCK = 512


def flash_causal_attention(q_bthk: jax.Array, k_bthk: jax.Array, v_bthv: jax.Array, *, scale: float,
                           segment_ids_bt: jax.Array | None = None, block_q: int = DEFAULT_BLOCK,
                           block_k: int = DEFAULT_BLOCK) -> jax.Array:
    """softmax(q kᵀ · scale + causal [and same-segment] mask) v, blockwise; returns f32 (wide) [B, T, H, V].

    `segment_ids_bt` int [B, T]: equal ids contiguous, a query also only sees keys with its own id. Blocks larger
    than T shrink to T; T is padded up to a multiple of both blocks."""
    b, t, h, dk = q_bthk.shape
    if k_bthk.shape != (b, t, h, dk) or v_bthv.shape[:3] != (b, t, h):
        raise ValueError(f"flash attention: q {q_bthk.shape}, k {k_bthk.shape}, v {v_bthv.shape} must share "
                         f"[B, T, H] and q/k their head dim")
    if block_q < 1 or block_k < 1:
        raise ValueError(f"flash attention: block sizes must be >= 1, got block_q={block_q}, block_k={block_k}")
    if segment_ids_bt is None:
        segment_ids_bt = jnp.zeros((b, t), jnp.int32)
    elif segment_ids_bt.shape != (b, t):
        raise ValueError(f"attention: segment_ids must have shape [B, T] = {(b, t)}, got {segment_ids_bt.shape}")
    bq, bk = min(block_q, t), min(block_k, t)
    tp = -(-t // math.lcm(bq, bk)) * math.lcm(bq, bk)
    dt = jnp.result_type(q_bthk, k_bthk, v_bthv)
    q, k, v = (x.astype(dt) for x in (q_bthk, k_bthk, v_bthv))
    seg = segment_ids_bt.astype(jnp.int32)
    if tp != t:
        pad = [(0, 0), (0, tp - t), (0, 0), (0, 0)]
        q, k, v = (jnp.pad(x, pad) for x in (q, k, v))
        seg = jnp.pad(seg, [(0, 0), (0, tp - t)], constant_values=-1)
    return _flash(float(scale), bq, bk, q, k, v, seg)[:, :t]


# ------------------------------------------------------------------------------------------- block layout helpers
def _blocks(x_bt_, size):
    """[B, T, H, D] -> [T/size, B, H, size, D] (blocks along the leading axis, indexed dynamically)."""
    b, t, h, d = x_bt_.shape
    return x_bt_.reshape(b, t // size, size, h, d).transpose(1, 0, 3, 2, 4)


def _unblocks(x_nbhsd):
    n, b, h, s, d = x_nbhsd.shape
    return x_nbhsd.transpose(1, 0, 3, 2, 4).reshape(b, n * s, h, d)


def _row_blocks(x_bth, size):
    """[B, T, H] -> [T/size, B, H, size]."""
    b, t, h = x_bth.shape
    return x_bth.reshape(b, t // size, size, h).transpose(1, 0, 3, 2)


def _seg_blocks(seg_bt, size):
    b, t = seg_bt.shape
    return seg_bt.reshape(b, t // size, size).transpose(1, 0, 2)


def _at(x, i):
    return jax.lax.dynamic_index_in_dim(x, i, axis=0, keepdims=False)


def _mask(i, j, bq, bk, seg_q_bq, seg_k_bs):
    """[B, 1, bq, bk]: key position <= query position, same segment."""
    q_pos = i * bq + jnp.arange(bq)
    k_pos = j * bk + jnp.arange(bk)
    causal = q_pos[:, None] >= k_pos[None, :]
    return (causal[None] & (seg_q_bq[:, :, None] == seg_k_bs[:, None, :]))[:, None]


def _last_key_block(i, bq, bk):
    """One past the last key block query block `i` sees: ceil((i + 1)·bq / bk)."""
    return ((i + 1) * bq + bk - 1) // bk


def _first_query_block(j, bq, bk):
    """The first query block that sees key block `j`: floor(j·bk / bq)."""
    return (j * bk) // bq


# ------------------------------------------------------------------------------------------------------- forward
def _forward(scale, bq, bk, q, k, v, seg):
    """Output [B, Tp, H, V] (wide) and logsumexp [B, Tp, H] (wide) of the padded problem."""
    acc = wide(q.dtype)
    q_n, k_n, v_n = _blocks(q, bq), _blocks(k, bk), _blocks(v, bk)
    seg_q, seg_k = _seg_blocks(seg, bq), _seg_blocks(seg, bk)
    b, h, dv = q.shape[0], q.shape[2], v.shape[-1]

    def query_block(args):
        i, q_i, sq_i = args

        def key_block(j, carry):
            m_i, l_i, o_i = carry
            s = jnp.einsum("bhqk,bhsk->bhqs", q_i, _at(k_n, j), preferred_element_type=acc) * scale
            s = jnp.where(_mask(i, j, bq, bk, sq_i, _at(seg_k, j)), s, -jnp.inf)
            m_new = jnp.maximum(m_i, s.max(axis=-1))
            m_safe = jnp.where(jnp.isfinite(m_new), m_new, 0)  # a row with no key yet: exp(-inf) = 0 everywhere
            p = jnp.exp(s - m_safe[..., None])
            alpha = jnp.exp(m_i - m_safe)
            pv = jnp.einsum("bhqs,bhsv->bhqv", p.astype(q.dtype), _at(v_n, j), preferred_element_type=acc)
            return m_new, alpha * l_i + p.sum(axis=-1), alpha[..., None] * o_i + pv

        init = (jnp.full((b, h, bq), -jnp.inf, acc), jnp.zeros((b, h, bq), acc), jnp.zeros((b, h, bq, dv), acc))
        m_i, l_i, o_i = jax.lax.fori_loop(0, _last_key_block(i, bq, bk), key_block, init)
        return o_i / l_i[..., None], m_i + jnp.log(l_i)  # every query sees itself: l_i > 0

    o_n, lse_n = jax.lax.map(query_block, (jnp.arange(q_n.shape[0]), q_n, seg_q))
    return _unblocks(o_n), _unblocks(lse_n[..., None])[..., 0]


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2))
def _flash(scale, bq, bk, q, k, v, seg):
    return _forward(scale, bq, bk, q, k, v, seg)[0]


def _flash_fwd(scale, bq, bk, q, k, v, seg):
    o, lse = _forward(scale, bq, bk, q, k, v, seg)
    return o, (q, k, v, seg, o, lse)


# ------------------------------------------------------------------------------------------------------ backward
def _flash_bwd(scale, bq, bk, res, do):
    q, k, v, seg, o, lse = res
    acc, dt = wide(q.dtype), q.dtype
    delta = jnp.sum(do * o, axis=-1)  # [B, Tp, H]: rowsum(dO ∘ O) = Σ_s P·dP
    q_n, do_n = _blocks(q, bq), _blocks(do.astype(dt), bq)
    lse_n, delta_n = _row_blocks(lse, bq), _row_blocks(delta, bq)
    seg_q, seg_k = _seg_blocks(seg, bq), _seg_blocks(seg, bk)
    nq = q_n.shape[0]

    def key_block(dq_n, args):
        j, k_j, v_j, sk_j = args

        def query_block(i, carry):
            dk_j, dv_j, dq_n = carry
            q_i, do_i = _at(q_n, i), _at(do_n, i)
            s = jnp.einsum("bhqk,bhsk->bhqs", q_i, k_j, preferred_element_type=acc) * scale
            p = jnp.where(_mask(i, j, bq, bk, _at(seg_q, i), sk_j), jnp.exp(s - _at(lse_n, i)[..., None]), 0)
            dv_j = dv_j + jnp.einsum("bhqs,bhqv->bhsv", p.astype(dt), do_i, preferred_element_type=acc)
            dp = jnp.einsum("bhqv,bhsv->bhqs", do_i, v_j, preferred_element_type=acc)
            ds = (p * (dp - _at(delta_n, i)[..., None]) * scale).astype(dt)
            dk_j = dk_j + jnp.einsum("bhqs,bhqk->bhsk", ds, q_i, preferred_element_type=acc)
            dq_i = _at(dq_n, i) + jnp.einsum("bhqs,bhsk->bhqk", ds, k_j, preferred_element_type=acc)
            return dk_j, dv_j, jax.lax.dynamic_update_index_in_dim(dq_n, dq_i, i, axis=0)

        init = (jnp.zeros(k_j.shape, acc), jnp.zeros(v_j.shape, acc), dq_n)
        dk_j, dv_j, dq_n = jax.lax.fori_loop(_first_query_block(j, bq, bk), nq, query_block, init)
        return dq_n, (dk_j, dv_j)

    k_n, v_n = _blocks(k, bk), _blocks(v, bk)
    dq_n = jnp.zeros(q_n.shape, acc)
    dq_n, (dk_n, dv_n) = jax.lax.scan(key_block, dq_n, (jnp.arange(k_n.shape[0]), k_n, v_n, seg_k))
    return (_unblocks(dq_n).astype(q.dtype), _unblocks(dk_n).astype(k.dtype), _unblocks(dv_n).astype(v.dtype),
            None)


_flash.defvjp(_flash_fwd, _flash_bwd)
