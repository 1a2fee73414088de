"""Blockwise (flash) causal softmax attention in plain JAX: MLA's training / prefill core without a T x T array.

Queries and keys are cut into blocks; each query block runs an online softmax over the key blocks up to the
diagonal (a triangular schedule: a `while` loop whose trip count depends on the block index, so no key block wholly
above the diagonal is computed and no shape is dynamic). Running max, sum and the output accumulate in at least f32
(`numerics.wide`); the output is f32 [B, T, H, V]. The backward (`jax.custom_vjp`) keeps only the inputs, the output
and the per-row logsumexp and recomputes each block's probabilities: one pass over key blocks, each looping over the
query blocks at or below the diagonal, carrying its dK, dV and adding into a dQ buffer. The largest intermediate is
one [B, H, block_q, block_k] tile. The per-tile steps (`tile_scores`, `online_softmax_step`, `finish_softmax`,
`tile_gradients`) and block helpers are shared with `k3jax/ops/latent_flash_attention.py` (context-parallel MLA).

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
def split_blocks(x_bt_, size):
    """[B, T, H, D] -> [T/size, B, H, size, D] (blocks along the leading axis, indexed dynamically)."""
    b, t, h, d = x_bt_.shape
    return x_bt_.reshape(b, t // size, size, h, d).transpose(1, 0, 3, 2, 4)


def merge_blocks(x_nbhsd):
    """[T/size, B, H, size, D] -> [B, T, H, D]: the inverse of `split_blocks`."""
    n, b, h, s, d = x_nbhsd.shape
    return x_nbhsd.transpose(1, 0, 3, 2, 4).reshape(b, n * s, h, d)


def split_row_blocks(x_bth, size):
    """[B, T, H] -> [T/size, B, H, size]."""
    b, t, h = x_bth.shape
    return x_bth.reshape(b, t // size, size, h).transpose(1, 0, 3, 2)


def split_seg_blocks(seg_bt, size):
    """[B, T] -> [T/size, B, size]."""
    b, t = seg_bt.shape
    return seg_bt.reshape(b, t // size, size).transpose(1, 0, 2)


def block_at(x, i):
    """Block `i` (traced) of a blocked array."""
    return jax.lax.dynamic_index_in_dim(x, i, axis=0, keepdims=False)


def add_block(x, y, i):
    """`x` with `y` added into block `i` (traced)."""
    return jax.lax.dynamic_update_index_in_dim(x, block_at(x, i) + y, i, axis=0)


def position_mask(q_pos_q, k_pos_s, seg_q_bq, seg_k_bs):
    """[B, 1, bq, bk]: key position <= query position, same segment."""
    causal = q_pos_q[:, None] >= k_pos_s[None, :]
    return (causal[None] & (seg_q_bq[:, :, None] == seg_k_bs[:, None, :]))[:, None]


def _mask(i, j, bq, bk, seg_q_bq, seg_k_bs):
    return position_mask(i * bq + jnp.arange(bq), j * bk + jnp.arange(bk), seg_q_bq, seg_k_bs)


def _last_key_block(i, bq, bk):
    """One past the last key block query block `i` sees: ceil((i + 1)·bq / bk)."""
    return ((i + 1) * bq + bk - 1) // bk


def _first_query_block(j, bq, bk):
    """The first query block that sees key block `j`: floor(j·bk / bq)."""
    return (j * bk) // bq


# ------------------------------------------------------------------------------------------ one tile (shared)
def tile_scores(q_bhqk, k_bhsk, scale, mask_b1qs):
    """Masked logits [B, H, bq, bk] of one tile, accumulated in at least f32 (masked: -inf)."""
    s = jnp.einsum("bhqk,bhsk->bhqs", q_bhqk, k_bhsk, preferred_element_type=wide(q_bhqk.dtype)) * scale
    return jnp.where(mask_b1qs, s, -jnp.inf)


def online_softmax_step(carry, s_bhqs, v_bhsv):
    """One key tile into a query tile's running (max, sum, output): the output is rescaled by exp(old max − new
    max) and gains p·v with p = exp(s − max) rounded to v's dtype for the matmul."""
    m_i, l_i, o_i = carry
    m_new = jnp.maximum(m_i, s_bhqs.max(axis=-1))
    m_safe = jnp.where(jnp.isfinite(m_new), m_new, 0)  # a row with no key yet: exp(-inf) = 0 everywhere
    p = jnp.exp(s_bhqs - m_safe[..., None])
    alpha = jnp.exp(m_i - m_safe)
    pv = jnp.einsum("bhqs,bhsv->bhqv", p.astype(v_bhsv.dtype), v_bhsv, preferred_element_type=o_i.dtype)
    return m_new, alpha * l_i + p.sum(axis=-1), alpha[..., None] * o_i + pv


