"""The decode MoE tail kernel (`pallas_kernels.dense.matmul_add`, the Pallas interpreter standing in for the GPU):
``round(round(x @ w) + a_1) + a_2`` equals a float64 product rounded at the same points (bf16 and f32, M not a
power of two, tiles capped at small widths), refuses bad input by name and lowers for CUDA; the latent MoE layer
with moe_decode_tail="kernel" returns in a decode step exactly what its XLA tail (up-projection, shared-expert
add, residual add) returns, keeps XLA in prefill, and refuses differentiation by name."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.cuda_lowering import triton_kernels
from pallas_kernels.dense.matmul_add import AddTiling, matmul_add


def _rounded(x, dtype):
    return np.asarray(jnp.asarray(x, dtype), np.float64)


@pytest.mark.parametrize("m,k,n,dtype,tiling", [
    (64, 768, 1536, jnp.bfloat16, AddTiling()),  # k3_gpu decode at B = 64
    (37, 96, 48, jnp.float32, AddTiling(tn=16, tk=32)),  # M padded, several K steps, f32 at HIGHEST
    (5, 32, 64, jnp.bfloat16, AddTiling(tn=128, tk=128)),  # tiles capped at N / K
])
def test_matmul_add_equals_a_float64_product_rounded_in_order(m, k, n, dtype, tiling):
    rng = np.random.default_rng(m + k + n)
    x = jnp.asarray(rng.standard_normal((m, k)), dtype)
    w = jnp.asarray(rng.standard_normal((k, n)) / np.sqrt(k), dtype)
    adds = tuple(jnp.asarray(rng.standard_normal((m, n)), dtype) for _ in range(2))
    got = matmul_add(x, w, adds, tiling=tiling, backend="interpret")
    assert got.shape == (m, n) and got.dtype == dtype
    want = _rounded(np.asarray(x, np.float64) @ np.asarray(w, np.float64), dtype)
    for a in adds:
        want = _rounded(want + np.asarray(a, np.float64), dtype)
    # the product's f32 accumulation order differs from float64's: one rounding step of the output dtype at most
    ulp = 2.0 ** -7 if dtype == jnp.bfloat16 else 2.0 ** -22
    np.testing.assert_allclose(np.asarray(got, np.float64), want, rtol=ulp, atol=ulp * np.abs(want).max() / 4)
    xla = ((x @ w).astype(dtype) + adds[0]) + adds[1]
    if dtype == jnp.bfloat16:  # XLA's own result, but for products that land on a rounding boundary
        assert np.mean(np.asarray(got) == np.asarray(xla)) > 0.99
    else:
        np.testing.assert_allclose(np.asarray(got), np.asarray(xla), rtol=1e-5, atol=1e-5)


def test_matmul_add_errors_name_the_problem():
    x, w = jnp.zeros((4, 64), jnp.bfloat16), jnp.zeros((64, 32), jnp.bfloat16)
    with pytest.raises(ValueError, match="unknown backend"):
        matmul_add(x, w, backend="cuda")
    with pytest.raises(ValueError, match="equal K"):
        matmul_add(x, jnp.zeros((32, 32), jnp.bfloat16), backend="interpret")
    with pytest.raises(ValueError, match="share a dtype"):
        matmul_add(x, w.astype(jnp.float32), backend="interpret")
    with pytest.raises(ValueError, match="addend 0"):
        matmul_add(x, w, (jnp.zeros((4, 16), jnp.bfloat16),), backend="interpret")
    with pytest.raises(ValueError, match="tn=24"):
        matmul_add(x, jnp.zeros((64, 48), jnp.bfloat16), tiling=AddTiling(tn=24), backend="interpret")
    with pytest.raises(ValueError, match="M <= 256"):
        matmul_add(jnp.zeros((300, 64), jnp.bfloat16), w, backend="interpret")


def test_kernel_lowers_for_cuda():
    s, bf = jax.ShapeDtypeStruct, jnp.bfloat16
    count, names = triton_kernels(lambda x, w, a, b: matmul_add(x, w, (a, b)), s((64, 768), bf), s((768, 1536), bf),
                                  s((64, 1536), bf), s((64, 1536), bf), name_pattern=r"k3_[a-z_]+")
    assert count == 1 and names == ["k3_matmul_add"]


def test_layer_tail_kernel_equals_the_xla_tail_in_decode_only(monkeypatch):
    import flax.nnx as nnx

    import configs
    from k3jax.layers import moe
    from k3jax.ops import gmm as gmm_ops
    from k3jax.ops.gmm import InferenceOnlyError
    import pallas_kernels.dense.matmul_add as tail_mod

    cfg = configs.get_config("tiny", ["param_dtype=bfloat16", "dtype=bfloat16"])
    layer = moe.LatentMoE(cfg, rngs=nnx.Rngs(5))
    monkeypatch.setattr(gmm_ops, "_kernel_backend_here", lambda: "interpret")
    calls = []
    real = tail_mod.matmul_add
    monkeypatch.setattr(tail_mod, "matmul_add", lambda *a, **kw: calls.append(len(a[2])) or real(*a, **kw))
    x = jax.random.normal(jax.random.key(0), (6, 1, cfg.hidden_size), jnp.bfloat16)
    residual = jax.random.normal(jax.random.key(1), (6, 1, cfg.hidden_size), jnp.bfloat16)
    want = layer(x, residual_btd=residual)  # moe_decode_tail="xla" (default)
    assert calls == []
    layer.cfg = cfg.replace(moe_decode_tail="kernel")
    got = layer(x, residual_btd=residual)
    assert calls == [2]  # shared experts' output and the residual
    assert got.dtype == jnp.bfloat16
    assert np.mean(np.asarray(got) == np.asarray(want)) > 0.99
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32), rtol=1e-2, atol=1e-2)
    layer(x)
    assert calls == [2]  # no residual: the XLA tail
    xp = jax.random.normal(jax.random.key(2), (2, 4, cfg.hidden_size), jnp.bfloat16)
    layer(xp, residual_btd=xp)  # prefill: XLA
    assert calls == [2]
    layer.cfg = cfg.replace(moe_decode_tail="kernel", moe_decode_select="xla", moe_decode_experts="planned")
    with pytest.raises(InferenceOnlyError, match="moe_decode_tail='xla'"):
        jax.grad(lambda v: layer(v, residual_btd=residual).astype(jnp.float32).sum())(x)
