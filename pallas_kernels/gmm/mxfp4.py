"""MXFP4 decoding in jnp, written to run inside the grouped matmul kernels (Triton and interpret) and outside them.

Layout (HF release, docs/spec.md#mxfp4): packed u8 [..., n, k/2], byte b holds two E2M1 codes, low nibble = even
column k, high nibble = odd column; scales u8 [..., n, k/32], one E8M0 exponent per 32 consecutive k columns.
value = E2M1(code) · 2^(scale − 127).

No lookup table (Triton has no gather): an E2M1 code's f32 bit pattern is built directly. For magnitude bits
(e1 e0 m) with e = 2·e1 + e0 > 0 the value is 2^(e−1)·(1 + m/2): f32 exponent field e + 126 and mantissa top bit m,
i.e. (mag << 22) + (126 << 23); mag = 1 is 0.5 (exponent field 126), mag = 0 is 0; the sign goes to bit 31. The
scale 2^(s−127) is the f32 with exponent field s (s = 0: the subnormal 2^−127, s = 255: NaN). The product of the
two f32 values is exact (2 significant bits), and so is its cast to bf16 wherever it is in bf16's normal range.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

GROUP = 32  # k columns per E8M0 scale


def e2m1_to_f32(code):
    """int32 codes 0..15 -> f32 values (code 8 is -0.0)."""
    mag = code & 7
    bits = jnp.where(mag >= 2, (mag << 22) + (126 << 23), jnp.where(mag == 1, 126 << 23, 0))
    bits = bits | ((code & 8) << 28)
    return jax.lax.bitcast_convert_type(bits.astype(jnp.int32), jnp.float32)


def e8m0_to_f32(scale):
    """int32 E8M0 exponents 0..255 -> 2^(scale − 127) as f32 (255 -> NaN)."""
    bits = jnp.where(scale == 0, 0x00400000, scale << 23)
    bits = jnp.where(scale == 255, 0x7FC00000, bits)
    return jax.lax.bitcast_convert_type(bits.astype(jnp.int32), jnp.float32)


def decode_tile(packed_nh, scales_ns, dtype):
    """One weight tile: packed u8 [tn, tk/2] + scales u8 [tn, tk/32] -> `dtype` [tn, tk] (k in natural order).

    Uses only ops the Triton lowering has: bit ops, a 2-way join on the last axis (`jnp.stack(axis=-1)`) that
    interleaves the low/high nibbles, and reshapes/broadcasts that repeat each scale over its 32 columns."""
    tn, half = packed_nh.shape
    groups = scales_ns.shape[1]
    codes = packed_nh.astype(jnp.int32)
    factor = e8m0_to_f32(scales_ns.astype(jnp.int32))  # [tn, tk/32]
    factor = jnp.broadcast_to(factor.reshape(tn, groups, 1), (tn, groups, GROUP // 2)).reshape(tn, half)
    lo = (e2m1_to_f32(codes & 15) * factor).astype(dtype)  # even columns; a nibble pair shares its group's scale
    hi = (e2m1_to_f32(codes >> 4) * factor).astype(dtype)  # odd columns; cast before the join: half the registers
    return jnp.stack([lo, hi], axis=-1).reshape(tn, 2 * half)


def dequantize(packed_gnh, scales_gns, dtype=jnp.bfloat16):
    """Whole weights: packed u8 [g, n, k/2] + scales u8 [g, n, k/32] -> `dtype` [g, n, k] (the XLA path)."""
    g, n, half = packed_gnh.shape
    codes = packed_gnh.astype(jnp.int32)
    values = jnp.stack([e2m1_to_f32(codes & 15), e2m1_to_f32(codes >> 4)], axis=-1).reshape(g, n, -1, GROUP)
    factor = e8m0_to_f32(scales_gns.astype(jnp.int32))[..., None]
    return (values * factor).reshape(g, n, 2 * half).astype(dtype)


def check_shapes(lhs_mk, packed_gnh, scales_gns, group_sizes_g) -> None:
    """Raises ValueError naming the problem if the operands of `gmm_mxfp4` do not fit together."""
    if lhs_mk.ndim != 2 or packed_gnh.ndim != 3 or scales_gns.ndim != 3 or group_sizes_g.ndim != 1:
        raise ValueError(f"gmm_mxfp4 expects lhs [m, k], packed [g, n, k/2], scales [g, n, k/32], group_sizes [g];"
                         f" got {lhs_mk.shape}, {packed_gnh.shape}, {scales_gns.shape}, {group_sizes_g.shape}")
    m, k = lhs_mk.shape
    g, n, half = packed_gnh.shape
    if k % GROUP:
        raise ValueError(f"gmm_mxfp4 needs k divisible by the MXFP4 group {GROUP}, got k={k}")
    if half * 2 != k or scales_gns.shape != (g, n, k // GROUP) or group_sizes_g.shape[0] != g:
        raise ValueError(f"gmm_mxfp4 shape mismatch: lhs {lhs_mk.shape} (k={k}) needs packed [g, n, {k // 2}] and "
                         f"scales [g, n, {k // GROUP}] with g = len(group_sizes); got packed {packed_gnh.shape}, "
                         f"scales {scales_gns.shape}, group_sizes {group_sizes_g.shape}")
    if packed_gnh.dtype != jnp.uint8 or scales_gns.dtype != jnp.uint8:
        raise ValueError(f"gmm_mxfp4 needs uint8 packed weights and E8M0 scales, got {packed_gnh.dtype} / "
                         f"{scales_gns.dtype}")
    if not jnp.issubdtype(group_sizes_g.dtype, jnp.integer):
        raise ValueError(f"group_sizes must be integers, got {group_sizes_g.dtype}")