def finish_softmax(m_i, l_i, o_i):
    """(output, logsumexp) from the running statistics; a row that saw no key gets 0 and -inf."""
    seen = l_i > 0
    l_safe = jnp.where(seen, l_i, 1)
    return o_i / l_safe[..., None], jnp.where(seen, m_i + jnp.log(l_safe), -jnp.inf)


def tile_gradients(q_i, k_j, v_j, do_i, lse_i, delta_i, mask, scale):
    """(dq_i, dk_j, dv_j) of one tile in at least f32, its probabilities recomputed from the rows' final
    logsumexp `lse_i` and `delta_i` = rowsum(dO ∘ O); probabilities and dS are rounded to q's dtype before their
    matmuls."""
    acc, dt = wide(q_i.dtype), q_i.dtype
    s = jnp.einsum("bhqk,bhsk->bhqs", q_i, k_j, preferred_element_type=acc) * scale
    p = jnp.where(mask, jnp.exp(s - lse_i[..., None]), 0)
    dv = jnp.einsum("bhqs,bhqv->bhsv", p.astype(dt), do_i, preferred_element_type=acc)
    dp = jnp.einsum("bhqv,bhsv->bhqs", do_i, v_j, preferred_element_type=acc)
    ds = (p * (dp - delta_i[..., None]) * scale).astype(dt)
    dk = jnp.einsum("bhqs,bhqk->bhsk", ds, q_i, preferred_element_type=acc)
    dq = jnp.einsum("bhqs,bhsk->bhqk", ds, k_j, preferred_element_type=acc)
    return dq, dk, dv


# ------------------------------------------------------------------------------------------------------- forward
def _forward(scale, bq, bk, q, k, v, seg):
    """Output [B, Tp, H, V] (wide) and logsumexp [B, Tp, H] (wide) of the padded problem."""
    acc = wide(q.dtype)
    q_n, k_n, v_n = split_blocks(q, bq), split_blocks(k, bk), split_blocks(v, bk)
    seg_q, seg_k = split_seg_blocks(seg, bq), split_seg_blocks(seg, bk)
    b, h, dv = q.shape[0], q.shape[2], v.shape[-1]

    def query_block(args):
        i, q_i, sq_i = args

        def key_block(j, carry):
            s = tile_scores(q_i, block_at(k_n, j), scale, _mask(i, j, bq, bk, sq_i, block_at(seg_k, j)))
            return online_softmax_step(carry, s, block_at(v_n, j))

        init = (jnp.full((b, h, bq), -jnp.inf, acc), jnp.zeros((b, h, bq), acc), jnp.zeros((b, h, bq, dv), acc))
        return finish_softmax(*jax.lax.fori_loop(0, _last_key_block(i, bq, bk), key_block, init))

    o_n, lse_n = jax.lax.map(query_block, (jnp.arange(q_n.shape[0]), q_n, seg_q))
    return merge_blocks(o_n), merge_blocks(lse_n[..., None])[..., 0]


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
    q_n, do_n = split_blocks(q, bq), split_blocks(do.astype(dt), bq)
    lse_n, delta_n = split_row_blocks(lse, bq), split_row_blocks(delta, bq)
    seg_q, seg_k = split_seg_blocks(seg, bq), split_seg_blocks(seg, bk)
    nq = q_n.shape[0]

    def key_block(dq_n, args):
        j, k_j, v_j, sk_j = args

        def query_block(i, carry):
            dk_j, dv_j, dq_n = carry
            q_i, do_i, lse_i, delta_i = (block_at(x, i) for x in (q_n, do_n, lse_n, delta_n))
            mask = _mask(i, j, bq, bk, block_at(seg_q, i), sk_j)
            dq_i, dk, dv = tile_gradients(q_i, k_j, v_j, do_i, lse_i, delta_i, mask, scale)
            return dk_j + dk, dv_j + dv, add_block(dq_n, dq_i, i)

        init = (jnp.zeros(k_j.shape, acc), jnp.zeros(v_j.shape, acc), dq_n)
        dk_j, dv_j, dq_n = jax.lax.fori_loop(_first_query_block(j, bq, bk), nq, query_block, init)
        return dq_n, (dk_j, dv_j)

    k_n, v_n = split_blocks(k, bk), split_blocks(v, bk)
    dq_n = jnp.zeros(q_n.shape, acc)
    dq_n, (dk_n, dv_n) = jax.lax.scan(key_block, dq_n, (jnp.arange(k_n.shape[0]), k_n, v_n, seg_k))
    dq, dk, dv = (merge_blocks(x).astype(y.dtype) for x, y in ((dq_n, q), (dk_n, k), (dv_n, v)))
    return dq, dk, dv, None


_flash.defvjp(_flash_fwd, _flash_bwd)
