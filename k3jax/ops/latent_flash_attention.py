"""Blockwise MLA attention over latent rows, with explicit query positions: the context-parallel MLA core
(`sharding/context_parallel.py`) without a T x T array and without the expanded keys/values of the whole sequence.

Keys and values exist only one key block at a time: the outer loop takes `block_k` latent rows [lat | k_r]
(kv_lora_rank + rope wide, 576 in K3), expands them with kv_b_proj (k = [lat·W_k | k_r], v = lat·W_v, per head) and
runs the online softmax (`k3jax.ops.flash_attention`'s tile steps) of every query block that sees the key block,
so each block is expanded once per pass. Queries carry their own positions (non-decreasing, e.g. two zig-zag
chunks of a sequence); keys sit at positions 0 .. S-1; a query sees the keys at or before its position with its
segment id. Key blocks past the last query's position are never visited, nor query blocks that end before a key
block starts (`while` loops with traced bounds).

The backward (`jax.custom_vjp`) keeps the inputs, the output and the per-row logsumexp: per key block it re-expands
the rows under `jax.vjp`, recomputes the probabilities of the query blocks that see it (dK, dV carried, dQ added
into a buffer) and maps dK, dV back to the block's rows and kv_b_proj through the expansion's VJP. Largest
intermediates: the query-sized accumulators, the [B, S, C] row gradient, one expanded key block [B, H, block_k,
nope + rope + v] and one [B, H, block_q, block_k] tile. Numerics as in flash attention: matmul operands in the compute
dtype, statistics, accumulation and the output in at least f32.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from k3jax.numerics import wide
from k3jax.ops import flash_attention as fa

__all__ = ["latent_flash_attention"]


def latent_flash_attention(q_bthk: jax.Array, q_pos_t: jax.Array, rows_bsc: jax.Array, kv_b_rhe: jax.Array, *,
                           nope: int, scale: float, seg_q_bt: jax.Array | None = None,
                           seg_k_bs: jax.Array | None = None, block_q: int = fa.DEFAULT_BLOCK,
                           block_k: int = fa.DEFAULT_BLOCK) -> jax.Array:
    """softmax(q kᵀ · scale + causal [and same-segment] mask) v with k, v expanded blockwise from the latent rows.

    q [B, Tq, H, nope + rope] at positions `q_pos_t` int [Tq] (non-decreasing, shared by the batch); rows
    [B, S, r + rope] at positions 0 .. S-1; kv_b_proj [r, H, nope + V]. Segment ids int [B, Tq] / [B, S] (both or
    neither). Returns f32 (wide) [B, Tq, H, V]; a query that sees no key gets zeros. Blocks larger than Tq / S shrink
    to them; both are padded up to a block multiple."""
    b, tq, h, dk = q_bthk.shape
    s, c = rows_bsc.shape[1:]
    r = kv_b_rhe.shape[0]
    if rows_bsc.shape[0] != b or kv_b_rhe.shape[1] != h or dk != nope + c - r or kv_b_rhe.shape[2] <= nope:
        raise ValueError(f"latent attention: q {q_bthk.shape}, rows {rows_bsc.shape}, kv_b {kv_b_rhe.shape} do not "
                         f"fit nope={nope} (q width nope + rope, rows r + rope, kv_b [r, H, nope + V])")
    if q_pos_t.shape != (tq,):
        raise ValueError(f"latent attention: q_pos must have shape [Tq] = {(tq,)}, got {q_pos_t.shape}")
    if (seg_q_bt is None) != (seg_k_bs is None):
        raise ValueError("latent attention: give both segment id arrays (queries and keys) or neither")
    if seg_q_bt is None:
        seg_q_bt, seg_k_bs = jnp.zeros((b, tq), jnp.int32), jnp.zeros((b, s), jnp.int32)
    if seg_q_bt.shape != (b, tq) or seg_k_bs.shape != (b, s):
        raise ValueError(f"latent attention: segment ids {seg_q_bt.shape} / {seg_k_bs.shape} must be [B, Tq] = "
                         f"{(b, tq)} / [B, S] = {(b, s)}")
    if block_q < 1 or block_k < 1:
        raise ValueError(f"latent attention: block sizes must be >= 1, got block_q={block_q}, block_k={block_k}")
    bq, bk = min(block_q, tq), min(block_k, s)
    dt = jnp.result_type(q_bthk, rows_bsc, kv_b_rhe)
    q, rows, kv_b = q_bthk.astype(dt), rows_bsc.astype(dt), kv_b_rhe.astype(dt)
    q_pos, seg_q, seg_k = q_pos_t.astype(jnp.int32), seg_q_bt.astype(jnp.int32), seg_k_bs.astype(jnp.int32)
    if tq % bq:  # padded queries repeat the last one (position and segment): sliced off, zero cotangent
        pad = bq - tq % bq
        q = jnp.pad(q, [(0, 0), (0, pad), (0, 0), (0, 0)])
        q_pos, seg_q = jnp.pad(q_pos, (0, pad), mode="edge"), jnp.pad(seg_q, [(0, 0), (0, pad)], mode="edge")
    if s % bk:  # padded keys: position >= S, masked for every query (see _mask)
        pad = bk - s % bk
        rows = jnp.pad(rows, [(0, 0), (0, pad), (0, 0)])
        seg_k = jnp.pad(seg_k, [(0, 0), (0, pad)], constant_values=-1)
    args = _vary_alike(q, q_pos, seg_q, rows, seg_k, kv_b)
    return _latent_flash(float(scale), nope, bq, bk, s, *args)[:, :tq]


# ------------------------------------------------------------------------------------------------------- helpers
def expand_latent_rows(rows_bsc, kv_b_rhe, nope):
    """Per-head keys [B, H, S, nope + rope] and values [B, H, S, V] of latent rows [lat | k_r] (compute dtype)."""
    b, s, _ = rows_bsc.shape
    r, h, _ = kv_b_rhe.shape
    kv_bhse = jnp.einsum("bsr,rhe->bhse", rows_bsc[..., :r], kv_b_rhe)
    k_r = jnp.broadcast_to(rows_bsc[:, None, :, r:], (b, h, s, rows_bsc.shape[-1] - r))
    return jnp.concatenate([kv_bhse[..., :nope], k_r], axis=-1), kv_bhse[..., nope:]


def _mask(q_pos_q, j, bk, s_real, seg_q_bq, seg_k_bs):
    k_pos = j * bk + jnp.arange(bk)
    return fa.position_mask(q_pos_q, jnp.where(k_pos < s_real, k_pos, jnp.iinfo(jnp.int32).max), seg_q_bq, seg_k_bs)


def _schedule(q_pos_t, bq, bk, nk):
    """(blocked query positions [nq, bq], the number of key blocks any query sees, and first_query_block(j): the
    first query block whose last position reaches key block j)."""
    pos_nq = q_pos_t.reshape(-1, bq)
    last_n = pos_nq[:, -1]
    used = jnp.clip(q_pos_t[-1] // bk + 1, 0, nk)
    return pos_nq, used, lambda j: jnp.sum(last_n < j * bk).astype(jnp.int32)


def _varying_axes(x):
    t = jax.typeof(x)
    mat = getattr(t, "manual_axis_type", None)
    return frozenset(mat.varying if mat is not None else getattr(t, "vma", ()))


def _vary_alike(*xs):
    """Inside `shard_map`: every input typed as varying over every mesh axis any of them varies over, so each
    cotangent the custom VJP returns has its input's type (the `pcast`'s transpose sums the gradient of an input
    replicated over an axis, e.g. the latent rows over 'model' when heads are split). Outside: unchanged."""
    axes = frozenset().union(*(_varying_axes(x) for x in xs))
    return [jax.lax.pcast(x, tuple(sorted(axes - _varying_axes(x))), to="varying") if axes - _varying_axes(x)
            else x for x in xs]


def _varying_zero(dtype, *refs):
    """A zero scalar typed as varying over every mesh axis `refs` vary over (inside `shard_map`: loop carries
    started from constants must carry the same axes as the values the loop writes into them)."""
    return sum(jnp.zeros_like(x, dtype=dtype, shape=()) for x in refs)


def _slice_keys(x_bs_, j, bk):
    return jax.lax.dynamic_slice_in_dim(x_bs_, j * bk, bk, axis=1)


# ------------------------------------------------------------------------------------------------------- forward
def _forward(scale, nope, bq, bk, s_real, q, q_pos, seg_q, rows, seg_k, kv_b):
    """Output [B, Tq, H, V] (wide) and logsumexp [nq, B, H, bq] (wide) of the padded problem."""
    acc = wide(q.dtype)
    q_n, seg_qn = fa.split_blocks(q, bq), fa.split_seg_blocks(seg_q, bq)
    nq, b, h = q_n.shape[:3]
    pos_nq, used, first_query_block = _schedule(q_pos, bq, bk, rows.shape[1] // bk)
    dv = kv_b.shape[-1] - nope

    def key_block(j, carry):
        k_j, v_j = expand_latent_rows(_slice_keys(rows, j, bk), kv_b, nope)
        seg_j = _slice_keys(seg_k, j, bk)

        def query_block(i, carry):
            mask = _mask(fa.block_at(pos_nq, i), j, bk, s_real, fa.block_at(seg_qn, i), seg_j)
            s = fa.tile_scores(fa.block_at(q_n, i), k_j, scale, mask)
            new = fa.online_softmax_step(tuple(fa.block_at(x, i) for x in carry), s, v_j)
            return tuple(jax.lax.dynamic_update_index_in_dim(x, y, i, axis=0) for x, y in zip(carry, new))

        return jax.lax.fori_loop(first_query_block(j), nq, query_block, carry)

    zero = _varying_zero(acc, q, q_pos, seg_q, rows, seg_k, kv_b)
    init = (jnp.full((nq, b, h, bq), -jnp.inf, acc) + zero, jnp.zeros((nq, b, h, bq), acc) + zero,
            jnp.zeros((nq, b, h, bq, dv), acc) + zero)
    o_n, lse_n = fa.finish_softmax(*jax.lax.fori_loop(0, used, key_block, init))
    return fa.merge_blocks(o_n), lse_n


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2, 3, 4))
def _latent_flash(scale, nope, bq, bk, s_real, q, q_pos, seg_q, rows, seg_k, kv_b):
    return _forward(scale, nope, bq, bk, s_real, q, q_pos, seg_q, rows, seg_k, kv_b)[0]


def _latent_flash_fwd(scale, nope, bq, bk, s_real, q, q_pos, seg_q, rows, seg_k, kv_b):
    o, lse_n = _forward(scale, nope, bq, bk, s_real, q, q_pos, seg_q, rows, seg_k, kv_b)
    return o, (q, q_pos, seg_q, rows, seg_k, kv_b, o, lse_n)


# ------------------------------------------------------------------------------------------------------ backward
def _latent_flash_bwd(scale, nope, bq, bk, s_real, res, do):
    q, q_pos, seg_q, rows, seg_k, kv_b, o, lse_n = res
    acc, dt = wide(q.dtype), q.dtype
    delta_n = fa.split_row_blocks(jnp.sum(do * o, axis=-1), bq)  # rowsum(dO ∘ O) = Σ_s P·dP
    q_n, do_n, seg_qn = fa.split_blocks(q, bq), fa.split_blocks(do.astype(dt), bq), fa.split_seg_blocks(seg_q, bq)
    nq = q_n.shape[0]
    pos_nq, used, first_query_block = _schedule(q_pos, bq, bk, rows.shape[1] // bk)
    zero = _varying_zero(acc, q, q_pos, seg_q, rows, seg_k, kv_b, do)

    def key_block(j, carry):
        dq_n, drows, dkv_b = carry
        (k_j, v_j), expand_vjp = jax.vjp(lambda x, w: expand_latent_rows(x, w, nope), _slice_keys(rows, j, bk), kv_b)
        seg_j = _slice_keys(seg_k, j, bk)

        def query_block(i, carry):
            dk_j, dv_j, dq_n = carry
            mask = _mask(fa.block_at(pos_nq, i), j, bk, s_real, fa.block_at(seg_qn, i), seg_j)
            dq_i, dk, dv = fa.tile_gradients(fa.block_at(q_n, i), k_j, v_j, fa.block_at(do_n, i), fa.block_at(lse_n, i),
                                          fa.block_at(delta_n, i), mask, scale)
            return dk_j + dk, dv_j + dv, fa.add_block(dq_n, dq_i, i)

        init = (jnp.zeros(k_j.shape, acc) + zero, jnp.zeros(v_j.shape, acc) + zero, dq_n)
        dk_j, dv_j, dq_n = jax.lax.fori_loop(first_query_block(j), nq, query_block, init)
        drows_j, dkv_b_j = expand_vjp((dk_j.astype(dt), dv_j.astype(dt)))
        drows = jax.lax.dynamic_update_slice_in_dim(drows, drows_j.astype(acc), j * bk, axis=1)
        return dq_n, drows, dkv_b + dkv_b_j.astype(acc)

    init = (jnp.zeros(q_n.shape, acc) + zero, jnp.zeros(rows.shape, acc) + zero, jnp.zeros(kv_b.shape, acc) + zero)
    dq_n, drows, dkv_b = jax.lax.fori_loop(0, used, key_block, init)
    return (fa.merge_blocks(dq_n).astype(q.dtype), None, None, drows.astype(rows.dtype), None,
            dkv_b.astype(kv_b.dtype))


_latent_flash.defvjp(_latent_flash_fwd, _latent_flash_bwd)
