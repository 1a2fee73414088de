"""The training KDA input prologue in one kernel each way: causal depthwise short conv → SiLU → (q, k: per-head L2
norm), forward and backward (Pallas, Triton GPU backend; the interpreter on CPU).

In XLA the chain is five to eight memory-bound fusions per projection and direction (the f32 conv, SiLU, the cast,
the norm's reduction and scale; in the backward four tap reductions for the kernel gradient), 7% of the `k3_gpu`
training step (benchmarks/RESULTS.md 2026-12-04). Here the forward reads x once and writes the activation dtype; the
backward reads x and the output gradient and writes dx plus per-block partial kernel gradients.

Numerics (the model's XLA path, `k3jax.layers.kda`, with the "pallas" core): with ``W`` taps,
    c_t = Σ_w kernel[w] · x_{t-(W-1)+w}   (f32, taps in order; taps reaching an earlier document are 0)
    s_t = round(silu(c_t));   out_t = round(s_t / sqrt(Σ_head s_t² + eps))  (normalize)  or  s_t
where round is to the activation dtype. The backward is that chain's gradient, rounding where the XLA gradient
rounds (the transposes of the two casts).

Layout: ``x_pad [B, T + 2(W-1), P]`` (W-1 zero rows each side, so every halo load stays in bounds: the Pallas
interpreter clamps out-of-range slices instead of masking them), ``doc_pad [B, T + 2(W-1)]`` int32 document index
(left pad 0 = the first document, right pad -1), ``kernel [W, P]`` f32, the output gradient ``dout_pad [B, T + W-1,
P]`` (W-1 zero rows on the right). Grid (B, T / block_t, P / head_dim): one head's columns per program, so the norm is
a row reduction in registers. The wrapper lives in `k3jax.ops.conv` (padding, gradient rule, eligibility).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels.tiling import is_pow2, triton_params

__all__ = ["conv_prologue_bwd", "conv_prologue_fwd", "supported"]

_F32 = jnp.float32


def supported(t: int, p: int, head_dim: int, block_t: int) -> str | None:
    """None when the kernels take these sizes, else the reason they do not."""
    if not is_pow2(head_dim, 16):
        return f"head_dim={head_dim} must be a power of two >= 16"
    if p % head_dim:
        return f"the width {p} must be a multiple of head_dim={head_dim}"
    if not is_pow2(block_t, 16):
        return f"block_t={block_t} must be a power of two >= 16"
    if t % block_t:
        return f"T={t} must be a multiple of block_t={block_t}"
    return None


def _sigmoid(x):
    return 1.0 / (1.0 + jnp.exp(-x))


def _conv(x_ref, k_ref, doc_ref, bi, row0, cols, block_t, w_taps, with_docs):
    """f32 [block_t, C] conv output at output rows row0 .. row0 + block_t (x_pad rows row0 + w for tap w), and the
    taps' inputs (for the kernel gradient)."""
    acc = jnp.zeros((block_t, cols.size), _F32)
    here = doc_ref[bi, pl.ds(row0 + w_taps - 1, block_t)] if with_docs else None
    taps = []
    for w in range(w_taps):
        xs = x_ref[bi, pl.ds(row0 + w, block_t), cols].astype(_F32)
        if with_docs:
            xs = jnp.where((doc_ref[bi, pl.ds(row0 + w, block_t)] == here)[:, None], xs, 0.0)
        taps.append(xs)
        acc = acc + xs * k_ref[w, cols][None, :]
    return acc, taps


def conv_prologue_fwd(x_pad, kernel, doc_pad, *, t: int, head_dim: int, normalize: bool, eps: float,
                      out_dtype, block_t: int = 32, warps: int = 4, interpret: bool = False):
    """``out [B, T, P]`` in `out_dtype` (see the module docstring for the layout). `doc_pad` None: one document."""
    return _fwd_call(x_pad, kernel.astype(_F32), doc_pad, t=t, head_dim=head_dim, normalize=normalize, eps=float(eps),
                     out_dtype=jnp.dtype(out_dtype), block_t=block_t, warps=warps, interpret=interpret)


@functools.partial(jax.jit, static_argnames=("t", "head_dim", "normalize", "eps", "out_dtype", "block_t", "warps",
                                             "interpret"))
