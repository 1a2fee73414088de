"""Fused one-token KDA decode step (Pallas, Triton GPU backend; the interpreter on CPU).

Per (batch, head), with the f32 state ``S [K, V]`` (docs/spec.md#kda, the same step as ``k3jax.ops.kda.kda_step``)::

    S'    = diag(exp(g)) S
    pred  = k^T S'                      [V]
    delta = beta (v - pred)
    S''   = S' + k delta^T
    o     = (scale q)^T S''             [V]

Decode is memory bound: the whole cost is reading and writing the state. XLA splits the step into several fusions
that each read the state; here one program per (batch * head, value block) loads its ``[K, block_v]`` state tile
once, does the decay, both K-reductions and the rank-1 update in registers (elementwise products and column sums,
no matmul units: a matrix-vector product has nothing to gain from them), and writes the tile back once. The new
state aliases the old one's buffer (``input_output_aliases``), so a caller that donates the state updates it in
place. All math is f32 whatever the dtype of q, k, v.

A slot with ``g = 0`` and ``beta = 0`` (a padded or idle decode slot, see ``KDA.forward_cached``) keeps its state
unchanged: ``exp(0) = 1`` and the update adds ``k * 0``.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels.tiling import is_pow2, triton_params

__all__ = ["DECODE_BACKENDS", "kda_decode_step"]

DECODE_BACKENDS = ("gpu", "interpret")
_F32 = jnp.float32
_IO_DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))


def _decode_kernel(q_ref, k_ref, v_ref, g_ref, beta_ref, s_ref, o_ref, s_out_ref, *, scale):
    """One (batch, head) and value block: refs ``q, k, g [K]``, ``v [BV]``, ``beta [1]``, ``state [K, BV]``."""
    k_col = k_ref[...].astype(_F32)[:, None]
    s_kv = jnp.exp(g_ref[...])[:, None] * s_ref[...]
    pred_v = jnp.sum(k_col * s_kv, axis=0)
    delta_v = beta_ref[...] * (v_ref[...].astype(_F32) - pred_v)
    s_kv = s_kv + k_col * delta_v[None, :]
    q_col = (q_ref[...].astype(_F32) * scale)[:, None]
    o_ref[...] = jnp.sum(q_col * s_kv, axis=0)
    s_out_ref[...] = s_kv


def _check(q, k, v, g, beta, state, backend, block_v, warps):
    """Validates shapes and dtypes; returns the value-block width."""
    if backend not in DECODE_BACKENDS:
        raise ValueError(f"kda_decode_step: unknown backend {backend!r}; expected one of {DECODE_BACKENDS}")
    if q.ndim != 3 or k.shape != q.shape or g.shape != q.shape:
        raise ValueError(f"kda_decode_step: q, k, g must share a [B, H, K] shape, got {q.shape}, {k.shape}, "
                         f"{g.shape}")
    b, h, kd = q.shape
    if v.ndim != 3 or v.shape[:2] != (b, h):
        raise ValueError(f"kda_decode_step: v must have shape [B, H, V] = [{b}, {h}, V], got {v.shape}")
    vd = v.shape[-1]
    if beta.shape != (b, h):
        raise ValueError(f"kda_decode_step: beta must have shape [B, H] = {(b, h)}, got {beta.shape}")
    if state.shape != (b, h, kd, vd):
        raise ValueError(f"kda_decode_step: state must have shape [B, H, K, V] = {(b, h, kd, vd)}, "
                         f"got {state.shape}")
    for name, x in (("q", q), ("k", k), ("v", v)):
        if jnp.dtype(x.dtype) not in _IO_DTYPES:
            raise ValueError(f"kda_decode_step: {name} must be float32, bfloat16 or float16, got {x.dtype}")
    for name, x in (("g", g), ("beta", beta)):
        if not jnp.issubdtype(x.dtype, jnp.floating):
            raise ValueError(f"kda_decode_step: {name} must be a float array (used as f32), got {x.dtype}")
    if jnp.dtype(state.dtype) != jnp.dtype(_F32):
        raise ValueError(f"kda_decode_step: state must be float32 (the new state reuses its buffer), got "
                         f"{state.dtype}")
    if not (is_pow2(kd, 16) and is_pow2(vd, 16)):
        raise ValueError(f"kda_decode_step: K={kd} and V={vd} must be powers of two >= 16 (Triton tile sizes)")
    if not isinstance(block_v, int) or not is_pow2(block_v, 16):
        raise ValueError(f"kda_decode_step: block_v must be a power of two >= 16, got {block_v!r}")
    if not isinstance(warps, int) or warps < 1 or warps & (warps - 1):
        raise ValueError(f"kda_decode_step: warps must be a power of two >= 1, got {warps!r}")
    return min(block_v, vd)


def kda_decode_step(q_bhk, k_bhk, v_bhv, g_bhk, beta_bh, state_bhkv, *, scale, backend="gpu", block_v=32,
                    warps=4):
    """One KDA token for every (batch, head) in one Pallas call.

    Args:
      q_bhk, k_bhk: ``[B, H, K]`` L2-normalised query / key (f32, bf16 or f16; read as f32).
      v_bhv: ``[B, H, V]`` value (same dtypes).
      g_bhk: ``[B, H, K]`` activated log-decay (<= 0), used in f32.
      beta_bh: ``[B, H]`` delta-rule strength, used in f32.
      state_bhkv: ``[B, H, K, V]`` f32 state before the token; its buffer is reused for the new state (donate it
        in the enclosing ``jit`` to update in place; otherwise XLA copies it first).
      scale: q multiplier (static).
      backend: ``"gpu"`` (Pallas Triton backend) or ``"interpret"`` (the Pallas interpreter, CPU tests).
      block_v: value columns per program (power of two >= 16; capped at V). Each program holds a ``[K, block_v]``
        f32 tile: 32 keeps it at 32 registers per thread with 4 warps at K = 128.
      warps: Triton warps per program.

    Returns:
      ``(o_bhv f32, new_state_bhkv f32)``.
    """
    block_v = _check(q_bhk, k_bhk, v_bhv, g_bhk, beta_bh, state_bhkv, backend, block_v, warps)
    return _decode_call(q_bhk, k_bhk, v_bhv, g_bhk.astype(_F32), beta_bh.astype(_F32), state_bhkv,
                        scale=float(scale), interpret=backend == "interpret", block_v=block_v, warps=warps)


@functools.partial(jax.jit, static_argnames=("scale", "interpret", "block_v", "warps"))
def _decode_call(q, k, v, g, beta, state, *, scale, interpret, block_v, warps):
    b, h, kd = q.shape
    vd = v.shape[-1]

    def per_head(width, value_blocked=False):
        if value_blocked:
            return pl.BlockSpec((None, None, width), lambda bh, j: (bh // h, bh % h, j))
        return pl.BlockSpec((None, None, width), lambda bh, j: (bh // h, bh % h, 0))

    state_spec = pl.BlockSpec((None, None, kd, block_v), lambda bh, j: (bh // h, bh % h, 0, j))
    return pl.pallas_call(
        functools.partial(_decode_kernel, scale=scale),
        out_shape=(jax.ShapeDtypeStruct((b, h, vd), _F32), jax.ShapeDtypeStruct((b, h, kd, vd), _F32)),
        grid=(b * h, vd // block_v),
        in_specs=[per_head(kd), per_head(kd), per_head(block_v, True), per_head(kd), per_head(1), state_spec],
        out_specs=[per_head(block_v, True), state_spec],
        input_output_aliases={5: 1},
        interpret=interpret,
        compiler_params=triton_params(interpret, warps),
        name="kda_decode_step",
    )(q, k, v, g, beta[..., None], state)
