"""The decode expert-selection kernel (`pallas_kernels.moe.select`, the Pallas interpreter standing in for the GPU)
picks from the router's logits the same experts as a NumPy ranking and as the XLA `route`, with the same combine
weights (ties to the lower expert, NaN last, renormalised and scaled); the MoE layer uses it only in decode steps of
the plan-free experts."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.cuda_lowering import triton_kernels
from pallas_kernels.moe import select


def _numpy_selection(scores, bias, k, scale, renormalize):
    """float64: experts ranked by (-(score + bias), index), weights from the unbiased scores."""
    s = scores.astype(np.float64)
    biased = s + bias.astype(np.float64)
    biased = np.where(np.isnan(biased), -np.inf, biased)
    experts = np.stack([sorted(range(s.shape[1]), key=lambda e, r=r: (-biased[r, e], e))[:k] for r in range(len(s))])
    w = np.take_along_axis(s, experts, axis=1)
    if renormalize:
        w = w / (w.sum(axis=1, keepdims=True) + 1e-20)
    return w * scale, experts


@pytest.mark.parametrize("n,e,k,renormalize,scale", [
    (64, 64, 8, True, 1.0),  # k3_gpu decode at B = 64
    (37, 12, 3, True, 2.5),  # N not a multiple of the 16-token tile, E and k not powers of two
    (5, 6, 6, False, 1.0),  # every expert chosen, no renormalisation
])
def test_selection_equals_a_numpy_ranking_and_the_xla_route(n, e, k, renormalize, scale):
    import configs
    from k3jax.layers import moe

    rng = np.random.default_rng(n * e + k)
    d = 16
    x = rng.standard_normal((n, d)).astype(np.float32)
    router = rng.standard_normal((d, e)).astype(np.float32) / 4
    bias = (rng.standard_normal(e) / 10).astype(np.float32)
    logits = jnp.asarray(x) @ jnp.asarray(router)
    scores = np.asarray(jax.nn.sigmoid(logits))
    w, ex = select.select_experts(logits, jnp.asarray(bias), k, scale=scale, renormalize=renormalize,
                                  backend="interpret")
    assert w.shape == (n, k) and w.dtype == jnp.float32 and ex.dtype == jnp.int32
    want_w, want_e = _numpy_selection(scores, bias, k, scale, renormalize)
    np.testing.assert_array_equal(np.asarray(ex), want_e)
    np.testing.assert_allclose(np.asarray(w), want_w, rtol=1e-6)
    cfg = configs.get_config("tiny").replace(num_experts=e, num_experts_per_token=k, moe_renormalize=renormalize,
                                             routed_scaling_factor=scale)
    xla_w, xla_e, _ = moe.route(jnp.asarray(x), jnp.asarray(router), jnp.asarray(bias), cfg)
    np.testing.assert_array_equal(np.asarray(ex), np.asarray(xla_e))
    np.testing.assert_allclose(np.asarray(w), np.asarray(xla_w), rtol=1e-6)


def test_ties_go_to_the_lower_expert_and_nan_ranks_last():
    logits = np.zeros((3, 8), np.float32)  # every score sigmoid(0) = 0.5
    logits[1, 2] = np.nan  # never chosen ahead of a real score
    logits[2, :] = np.nan  # all NaN: still k distinct experts, the lowest indices
    bias = np.zeros(8, np.float32)
    bias[5] = 0.25  # selection-only: expert 5 first, its weight the unbiased 0.5
    w, ex = select.select_experts(jnp.asarray(logits), jnp.asarray(bias), 3, backend="interpret")
    np.testing.assert_array_equal(np.asarray(ex), [[5, 0, 1], [5, 0, 1], [0, 1, 2]])
    np.testing.assert_allclose(np.asarray(w[:2]), np.full((2, 3), 1 / 3), rtol=1e-6)
    assert np.isnan(np.asarray(w[2])).all()  # NaN scores give NaN weights, as the XLA route


def test_errors_name_the_problem():
    z = jnp.zeros((4, 8))
    with pytest.raises(ValueError, match="unknown backend"):
        select.select_experts(z, jnp.zeros(8), 2, backend="cuda")
    with pytest.raises(ValueError, match="bias"):
        select.select_experts(z, jnp.zeros(7), 2, backend="interpret")
    with pytest.raises(ValueError, match="k=9"):
        select.select_experts(z, jnp.zeros(8), 9, backend="interpret")
    with pytest.raises(ValueError, match="decode sizes only"):
        select.select_experts(jnp.zeros((300, 8)), jnp.zeros(8), 2, backend="interpret")


def test_kernel_lowers_for_cuda():
    s = jax.ShapeDtypeStruct
    count, names = triton_kernels(lambda a, b: select.select_experts(a, b, 8), s((64, 64), jnp.float32),
                                  s((64,), jnp.float32), name_pattern=r"k3_[a-z_]+")
    assert count == 1 and names == ["k3_moe_select"]


def test_layer_selects_with_the_kernel_only_in_plan_free_decode_steps(monkeypatch):
    import flax.nnx as nnx

    import configs
    from k3jax.layers import moe
    from k3jax.ops import backend as backend_lib
    from k3jax.ops.gmm import InferenceOnlyError

    cfg = configs.get_config("tiny")
    layer = moe.LatentMoE(cfg, rngs=nnx.Rngs(3))
    monkeypatch.setattr(backend_lib, "kernel_backend_here", lambda: "interpret")
    calls = []
    real = moe.route_selected
    monkeypatch.setattr(moe, "route_selected", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    x = jax.random.normal(jax.random.key(0), (6, 1, cfg.hidden_size))
    got = layer(x)
    assert len(calls) == 1
    layer.cfg = cfg.replace(moe_decode_select="xla")
    want = layer(x)
    assert len(calls) == 1
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-6)
    layer.cfg = cfg
    layer(jax.random.normal(jax.random.key(1), (2, 4, cfg.hidden_size)))  # prefill: XLA route
    assert len(calls) == 1
    with pytest.raises(InferenceOnlyError, match="moe_decode_select='xla'"):
        jax.grad(lambda v: layer(v).sum())(x)
