"""Each layer kind equals its float64 NumPy reference (tests/reference/numpy_k3.py), in float64, for the K3 and
Kimi-Linear variants, plus layer-level invariants (KDA decode == prefill, router bias semantics, AttnRes)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import configs
from k3jax.layers.attn_res import attn_res_mix
from k3jax.layers.moe import route
from k3jax.ops.glu import situ_glu
from tests.conftest import build_model, jit_call
from tests.reference import numpy_k3 as ref

F64 = ["param_dtype=float64", "dtype=float64"]


def _layer(model, index):
    """The DecoderLayer for a layer run singly (tiny configs: layers 0..3 are unscanned)."""
    group = model.cfg.layer_groups()
    for g, mod in zip(group, model.groups):
        if g.num_repeats == 1 and g.start <= index < g.start + len(g.pattern):
            return mod.layers[index - g.start]
    raise AssertionError(f"layer {index} is scanned")


def _x(cfg, t=29, seed=0):
    return np.random.RandomState(seed).randn(t, cfg.hidden_size)


@pytest.mark.parametrize("name", [pytest.param("tiny", marks=pytest.mark.slow), "tiny_kimi_linear"])
def test_kda_layer(x64, name):
    cfg = configs.get_config(name, F64)
    model, w = build_model(cfg)
    x = _x(cfg)
    ours = np.asarray(jit_call(_layer(model, 0).self_attn, jnp.asarray(x[None])))[0]
    np.testing.assert_allclose(ours, ref.kda_layer(w, "model.layers.0.self_attn.", x, cfg), rtol=1e-9, atol=1e-10)


@pytest.mark.parametrize("name", ["tiny", "tiny_kimi_linear"])
def test_mla_layer(x64, name):
    cfg = configs.get_config(name, F64)
    model, w = build_model(cfg)
    x = _x(cfg)
    ours = np.asarray(jit_call(_layer(model, 3).self_attn, jnp.asarray(x[None])))[0]
    np.testing.assert_allclose(ours, ref.mla_layer(w, "model.layers.3.self_attn.", x, cfg), rtol=1e-9, atol=1e-10)


@pytest.mark.parametrize("name", ["tiny", "tiny_kimi_linear"])
def test_moe_and_dense_layers(x64, name):
    cfg = configs.get_config(name, F64)
    model, w = build_model(cfg)
    x = _x(cfg)
    moe = np.asarray(jit_call(_layer(model, 1).mlp, jnp.asarray(x[None])))[0]
    np.testing.assert_allclose(moe, ref.moe_layer(w, "model.layers.1.block_sparse_moe.", x, cfg), rtol=1e-9,
                               atol=1e-10)
    dense = np.asarray(jit_call(_layer(model, 0).mlp, jnp.asarray(x[None])))[0]
    np.testing.assert_allclose(dense, ref.dense_mlp(w, "model.layers.0.mlp.", x, cfg), rtol=1e-9, atol=1e-10)


def test_group_limited_routing_matches_reference(x64):
    cfg = configs.get_config("tiny_kimi_linear", F64 + ["num_expert_group=4", "topk_group=2"])
    _, w = build_model(cfg)
    x = _x(cfg, t=50)
    prefix = "model.layers.1.block_sparse_moe."
    weights, experts, _ = route(jnp.asarray(x), jnp.asarray(w[prefix + "gate.weight"]).T,
                                jnp.asarray(w[prefix + "gate.e_score_correction_bias"]), cfg)
    idx_ref, weights_ref = ref.route(w, prefix, x, cfg)
    order = np.argsort(np.asarray(experts), axis=1)
    order_ref = np.argsort(idx_ref, axis=1)
    np.testing.assert_array_equal(np.take_along_axis(np.asarray(experts), order, 1),
                                  np.take_along_axis(idx_ref, order_ref, 1))
    np.testing.assert_allclose(np.take_along_axis(np.asarray(weights), order, 1),
                               np.take_along_axis(weights_ref, order_ref, 1), rtol=1e-12)


def test_attn_res_matches_reference(x64):
    rng = np.random.RandomState(0)
    bank = rng.randn(4, 2, 5, 16)
    live = rng.randn(2, 5, 16)
    norm_w, proj_w = 1 + 0.1 * rng.randn(16), rng.randn(16)
    for filled in range(5):
        ours = np.asarray(attn_res_mix(jnp.asarray(live), jnp.asarray(bank), filled, jnp.asarray(norm_w * proj_w),
                                       1e-5))
        want = ref.attn_res([bank[i] for i in range(filled)] + [live], norm_w, proj_w[None], 1e-5)
        np.testing.assert_allclose(ours, want, rtol=1e-12, atol=1e-12)


def test_attn_res_zero_query_is_mean_of_sources():
    rng = np.random.RandomState(1)
    bank = jnp.asarray(rng.randn(8, 1, 3, 32), jnp.float32)
    live = jnp.asarray(rng.randn(1, 3, 32), jnp.float32)
    out = attn_res_mix(live, bank, 5, jnp.zeros(32), 1e-5)
    want = (np.asarray(bank[:5]).sum(0) + np.asarray(live)) / 6
    np.testing.assert_allclose(np.asarray(out), want, rtol=1e-5, atol=1e-6)
    # no filled rows: the live partial sum passes through exactly
    np.testing.assert_array_equal(np.asarray(attn_res_mix(live, bank, 0, jnp.ones(32), 1e-5)), np.asarray(live))


def test_situ_is_bounded_and_tends_to_swiglu():
    g = jnp.linspace(-200, 200, 4001)
    u = jnp.linspace(300, -300, 4001)
    out = situ_glu(g, u, 4.0, 25.0)
    assert float(jnp.abs(out).max()) <= 100.0
    assert float(jnp.abs(out).max()) > 90.0  # the bound is approached, so the check is not vacuous
    gs, us = jnp.linspace(-6, 6, 101), jnp.linspace(-3, 3, 101)
    np.testing.assert_allclose(np.asarray(situ_glu(gs, us, 1e6, 1e6)), np.asarray(jax.nn.silu(gs) * us),
                               rtol=1e-5, atol=1e-6)


def test_router_bias_selects_but_does_not_weight():
    cfg = configs.get_config("tiny")
    rng = np.random.RandomState(0)
    x = jnp.asarray(rng.randn(64, cfg.hidden_size), jnp.float32)
    router = jnp.asarray(rng.randn(cfg.hidden_size, cfg.num_experts) * 0.2, jnp.float32)
    w0, e0, scores = route(x, router, jnp.zeros(cfg.num_experts), cfg)
    bias = jnp.zeros(cfg.num_experts).at[3].set(10.0)
    w1, e1, _ = route(x, router, bias, cfg)
    assert bool((e1 == 3).any(axis=1).all()), "a large bias must force expert 3 into every token's top-k"
    assert not bool((e0 == 3).any(axis=1).all())
    # combine weights are the unbiased scores of the selected experts, renormalised
    picked = jnp.take_along_axis(scores, e1, axis=1)
    np.testing.assert_allclose(np.asarray(w1), np.asarray(picked / picked.sum(1, keepdims=True)), rtol=1e-6)
    np.testing.assert_allclose(np.asarray(w1.sum(1)), cfg.routed_scaling_factor, rtol=1e-6)
    scaled = cfg.replace(routed_scaling_factor=2.446)
    np.testing.assert_allclose(np.asarray(route(x, router, bias, scaled)[0].sum(1)), 2.446, rtol=1e-6)


@pytest.mark.parametrize("name", [pytest.param("tiny", marks=pytest.mark.slow), "tiny_kimi_linear"])
def test_kda_layer_decode_step_by_step_equals_prefill(name):
    with jax.default_matmul_precision("float32"):  # full f32 matmuls on GPU too (TF32 would dominate the tolerance)
        _check_kda_decode_equals_prefill(name)


def _check_kda_decode_equals_prefill(name):
    from flax import nnx

    cfg = configs.get_config(name, ["kda_chunk_size=16"])
    model, _ = build_model(cfg)
    kda = _layer(model, 0).self_attn
    x = jnp.asarray(np.random.RandomState(3).randn(2, 21, cfg.hidden_size), jnp.float32)
    forward = nnx.jit(lambda layer, x_t, s: layer.forward(x_t, s))  # compiled: eager dispatch dominated the test
    full, full_state = forward(kda, x, None)
    state = kda.init_state(2)
    steps = []
    for t in range(21):
        y, state = forward(kda, x[:, t:t + 1], state)
        steps.append(y)
    np.testing.assert_allclose(np.asarray(jnp.concatenate(steps, 1)), np.asarray(full), rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(np.asarray(state.state_bhkv), np.asarray(full_state.state_bhkv), rtol=1e-4,
                               atol=1e-5)
    # mixed chunks: prefill 13 tokens, then 8 more in one call
    y1, s1 = forward(kda, x[:, :13], None)
    y2, _ = forward(kda, x[:, 13:], s1)
    np.testing.assert_allclose(np.asarray(jnp.concatenate([y1, y2], 1)), np.asarray(full), rtol=1e-4, atol=1e-5)
