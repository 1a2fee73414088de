"""One-token KDA decode with its prologue fused in (Pallas, Triton GPU backend; the interpreter on CPU).

`decode.kda_decode_step` takes q, k, v, g and β already activated; at decode XLA spends about eight small kernels
per layer producing them (the short conv over the stacked q/k/v history, SiLU, the casts, two L2 norms, the gate
and β activations, the padding masks). This kernel starts from the layer's raw inputs instead:

- ``proj``: the pre-conv q, k, v projections of the new token, three [B, H*K] arrays (separate: stacking them
  would be one more kernel between the projection matmul and this one), ``hist [B, W-1, 3, H*K]`` the W-1
  previous ones (the layer's conv state, stacked), ``conv_w``: the q, k, v depthwise kernels, three [W, H*K]
  arrays (any float dtype; used in f32);
- ``z [B, H, K]``: the gate's low-rank projection output, ``A_log [H]``, ``dt_bias [H, K]``;
- ``b_raw [B, H]``: β's logits; ``valid [B]``: 0 for a slot whose token is padding (β = g = 0: state unchanged).

and per (batch, head, value block) program computes, with the released numerics (docs/spec.md#kda; the model's XLA
path in `k3jax.layers.kda`):
    c      = Σ_w conv_w[w] · [hist; proj][w]  (f32, taps in order)     q, k, v = round(silu(c))
    q, k   = round(l2_normalize(q)), round(l2_normalize(k))            (round: to the activation dtype)
    g      = lower_bound · sigmoid(exp(A_log) · (z + dt_bias))         β = sigmoid(b_raw)   (0 where not valid)
then the delta-rule step of `decode.kda_decode_step` on its [K, block_v] state tile (read once, written once, in
place). The new conv history is a select in XLA (`k3jax.layers.kda.history_at`); the projections stay XLA
matmuls. Requires V == K (the stacked conv layout) and power-of-two K.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels.tiling import triton_params

__all__ = ["kda_decode_fused"]

_F32 = jnp.float32
_BACKENDS = ("gpu", "interpret")


def _sigmoid(x):
    return 1.0 / (1.0 + jnp.exp(-x))


def kda_decode_fused(proj_qkv, hist_bw3p, conv_qkv, z_bhk, a_log_h, dt_bias_hk, b_raw_bh, valid_b, state_bhkv, *,
                     scale: float, lower_bound: float, l2_eps: float = 1e-6, backend: str = "gpu",
                     block_v: int = 32, warps: int = 4, out_gate_bp=None, out_norm_v=None,
                     out_eps: float = 1e-6):
    """Returns ``(o [B, H, V] f32, new_state [B, H, K, V] f32)``; the state's buffer is reused (donate it).
    `proj_qkv`: the (q, k, v) projections, each [B, H*K]; `conv_qkv`: their conv kernels, each [W, H*K].

    With `out_gate_bp` (the output gate's logits [B, H*V]) and `out_norm_v` (the per-head RMSNorm gain [V]) the
    kernel also applies the layer's output epilogue (`k3jax.layers.kda.KDA._output` before o_proj) and returns o
    in the activation dtype: ``round(rmsnorm(round(o)) * gain * sigmoid(gate))`` (f32 inside, eps `out_eps`).
    That needs a whole head per program: `block_v` is then taken as V."""
    if backend not in _BACKENDS:
        raise ValueError(f"kda_decode_fused: unknown backend {backend!r}; expected one of {_BACKENDS}")
    if len(proj_qkv) != 3 or len(conv_qkv) != 3:
        raise ValueError(f"kda_decode_fused: proj and conv_w must be (q, k, v) triples, got {len(proj_qkv)} and "
                         f"{len(conv_qkv)} arrays")
    b, h, kd = z_bhk.shape
    wm1 = hist_bw3p.shape[1]
    p = h * kd
    expected = {"hist": (hist_bw3p, (b, wm1, 3, p)), "A_log": (a_log_h, (h,)), "dt_bias": (dt_bias_hk, (h, kd)),
                "b_raw": (b_raw_bh, (b, h)), "valid": (valid_b, (b,)), "state": (state_bhkv, (b, h, kd, kd))}
    for c, name in enumerate("qkv"):
        expected[f"proj[{name}]"] = (proj_qkv[c], (b, p))
        expected[f"conv_w[{name}]"] = (conv_qkv[c], (wm1 + 1, p))
    for name, (x, shape) in expected.items():
        if tuple(x.shape) != shape:
            raise ValueError(f"kda_decode_fused: {name} must have shape {list(shape)} (B={b}, H={h}, K=V={kd}, "
                             f"W-1={wm1}), got {list(x.shape)}")
    if kd < 16 or kd & (kd - 1):
        raise ValueError(f"kda_decode_fused: K={kd} must be a power of two >= 16")
    if wm1 < 1:
        raise ValueError(f"kda_decode_fused: the conv history needs W-1 >= 1 rows, got hist {list(hist_bw3p.shape)}")
    if not isinstance(block_v, int) or block_v < 16 or block_v & (block_v - 1):
        raise ValueError(f"kda_decode_fused: block_v must be a power of two >= 16, got {block_v!r}")
    if not isinstance(warps, int) or warps < 1 or warps & (warps - 1):
        raise ValueError(f"kda_decode_fused: warps must be a power of two >= 1, got {warps!r}")
    if b * h * kd * kd >= 2 ** 31:
        raise ValueError(f"kda_decode_fused: the state has {b * h * kd * kd} elements; int32 offsets need < 2^31 "
                         f"(split the batch)")
    if any(jnp.dtype(x.dtype) != jnp.dtype(hist_bw3p.dtype) for x in proj_qkv):
        raise ValueError(f"kda_decode_fused: proj and hist must share the activation dtype, got "
                         f"{[str(x.dtype) for x in proj_qkv]} and {hist_bw3p.dtype}")
    if jnp.dtype(state_bhkv.dtype) != jnp.dtype(_F32):
        raise ValueError(f"kda_decode_fused: state must be float32, got {state_bhkv.dtype}")
    if (out_gate_bp is None) != (out_norm_v is None):
        raise ValueError("kda_decode_fused: the output epilogue needs both out_gate_bp and out_norm_v")
    epilogue = ()
    if out_gate_bp is not None:
        if tuple(out_gate_bp.shape) != (b, p) or tuple(out_norm_v.shape) != (kd,):
            raise ValueError(f"kda_decode_fused: out_gate_bp must have shape {[b, p]} and out_norm_v {[kd]}, got "
                             f"{list(out_gate_bp.shape)} and {list(out_norm_v.shape)}")
        epilogue = (out_gate_bp, out_norm_v.astype(_F32))
        block_v = kd
    block_v = min(block_v, kd)
    return _fused_call(tuple(proj_qkv), hist_bw3p, tuple(w.astype(_F32) for w in conv_qkv), z_bhk,
                       a_log_h.astype(_F32), dt_bias_hk.astype(_F32), b_raw_bh, valid_b.astype(jnp.int32), state_bhkv,
                       epilogue, scale=float(scale), lower_bound=float(lower_bound), l2_eps=float(l2_eps),
                       out_eps=float(out_eps), interpret=backend == "interpret", block_v=block_v, warps=warps)


@functools.partial(jax.jit, static_argnames=("scale", "lower_bound", "l2_eps", "out_eps", "interpret", "block_v",
                                             "warps"))
def _fused_call(proj, hist, conv_w, z, a_log, dt_bias, b_raw, valid, state, epilogue, *, scale, lower_bound, l2_eps,
                out_eps, interpret, block_v, warps):
    b, h, kd = z.shape
    wm1 = hist.shape[1]
    act = proj[0].dtype
    gated = bool(epilogue)

    def kernel(q_ref, k_ref, v_ref, hist_ref, conv_q_ref, conv_k_ref, conv_v_ref, z_ref, a_log_ref, dt_bias_ref,
               b_raw_ref, valid_ref, s_ref, *rest):
        if gated:
            gate_ref, norm_ref, o_ref, s_out_ref = rest
        else:
            o_ref, s_out_ref = rest
        proj_ref, conv_ref = (q_ref, k_ref, v_ref), (conv_q_ref, conv_k_ref, conv_v_ref)
        bh, j = pl.program_id(0), pl.program_id(1)
        bi, hi = bh // h, bh % h
        head = pl.ds(pl.multiple_of(hi * kd, kd), kd)
        vblock = pl.ds(pl.multiple_of(hi * kd + j * block_v, block_v), block_v)

        def conv_silu(c, cols):  # the short conv of channel c (0 q, 1 k, 2 v) on columns cols, SiLU, rounded
            acc = jnp.zeros((cols.size,), _F32)
            for w in range(wm1):
                acc = acc + hist_ref[bi, w, c, cols].astype(_F32) * conv_ref[c][w, cols]
            acc = acc + proj_ref[c][bi, cols].astype(_F32) * conv_ref[c][wm1, cols]
            return (acc * _sigmoid(acc)).astype(act).astype(_F32)

        def l2(x):
            return (x / jnp.sqrt(jnp.sum(x * x) + l2_eps)).astype(act).astype(_F32)

        q, k = l2(conv_silu(0, head)), l2(conv_silu(1, head))
        v = conv_silu(2, vblock)
        ok = valid_ref[bi] != 0
        gate = lower_bound * _sigmoid(jnp.exp(a_log_ref[hi]) * (z_ref[bi, hi, :].astype(_F32) + dt_bias_ref[hi, :]))
        g = jnp.where(ok, gate, 0.0)
        beta = jnp.where(ok, _sigmoid(b_raw_ref[bi, hi].astype(_F32)), 0.0)
        vcols = pl.ds(pl.multiple_of(j * block_v, block_v), block_v)
        s_kv = jnp.exp(g)[:, None] * s_ref[bi, hi, :, vcols]
        pred_v = jnp.sum(k[:, None] * s_kv, axis=0)
        s_kv = s_kv + k[:, None] * (beta * (v - pred_v))[None, :]
        o = jnp.sum((q * scale)[:, None] * s_kv, axis=0)
        if gated:  # block_v == V: the whole head's output, RMSNorm'd and gated as KDA._output
            o = o.astype(act).astype(_F32)
            o = o * jax.lax.rsqrt(jnp.mean(o * o) + out_eps) * norm_ref[...]
            o = (o * _sigmoid(gate_ref[bi, head].astype(_F32))).astype(act)
        o_ref[bi, hi, vcols] = o
        s_out_ref[bi, hi, :, vcols] = s_kv

    o_dtype = act if gated else _F32
    return pl.pallas_call(
        kernel,
        out_shape=(jax.ShapeDtypeStruct((b, h, kd), o_dtype), jax.ShapeDtypeStruct((b, h, kd, kd), _F32)),
        grid=(b * h, kd // block_v),
        input_output_aliases={12: 1},
        interpret=interpret,
        compiler_params=triton_params(interpret, warps),
        name="kda_decode_fused",
    )(*proj, hist, *conv_w, z, a_log, dt_bias, b_raw, valid, state, *epilogue)
