"""The split-K decode matmul (`pallas_kernels.dense.decode_matmul`) through the Pallas interpreter equals a float64
NumPy product (f32 and bf16, rows padded to a power of two, one and several K splits); the default tiling splits K
until the grid fills an H200; bad shapes are refused by name; the kernel lowers for CUDA on this host."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.cuda_lowering import triton_kernels
from pallas_kernels.dense import SplitTiling, decode_matmul, default_tiling


@pytest.mark.parametrize("m,k,n,tiling,dtype,tol", [
    (5, 192, 96, SplitTiling(tn=32, tk=32, splits=3), jnp.float32, 1e-6),
    (50, 128, 64, SplitTiling(tn=16, tk=16, splits=8), jnp.float32, 1e-6),
    (64, 256, 128, SplitTiling(tn=64, tk=64, splits=1), jnp.bfloat16, 1e-2),
], ids=["m5-3splits-f32", "m50-8splits-f32", "m64-nosplit-bf16"])
def test_split_k_product_equals_float64(m, k, n, tiling, dtype, tol):
    rng = np.random.default_rng(m)
    x = jnp.asarray(rng.standard_normal((m, k)), dtype)
    w = jnp.asarray(rng.standard_normal((k, n)) / np.sqrt(k), dtype)
    got = decode_matmul(x, w, tiling=tiling, backend="interpret")
    assert got.shape == (m, n) and got.dtype == dtype
    want = np.asarray(x, np.float64) @ np.asarray(w, np.float64)
    err = np.abs(np.asarray(got, np.float64) - want).max() / np.abs(want).max()
    assert err < tol, err


def test_default_tiling_fills_the_grid_with_k_splits_that_divide_k():
    assert default_tiling(1536, 4608).splits == 4          # 72 column tiles x 4 = 288 programs
    assert default_tiling(1536, 1536).splits == 12         # 24 x 12 = 288 (24 K steps: divisors only)
    assert default_tiling(1536, 163840).splits == 1        # the LM head fills the GPU by columns alone
    assert default_tiling(256, 64).splits == 4             # capped at the number of K steps
    assert default_tiling(1536, 1536, SplitTiling(splits=2)).splits == 2


def test_bad_shapes_are_refused_by_name():
    x, w = jnp.zeros((4, 96), jnp.float32), jnp.zeros((96, 64), jnp.float32)
    with pytest.raises(ValueError, match="multiple of tk"):
        decode_matmul(x, w, tiling=SplitTiling(tn=64, tk=64, splits=1), backend="interpret")
    with pytest.raises(ValueError, match="equal K"):
        decode_matmul(x, jnp.zeros((64, 64), jnp.float32), backend="interpret")
    with pytest.raises(ValueError, match="must divide"):
        decode_matmul(x, w, tiling=SplitTiling(tn=32, tk=32, splits=2), backend="interpret")
    with pytest.raises(ValueError, match="share a dtype"):
        decode_matmul(x.astype(jnp.bfloat16), w, tiling=SplitTiling(tn=32, tk=32, splits=3), backend="interpret")
    with pytest.raises(ValueError, match="unknown backend"):
        decode_matmul(x, w, tiling=SplitTiling(tn=32, tk=32, splits=3), backend="tpu")


def test_kernel_lowers_for_cuda():
    args = (jax.ShapeDtypeStruct((64, 1536), jnp.bfloat16), jax.ShapeDtypeStruct((1536, 1536), jnp.bfloat16))
    count, names = triton_kernels(lambda a, b: decode_matmul(a, b), *args, name_pattern=r"k3_[a-z_]+")
    assert count == 1 and names == ["k3_decode_matmul"]


@pytest.mark.slow  # the default suite decodes a whole model with it in test_decode_fusions.py (with the others)
def test_model_decode_with_the_kernel_projections_equals_the_xla_products(monkeypatch):
    """A 4-layer tiny model (dense layer 0, KDA, MLA, MoE with shared and latent experts, LM head) decoding with
    decode_matmul_impl="pallas" runs its projections through the split-K kernel (interpreter; a spy counts the calls)
    and gives the logits of decode_matmul_impl="xla"; a 300-row prefill stays on XLA (over DECODE_MAX_ROWS)."""
    import configs

    from k3jax.ops import linear
    from tests.conftest import DecodeHarness, max_rel_err

    base = configs.get_config("tiny", ["param_dtype=float32", "dtype=float32"]).replace(
        num_hidden_layers=4, full_attn_layers=(3,))
    model = DecodeHarness(base, seed=2)
    calls = []
    real = linear._kernel_matmul
    monkeypatch.setattr(linear, "_kernel_matmul", lambda *a: calls.append(a[0].shape) or real(*a))
    ids, cache, valid = model.ids(2, 1), model.cache(2, 320), jnp.asarray([1, 1])
    want, _ = model.step(decode_matmul_impl="xla")(model.params, ids, cache, valid)
    got, _ = model.step(decode_matmul_impl="pallas")(model.params, ids, cache, valid)
    assert len(calls) >= 10 and all(shape[0] == 2 for shape in calls)  # every projection of the 2-row step
    assert max_rel_err(got, want) < 1e-5
    calls.clear()
    prefill = model.step(decode_matmul_impl="pallas")  # 2 x 150 = 300 rows > DECODE_MAX_ROWS
    prefill(model.params, model.ids(2, 150), cache, jnp.asarray([150, 150]))
    assert not calls
