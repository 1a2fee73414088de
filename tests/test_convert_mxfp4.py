"""MXFP4 decode: every one of the 16 codes at every E8M0 scale from 2^-17 to 2^8, exact in f32 and bf16; nibble
order (low nibble = even column); one scale per 32 columns."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

from k3jax.convert import mxfp4

E2M1 = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]


def _expected(code: int, exp: int) -> float:
    sign = -1.0 if code & 8 else 1.0
    return sign * E2M1[code & 7] * 2.0 ** exp


@pytest.mark.parametrize("dtype", [np.float32, ml_dtypes.bfloat16])
def test_all_codes_all_scales_exact(dtype):
    exps = np.arange(-17, 9)  # 2^-17 .. 2^8
    rows = len(exps)
    # each row: 32 columns = codes 0..15 twice (even column low nibble, odd column high nibble)
    codes = np.tile(np.arange(32) % 16, (rows, 1)).astype(np.uint8)
    packed = (codes[:, 0::2] | (codes[:, 1::2] << 4)).astype(np.uint8)
    scale = (exps + 127).astype(np.uint8)[:, None]
    got = mxfp4.decode(packed, scale, dtype)
    assert got.dtype == np.dtype(dtype) and got.shape == (rows, 32)
    for r, exp in enumerate(exps):
        for c in range(32):
            want = _expected(int(codes[r, c]), int(exp))
            assert float(got[r, c]) == want, (exp, codes[r, c], float(got[r, c]), want)
    assert np.signbit(got[:, 8]).all()  # code 8 is -0.0


def test_nibble_order_and_group_scales():
    packed = np.array([[0x71] + [0] * 15 + [0x2F] + [0] * 15], np.uint8)  # in = 64: two scale groups
    scale = np.array([[127, 130]], np.uint8)
    got = mxfp4.decode(packed, scale)
    assert got[0, 0] == 0.5 and got[0, 1] == 6.0  # low nibble 1 -> column 0, high nibble 7 -> column 1
    assert got[0, 32] == -6.0 * 8 and got[0, 33] == 1.0 * 8  # second group: scale 2^3
    assert np.count_nonzero(got) == 4


def test_shape_checks():
    assert mxfp4.check_shapes((4, 16), (4, 1), 4, 32) is None
    assert "weight_packed" in mxfp4.check_shapes((4, 32), (4, 1), 4, 32)
    with pytest.raises(ValueError, match="weight_scale"):
        mxfp4.decode(np.zeros((4, 16), np.uint8), np.zeros((4, 2), np.uint8))
