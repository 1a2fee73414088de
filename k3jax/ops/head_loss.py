"""The LM head and its cross-entropy fused, in vocabulary chunks: per-token losses without a [tokens, vocab] array.

    loss_n = logsumexp_v(h_n · W[:, v]) − h_n · W[:, target_n]

`model.logits` + softmax cross-entropy keeps f32 logits, probabilities and their gradient for every token and every
vocabulary entry: for `k3` (V = 163,840) at 4,096 tokens per chip that is ~8 GB per head, twice with the MTP head
(benchmarks/RESULTS.md, 2026-12-04). Here a scan runs over `chunks` vocabulary slices: the forward keeps a running
max and sum (online logsumexp) and the target's logit; the backward (`jax.custom_vjp`) recomputes each slice's
logits from the saved hidden states and the per-token logsumexp, forms (softmax − onehot) · g for it, rounds it to
the compute dtype (as `ops.linear.project_wide`'s backward does) and accumulates dH in f32 while writing that
slice's dW. The largest intermediate is one f32 [tokens, V / chunks] slice.

Slices are strided (slice j holds the columns v with v mod chunks == j), so under a mesh whose `model` axis splits
the vocabulary into contiguous blocks every slice spans every block evenly (V / chunks must divide by that axis).
Numerics equal the unfused path's: logits from compute-dtype operands with f32 accumulation, softmax in f32, the
backward's matmuls on the cotangent rounded to the compute dtype. Exact (to f32 summation order) for f32 compute.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

__all__ = ["chunked_head_cross_entropy", "head_cross_entropy"]


def head_cross_entropy(h_xd: jax.Array, w_dv: jax.Array, targets_x: jax.Array, *, constrain=None) -> jax.Array:
    """Per-token cross-entropy f32 [...] of logits `h_xd @ w_dv` (compute-dtype operands, f32 accumulation) against
    `targets_x` (any leading axes ..., e.g. [B, T]), keeping the f32 logits for the backward (no recompute, unlike
    the chunked form): the backward forms (softmax − onehot) · g from them and rounds it to the compute dtype in ONE
    pass before its two matmuls. Autodiff of `model.logits` + softmax cross-entropy wrote the f32 logit gradient and
    rounded it in a second pass (~0.3 s of a 7.9 s `k3_gpu` step: benchmarks/RESULTS.md, 2026-12-04). Same
    numerics as that path (to f32 rounding of the softmax). `constrain`: an optional sharding constraint applied to
    the [..., V] logits and their gradient."""
    d = h_xd.shape[-1]
    if w_dv.ndim != 2 or w_dv.shape[0] != d or targets_x.shape != h_xd.shape[:-1]:
        raise ValueError(f"head loss: h {h_xd.shape}, w {w_dv.shape}, targets {targets_x.shape} disagree")
    return _head_ce_saved(h_xd, w_dv.astype(h_xd.dtype), targets_x.astype(jnp.int32), constrain or _identity)


def _identity(x):
    return x


def _saved_forward(h_xd, w_dv, targets_x, constrain):
    l_xv = constrain(jax.lax.dot_general(h_xd, w_dv, (((h_xd.ndim - 1,), (0,)), ((), ())),
                                         preferred_element_type=jnp.float32))
    m_x = jax.lax.stop_gradient(l_xv.max(axis=-1))
    lse_x = m_x + jnp.log(jnp.exp(l_xv - m_x[..., None]).sum(axis=-1))
    picked_x = jnp.take_along_axis(l_xv, targets_x[..., None], axis=-1)[..., 0]
    return lse_x - picked_x, (l_xv, lse_x)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _head_ce_saved(h_xd, w_dv, targets_x, constrain):
    return _saved_forward(h_xd, w_dv, targets_x, constrain)[0]


def _head_ce_saved_fwd(h_xd, w_dv, targets_x, constrain):
    loss_x, (l_xv, lse_x) = _saved_forward(h_xd, w_dv, targets_x, constrain)
    return loss_x, (h_xd, w_dv, targets_x, l_xv, lse_x)


def _head_ce_saved_bwd(constrain, res, g_x):
    h_xd, w_dv, targets_x, l_xv, lse_x = res
    onehot = jax.lax.broadcasted_iota(jnp.int32, l_xv.shape, l_xv.ndim - 1) == targets_x[..., None]
    dl_xv = constrain(((jnp.exp(l_xv - lse_x[..., None]) - onehot) * g_x.astype(jnp.float32)[..., None])
                      .astype(h_xd.dtype))
    lead = tuple(range(h_xd.ndim - 1))
    dh_xd = jax.lax.dot_general(dl_xv, w_dv, (((dl_xv.ndim - 1,), (1,)), ((), ())),
                                preferred_element_type=jnp.float32)
    dw_dv = jax.lax.dot_general(h_xd, dl_xv, ((lead, lead), ((), ())), preferred_element_type=jnp.float32)
    return dh_xd.astype(h_xd.dtype), dw_dv.astype(w_dv.dtype), None


_head_ce_saved.defvjp(_head_ce_saved_fwd, _head_ce_saved_bwd)


def chunked_head_cross_entropy(h_nd: jax.Array, w_dv: jax.Array, targets_n: jax.Array, *, chunks: int) -> jax.Array:
    """Per-token cross-entropy f32 [N] of logits `h_nd @ w_dv` (f32 accumulation) against `targets_n` (int, in
    [0, V)), computed over `chunks` strided vocabulary slices (V must be a multiple of `chunks`)."""
    n, d = h_nd.shape
    if w_dv.ndim != 2 or w_dv.shape[0] != d:
        raise ValueError(f"head loss: h {h_nd.shape} and w {w_dv.shape} disagree on the hidden width")
    if targets_n.shape != (n,):
        raise ValueError(f"head loss: targets {targets_n.shape} must be [N] = ({n},)")
    v = w_dv.shape[1]
    if chunks < 1 or v % chunks:
        raise ValueError(f"head loss: vocabulary {v} is not a multiple of chunks={chunks}")
    return _head_ce(h_nd, w_dv.astype(h_nd.dtype), targets_n.astype(jnp.int32), chunks)


def _slices(w_dv, chunks):
    """W [D, V] -> [chunks, D, V / chunks]: slice j holds columns j, j + chunks, j + 2·chunks, ..."""
    d, v = w_dv.shape
    return jnp.moveaxis(w_dv.reshape(d, v // chunks, chunks), 2, 0)


def _target_mask(targets_n, j, chunks, width):
    """[N, width] bool: where slice j's column is the token's target."""
    col_n = jnp.where(targets_n % chunks == j, targets_n // chunks, -1)
    return jax.lax.broadcasted_iota(jnp.int32, (targets_n.shape[0], width), 1) == col_n[:, None]


def _logits(h_nd, w_dk):
    return jax.lax.dot_general(h_nd, w_dk, (((1,), (0,)), ((), ())), preferred_element_type=jnp.float32)


def _forward(h_nd, w_dv, targets_n, chunks):
    n = h_nd.shape[0]
    w_cdk = _slices(w_dv, chunks)
    width = w_cdk.shape[2]

    def body(carry, xs):
        m_n, s_n, picked_n = carry
        j, w_dk = xs
        l_nk = _logits(h_nd, w_dk)
        m_new = jnp.maximum(m_n, l_nk.max(axis=1))
        s_n = s_n * jnp.exp(m_n - m_new) + jnp.exp(l_nk - m_new[:, None]).sum(axis=1)
        picked_n = picked_n + jnp.where(_target_mask(targets_n, j, chunks, width), l_nk, 0.0).sum(axis=1)
        return (m_new, s_n, picked_n), None

    init = (jnp.full((n,), -jnp.inf, jnp.float32), jnp.zeros((n,), jnp.float32), jnp.zeros((n,), jnp.float32))
    (m_n, s_n, picked_n), _ = jax.lax.scan(body, init, (jnp.arange(chunks, dtype=jnp.int32), w_cdk))
    lse_n = m_n + jnp.log(s_n)
    return lse_n - picked_n, lse_n


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _head_ce(h_nd, w_dv, targets_n, chunks):
    return _forward(h_nd, w_dv, targets_n, chunks)[0]


def _head_ce_fwd(h_nd, w_dv, targets_n, chunks):
    loss_n, lse_n = _forward(h_nd, w_dv, targets_n, chunks)
    return loss_n, (h_nd, w_dv, targets_n, lse_n)


def _head_ce_bwd(chunks, res, g_n):
    h_nd, w_dv, targets_n, lse_n = res
    d, v = w_dv.shape
    w_cdk = _slices(w_dv, chunks)
    width = w_cdk.shape[2]
    g_n = g_n.astype(jnp.float32)

    def body(dh_nd, xs):
        j, w_dk = xs
        p_nk = jnp.exp(_logits(h_nd, w_dk) - lse_n[:, None])
        dl_nk = ((p_nk - _target_mask(targets_n, j, chunks, width)) * g_n[:, None]).astype(h_nd.dtype)
        dh_nd = dh_nd + jax.lax.dot_general(dl_nk, w_dk, (((1,), (1,)), ((), ())),
                                            preferred_element_type=jnp.float32)
        dw_dk = jax.lax.dot_general(h_nd, dl_nk, (((0,), (0,)), ((), ())), preferred_element_type=jnp.float32)
        return dh_nd, dw_dk.astype(w_dv.dtype)

    dh_nd, dw_cdk = jax.lax.scan(body, jnp.zeros(h_nd.shape, jnp.float32),
                                 (jnp.arange(chunks, dtype=jnp.int32), w_cdk))
    dw_dv = jnp.moveaxis(dw_cdk, 0, 2).reshape(d, v)
    return dh_nd.astype(h_nd.dtype), dw_dv, None


_head_ce.defvjp(_head_ce_fwd, _head_ce_bwd)