def _fwd_call(x_pad, kernel, doc_pad, *, t, head_dim, normalize, eps, out_dtype, block_t, warps, interpret):
    b, _, p = x_pad.shape
    w_taps = kernel.shape[0]
    with_docs = doc_pad is not None

    def body(x_ref, k_ref, *rest):
        doc_ref, o_ref = rest if with_docs else (None, rest[0])
        bi, ti, ci = pl.program_id(0), pl.program_id(1), pl.program_id(2)
        row0 = pl.multiple_of(ti * block_t, block_t)
        cols = pl.ds(pl.multiple_of(ci * head_dim, head_dim), head_dim)
        c, _ = _conv(x_ref, k_ref, doc_ref, bi, row0, cols, block_t, w_taps, with_docs)
        s = (c * _sigmoid(c)).astype(out_dtype).astype(_F32)
        if normalize:
            s = s / jnp.sqrt(jnp.sum(s * s, axis=1, keepdims=True) + eps)
        o_ref[bi, pl.ds(row0, block_t), cols] = s.astype(out_dtype)

    operands = (x_pad, kernel) + ((doc_pad,) if with_docs else ())
    return pl.pallas_call(
        body, out_shape=jax.ShapeDtypeStruct((b, t, p), out_dtype), grid=(b, t // block_t, p // head_dim),
        interpret=interpret, compiler_params=triton_params(interpret, warps), name="kda_conv_prologue_fwd",
    )(*operands)


def conv_prologue_bwd(x_pad, kernel, doc_pad, dout_pad, *, t: int, head_dim: int, normalize: bool, eps: float,
                      block_t: int = 32, warps: int = 4, interpret: bool = False):
    """``(dx [B, T, P] in x's dtype, dkernel_part [B, T / block_t, W, P] f32)``: the input gradient and per-block
    partial sums of the kernel gradient (the caller sums them)."""
    return _bwd_call(x_pad, kernel.astype(_F32), doc_pad, dout_pad, t=t, head_dim=head_dim, normalize=normalize,
                     eps=float(eps), block_t=block_t, warps=warps, interpret=interpret)


@functools.partial(jax.jit, static_argnames=("t", "head_dim", "normalize", "eps", "block_t", "warps", "interpret"))
def _bwd_call(x_pad, kernel, doc_pad, dout_pad, *, t, head_dim, normalize, eps, block_t, warps, interpret):
    b, _, p = x_pad.shape
    w_taps = kernel.shape[0]
    act = dout_pad.dtype
    with_docs = doc_pad is not None
    n_blocks = t // block_t

    def body(x_ref, k_ref, *rest):
        if with_docs:
            doc_ref, dout_ref, dx_ref, dk_ref = rest
        else:
            doc_ref, (dout_ref, dx_ref, dk_ref) = None, rest
        bi, ti, ci = pl.program_id(0), pl.program_id(1), pl.program_id(2)
        row0 = pl.multiple_of(ti * block_t, block_t)
        cols = pl.ds(pl.multiple_of(ci * head_dim, head_dim), head_dim)

        def grad_c(j):  # d loss / d c at output rows row0 + j .. (+ block_t), f32; and the taps' inputs
            c, taps = _conv(x_ref, k_ref, doc_ref, bi, row0 + j, cols, block_t, w_taps, with_docs)
            sig = _sigmoid(c)
            ds = dout_ref[bi, pl.ds(row0 + j, block_t), cols].astype(_F32)
            if normalize:
                s = (c * sig).astype(act).astype(_F32)
                inv = 1.0 / jnp.sqrt(jnp.sum(s * s, axis=1, keepdims=True) + eps)
                ds = ds * inv - s * (jnp.sum(s * ds, axis=1, keepdims=True) * inv * inv * inv)
                ds = ds.astype(act).astype(_F32)
            return ds * (sig * (1.0 + c * (1.0 - sig))), taps

        here = doc_ref[bi, pl.ds(row0 + w_taps - 1, block_t)] if with_docs else None
        dx = jnp.zeros((block_t, head_dim), _F32)
        for j in range(w_taps):  # tap w = W-1-j carries x_r to output row r + j
            g, taps = grad_c(j)
            if j == 0:
                for w in range(w_taps):
                    dk_ref[bi, ti, w, cols] = jnp.sum(taps[w] * g, axis=0)
            if with_docs:
                g = jnp.where((doc_ref[bi, pl.ds(row0 + w_taps - 1 + j, block_t)] == here)[:, None], g, 0.0)
            dx = dx + g * k_ref[w_taps - 1 - j, cols][None, :]
        dx_ref[bi, pl.ds(row0, block_t), cols] = dx.astype(dx_ref.dtype)

    operands = (x_pad, kernel) + ((doc_pad,) if with_docs else ()) + (dout_pad,)
    return pl.pallas_call(
        body,
        out_shape=(jax.ShapeDtypeStruct((b, t, p), x_pad.dtype),
                   jax.ShapeDtypeStruct((b, n_blocks, w_taps, p), _F32)),
        grid=(b, n_blocks, p // head_dim), interpret=interpret, compiler_params=triton_params(interpret, warps),
        name="kda_conv_prologue_bwd",
    )(*operands)
