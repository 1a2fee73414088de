"""MXFP4 decoding of the released routed experts (docs/spec.md#mxfp4).

`weight_packed` u8 [out, in/2]: byte b holds two E2M1 codes, low nibble = even input column, high nibble = odd.
`weight_scale` u8 [out, in/32]: E8M0 exponents, one per 32 consecutive input columns.
value = LUT[c & 7] · (−1 if c & 8) · 2^(scale − 127), LUT = [0, .5, 1, 1.5, 2, 3, 4, 6].
"""

from __future__ import annotations

import ml_dtypes
import numpy as np

GROUP = 32
_LUT = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0], np.float32)
CODE_VALUES = np.concatenate([_LUT, -_LUT]).astype(np.float32)  # code c -> value, c in 0..15 (code 8 is -0.0)
# byte -> its two values (low nibble first): one gather decodes a whole row pair-wise
_PAIRS = np.stack([CODE_VALUES[np.arange(256) & 0x0F], CODE_VALUES[np.arange(256) >> 4]], axis=-1)


def check_shapes(packed_shape, scale_shape, out_features: int, in_features: int) -> str | None:
    """None if the shapes fit [out, in]; else a description of what was expected."""
    want_p, want_s = (out_features, in_features // 2), (out_features, in_features // GROUP)
    if in_features % GROUP or tuple(packed_shape) != want_p or tuple(scale_shape) != want_s:
        return f"expected weight_packed {list(want_p)} and weight_scale {list(want_s)} for [{out_features}, " \
               f"{in_features}] (group {GROUP})"
    return None


def decode(packed: np.ndarray, scale: np.ndarray, dtype=np.float32) -> np.ndarray:
    """Decodes one MXFP4 matrix to `dtype` [out, in]. Exact in f32 for every code and E8M0 scale 0..254
    (2^(s-127) is built from its exponent bits, so no rounding), and exact in bf16 wherever the product is in
    range. Scale 255 (E8M0 NaN) decodes to NaN."""
    packed = np.asarray(packed, np.uint8)
    scale = np.asarray(scale, np.uint8)
    out_f, half = packed.shape
    if scale.shape != (out_f, 2 * half // GROUP) or (2 * half) % GROUP:
        raise ValueError(f"weight_scale {list(scale.shape)} does not fit weight_packed {list(packed.shape)}")
    values = _PAIRS[packed]  # f32 [out, in/2, 2] = [out, in] with the low nibble at the even column
    # 2^(s-127) as an f32 with exponent field s (s >= 1); s = 0 is 2^-127, a subnormal: 0x00400000
    bits = np.where(scale == 0, np.uint32(0x00400000), scale.astype(np.uint32) << 23)
    bits = np.where(scale == 255, np.uint32(0x7FC00000), bits)
    factor = bits.view(np.float32)
    values = values.reshape(out_f, -1, GROUP)
    values *= factor[:, :, None]
    return to_dtype(values.reshape(out_f, 2 * half), dtype)


def to_dtype(values_f32: np.ndarray, dtype) -> np.ndarray:
    """Casts decoded f32 values; to bf16 by dropping the low 16 bits, exact because every decoded value has at
    most 2 significant bits (and much faster than a rounding cast)."""
    dtype = np.dtype(dtype)
    if dtype == np.dtype(ml_dtypes.bfloat16):
        return (values_f32.view(np.uint32) >> 16).astype(np.uint16).view(dtype)
    return values_f32.astype(dtype, copy=False)
