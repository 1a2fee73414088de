"""Invariants of the independent float64 NumPy reference (tests/reference/numpy_k3.py) itself."""

from types import SimpleNamespace

import numpy as np
import pytest

from tests.reference import numpy_k3 as R


def _tiny_k3():
    return SimpleNamespace(
        vocab_size=64, hidden_size=32, num_hidden_layers=9, full_attn_layers=(4, 8, 9), first_k_dense_replace=1,
        intermediate_size=48, hidden_act="situ", activation_situ_beta=4.0, activation_situ_linear_beta=25.0,
        rms_norm_eps=1e-5, kda_num_heads=2, kda_head_dim=8, kda_short_conv_kernel_size=4, kda_gate="lower_bound",
        kda_gate_lower_bound=-5.0, kda_output_gate="full_rank", num_attention_heads=2, q_lora_rank=16,
        kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=8, mla_use_output_gate=True,
        mla_lora_norm_eps=1e-6, num_experts=6, num_experts_per_token=2, num_shared_experts=1,
        moe_intermediate_size=16, routed_expert_hidden_size=16, latent_moe_use_norm=True, routed_scaling_factor=1.0,
        moe_renormalize=True, num_expert_group=1, topk_group=1, attn_res_block_size=4, tie_word_embeddings=False,
    )


def _tiny_kimi_linear():
    return SimpleNamespace(**{
        **vars(_tiny_k3()),
        "q_lora_rank": None, "kda_gate": "softplus", "kda_output_gate": "low_rank", "mla_use_output_gate": False,
        "routed_expert_hidden_size": None, "latent_moe_use_norm": False, "attn_res_block_size": None,
        "hidden_act": "silu", "num_expert_group": 2, "topk_group": 1, "routed_scaling_factor": 2.446,
    })


def test_attn_res_zero_query_is_mean_and_situ_bounds():
    rng = np.random.default_rng(0)
    sources = [rng.standard_normal((3, 32)) * (i + 1) for i in range(5)]
    out = R.attn_res(sources, 1.0 + rng.standard_normal(32), np.zeros((1, 32)), 1e-5)
    np.testing.assert_allclose(out, np.mean(sources, axis=0), rtol=0, atol=1e-12)

    g = np.linspace(-1e3, 1e3, 20001)
    u = g[::-1].copy()
    assert np.all(np.abs(R.situ_glu(g, u, 4.0, 25.0)) <= 4.0 * 25.0)  # strict in exact arithmetic
    g, u = rng.standard_normal(1000) * 3, rng.standard_normal(1000) * 3
    np.testing.assert_allclose(R.situ_glu(g, u, 1e6, 1e6), R.silu_glu(g, u), rtol=1e-8, atol=1e-9)


@pytest.mark.parametrize("make_cfg", [_tiny_k3, _tiny_kimi_linear])
def test_routing_weights_sum_to_scaling_factor(make_cfg):
    cfg = make_cfg()
    w = R.make_random_weights(cfg, seed=3)
    x = np.random.default_rng(1).standard_normal((40, cfg.hidden_size))
    idx, wts = R.route(w, "model.layers.1.block_sparse_moe.", x, cfg)
    assert idx.shape == wts.shape == (40, cfg.num_experts_per_token)
    assert all(len(set(row.tolist())) == cfg.num_experts_per_token for row in idx)
    np.testing.assert_allclose(wts.sum(axis=1), cfg.routed_scaling_factor, rtol=1e-12)
    if cfg.num_expert_group > 1:  # group-limited: with topk_group=1 all picks come from one group
        per_group = cfg.num_experts // cfg.num_expert_group
        assert all(len(set((row // per_group).tolist())) == cfg.topk_group for row in idx)


def test_kda_recurrence_zero_beta_zero_g_and_delta_rule():
    rng = np.random.default_rng(2)
    T, H, dk = 9, 2, 8
    q, k, v = (rng.standard_normal((T, H, dk)) for _ in range(3))
    o, S = R.kda_recurrence(q, k, v, np.zeros((T, H, dk)), np.zeros((T, H)))
    assert np.all(o == 0) and np.all(S == 0)
    # one token, beta=1, g=0: S = k v^T, o = (q.k) v
    o1, _ = R.kda_recurrence(q[:1], k[:1], v[:1], np.zeros((1, H, dk)), np.ones((1, H)))
    np.testing.assert_allclose(o1[0], np.sum(q[0] * k[0], -1)[:, None] * v[0], rtol=1e-12)
    # matrix form of report Eq 1: S_t = (I - b k k^T) Diag(exp g) S_{t-1} + b k v^T
    k = R.l2norm(k)
    g = -5.0 * R.sigmoid(rng.standard_normal((T, H, dk)))
    beta = R.sigmoid(rng.standard_normal((T, H)))
    _, S = R.kda_recurrence(q, k, v, g, beta)
    S1 = np.zeros((dk, dk))
    for t in range(T):
        S1 = (np.eye(dk) - beta[t, 0] * np.outer(k[t, 0], k[t, 0])) @ np.diag(np.exp(g[t, 0])) @ S1
        S1 = S1 + beta[t, 0] * np.outer(k[t, 0], v[t, 0])
    np.testing.assert_allclose(S[0], S1, rtol=1e-10, atol=1e-12)
    # whole KDA layer: v_proj = 0 => v = SiLU(0) = 0 => state stays 0 => output exactly 0
    cfg = _tiny_k3()
    w = R.make_random_weights(cfg, seed=4)
    w["model.layers.0.self_attn.v_proj.weight"] = np.zeros_like(w["model.layers.0.self_attn.v_proj.weight"])
    y = R.kda_layer(w, "model.layers.0.self_attn.", rng.standard_normal((5, cfg.hidden_size)), cfg)
    assert np.all(y == 0)


@pytest.mark.parametrize("make_cfg", [_tiny_k3, _tiny_kimi_linear])
def test_forward_shape_finite_causal(make_cfg):
    cfg = make_cfg()
    w = R.make_random_weights(cfg, seed=0, a_log_len=128)
    assert w["model.layers.0.self_attn.A_log"].shape == (128,)
    assert all(a.dtype == np.float32 for a in w.values())
    ids = np.random.default_rng(0).integers(0, cfg.vocab_size, size=(2, 7))
    logits = R.forward(w, cfg, ids)
    assert logits.shape == (2, 7, cfg.vocab_size) and logits.dtype == np.float64
    assert np.all(np.isfinite(logits))
    np.testing.assert_allclose(R.forward(w, cfg, ids[1:, :4])[0], logits[1, :4], rtol=1e-10, atol=1e-10)
