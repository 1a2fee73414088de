"""The quantization-aware-training copy of the routed experts' weights in one pass: MXFP4 fake quantization fused
into the cast that feeds the grouped matmul (Pallas; Triton on GPU, the interpreter on CPU).

Without QAT each micro-batch's forward casts the f32 master expert weights to the compute dtype (read 4 bytes,
write 2 per weight) and the grouped matmul reads that copy. `mxfp4_fake_quant` writes the MXFP4-fake-quantized copy
in that one pass instead (one program per block of `groups` x 32 rows of the reduction axis by `tn` columns: the
group maxima, codes, scales and decoded values stay in registers), so the grouped matmul and its backward read bf16
weights exactly as without QAT. H200, `k3_gpu`'s expert stacks: 1.4x the plain cast's time, against 3.7x for the
XLA form of the same rounding (`k3jax.ops.mx_quant.fake_quant_mxfp4`; docs/training.md#qat).

Element math: OCP MX v1.0 section 6.3 as `k3jax.ops.mx_quant` defines it (shared_exp = floor(log2(amax)) - 2
clamped at -127, each element |x| / 2^shared_exp rounded to the nearest E2M1 magnitude with ties to the even code
and saturated at 6, the NaN scale for a group holding NaN/Inf), decoded with the serving decoder's own ops
(`mxfp4.e2m1_to_f32(code) * mxfp4.e8m0_to_f32(scale)`), so the copy equals `fake_quant_mxfp4(w, axis=-2)` cast to
the compute dtype bit for bit. Only ops the Triton lowering has: bit ops (the binary exponent from the f32 bits,
powers of two built from them), compares, selects and max-reductions; the nearest E2M1 magnitude is a count of the
thresholds it reaches (`>` at the ties that round down to an even code, `>=` where they round up).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels.gmm import mxfp4
from pallas_kernels.tiling import largest_pow2_divisor, triton_params

__all__ = ["applies", "mxfp4_fake_quant", "mxfp4_fake_quant_grouped"]

GROUP = mxfp4.GROUP
_E2M1_EMAX = 2
# magnitude thresholds between consecutive E2M1 values 0, .5, 1, 1.5, 2, 3, 4, 6 and whether a tie rounds up
# (to the even code): 0.25 -> 0, 0.75 -> 1, 1.25 -> 1, 1.75 -> 2, 2.5 -> 2, 3.5 -> 4, 5 -> 4
_E2M1_THRESHOLDS = ((0.25, False), (0.75, True), (1.25, False), (1.75, True), (2.5, False), (3.5, True), (5.0, False))
# [32, 128] f32 per program at 4 warps. H200, k3_gpu's three stacks (113M f32 weights): 0.41 ms (1.6 TB/s of
# reads + writes) against 0.60 for [32, 256], 0.71 for [2, 32, 256], 0.87-1.03 for 4-8 groups; the bf16 cast 0.29
BLOCK = (1, 128, 4)
BLOCK_N = 256  # the widest column block (`applies`: n needs a power-of-two divisor >= 16)


def _floor_log2(a):
    """floor(log2(a)) for f32 a >= 0 from its exponent bits; -127 for 0 and subnormals (below every clamp used)."""
    field = (jax.lax.bitcast_convert_type(a, jnp.int32) >> 23) & 0xFF
    return jnp.where(field > 0, field - 127, -127)


def _pow2(e):
    """2^e as f32 for int32 e in [-126, 127], from the exponent bits (exact)."""
    return jax.lax.bitcast_convert_type((e + 127) << 23, jnp.float32)


def mxfp4_fake_quant_grouped(x, axis: int):
    """x (any float dtype) with whole groups of 32 along `axis` (that axis has size 32) -> the decoded MXFP4
    values, f32, same shape. Kernel-safe jnp (runs inside the Triton kernel and in XLA)."""
    x = x.astype(jnp.float32)
    finite = jnp.isfinite(x)
    bad = jnp.max(jnp.where(finite, 0, 1), axis=axis, keepdims=True) > 0  # the group holds NaN or Inf
    amax = jnp.max(jnp.where(finite, jnp.abs(x), 0.0), axis=axis, keepdims=True)
    shared = jnp.maximum(_floor_log2(amax) - _E2M1_EMAX, -127)  # [-127, 125]
    a = jnp.abs(x) * _pow2(-shared)  # exact: a normal power-of-two factor
    mag = sum((a >= t if up else a > t).astype(jnp.int32) for t, up in _E2M1_THRESHOLDS)
    sign = (jax.lax.bitcast_convert_type(x, jnp.int32) >> 28) & 8  # bit 31 -> code bit 3 (keeps -0.0)
    code = jnp.where(bad, 0, mag | sign)
    scale = jnp.where(bad, 255, shared + 127)
    return mxfp4.e2m1_to_f32(code) * mxfp4.e8m0_to_f32(scale)


def applies(shape) -> bool:
    """Whether `mxfp4_fake_quant` takes weights of `shape` [..., k, n]: k a multiple of 32 and n a multiple of 16
    (Triton blocks are powers of two)."""
    return len(shape) >= 2 and shape[-2] % GROUP == 0 and shape[-2] > 0 and \
        largest_pow2_divisor(shape[-1], BLOCK_N, 16) > 0


@functools.partial(jax.jit, static_argnames=("out_dtype", "interpret", "block"))
def mxfp4_fake_quant(w_kn: jax.Array, *, out_dtype, interpret: bool = False, block=None) -> jax.Array:
    """w [..., k, n] -> fake_quant_mxfp4(w, axis=-2) in w's dtype, then cast to `out_dtype`: MXFP4 along the
    reduction axis k, in one read of w and one write of the result. Needs `applies(w.shape)`. `block`: (groups of 32
    rows, columns, warps) per program, powers of two (default `BLOCK`; shrunk to divide the shape)."""
    if not applies(w_kn.shape):
        raise ValueError(f"mxfp4_fake_quant needs weights [..., k, n] with k a multiple of {GROUP} and n a multiple "
                         f"of 16, got {w_kn.shape}")
    *lead, k, n = w_kn.shape
    groups = k // GROUP
    block_groups, block_n, warps = block or BLOCK
    r = largest_pow2_divisor(groups, block_groups)
    tn = largest_pow2_divisor(n, block_n, 16)
    w = w_kn.reshape(-1, groups, GROUP, n)
    in_dtype = w_kn.dtype

    def kernel(w_ref, out_ref):
        values = mxfp4_fake_quant_grouped(w_ref[...], axis=1)  # [r, 32, tn]
        out_ref[...] = values.astype(in_dtype).astype(out_ref.dtype)

    spec = pl.BlockSpec((None, r, GROUP, tn), lambda e, i, j: (e, i, 0, j))
    out = pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct(w.shape, out_dtype),
        grid=(w.shape[0], groups // r, n // tn),
        in_specs=[spec],
        out_specs=spec,
        interpret=interpret,
        compiler_params=triton_params(interpret, warps),
        name="k3_mxfp4_fake_quant",
    )(w)
    return out.reshape(*lead, k, n)
