"""Per-head Muon + AdamW (`k3jax/training/optimizer.py`, docs/spec.md#muon) against an independent NumPy
Newton–Schulz."""

from __future__ import annotations

import itertools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import configs
from k3jax.model import K3Model
from k3jax.training import optimizer as opt_lib
from tests.helpers import make_train_step

A, B, C = 3.4445, -4.7750, 2.0315
BETA = 0.95


def ns_reference(g: np.ndarray, steps: int = 5) -> np.ndarray:
    """Quintic Newton–Schulz on one matrix, float64: X ← aX + (bA + cA²)X with A = XXᵀ, on the wide orientation,
    after dividing by the Frobenius norm."""
    x = np.asarray(g, np.float64)
    x = x / (np.linalg.norm(x) + 1e-8)
    transposed = x.shape[0] > x.shape[1]
    if transposed:
        x = x.T
    for _ in range(steps):
        a = x @ x.T
        x = A * x + (B * a + C * a @ a) @ x
    return x.T if transposed else x


def nesterov_input(grads: list[np.ndarray]) -> np.ndarray:
    """What Newton–Schulz sees after len(grads) steps: EMA momentum μ_t = βμ_{t-1} + (1-β)g_t, then the
    bias-corrected Nesterov mix β·μ_t/(1-β^{t+1}) + (1-β)·g_t/(1-β^t)."""
    mu = np.zeros_like(grads[0])
    for g in grads:
        mu = BETA * mu + (1 - BETA) * g
    t = len(grads)
    return BETA * mu / (1 - BETA ** (t + 1)) + (1 - BETA) * grads[-1] / (1 - BETA ** t)


def muon_reference(x: np.ndarray, fan_in: int, fan_out: int, lr: float) -> np.ndarray:
    """Muon update of one [fan_in, fan_out] block whose Nesterov momentum is `x`."""
    return -lr * 0.2 * math.sqrt(max(fan_in, fan_out)) * ns_reference(x)


def first_step_reference(g: np.ndarray, fan_in: int, fan_out: int, lr: float) -> np.ndarray:
    return muon_reference(nesterov_input([g]), fan_in, fan_out, lr)


class _Params(nnx.Module):
    """A bag of named parameters with logical axes, like the model's."""

    def __init__(self, specs: dict[str, tuple[tuple[int, ...], tuple[str, ...]]], seed: int = 0):
        rng = np.random.RandomState(seed)
        for name, (shape, axes) in specs.items():
            value = jnp.asarray(rng.randn(*shape) / math.sqrt(shape[0]), jnp.float64)
            setattr(self, name, nnx.Param(value, out_sharding=axes, eager_sharding=False))


def _step_updates(module: nnx.Module, grads: dict[str, np.ndarray], lr: float = 0.5, weight_decay: float = 0.0,
                  steps: int = 1, **kw):
    """Updates returned by the optimizer on its `steps`-th call (each call with the same `grads`)."""
    tx = opt_lib.make_optimizer(module, learning_rate=lr, weight_decay=weight_decay, **kw)
    params = nnx.to_pure_dict(nnx.state(module, nnx.Param))
    g = {name: jnp.asarray(grads.get(name, np.zeros(p.shape)), jnp.float64) for name, p in params.items()}
    state = tx.init(params)
    update = jax.jit(tx.update)
    for _ in range(steps):
        updates, state = update(g, state, params)
    return {k: np.asarray(v) for k, v in updates.items()}


@pytest.mark.usefixtures("x64")
def test_per_head_blocks_are_orthogonalised_separately():
    d, h, k = 16, 3, 8
    module = _Params({"q_proj": ((d, h, k), ("embed", "kda_heads", "kda_head_dim"))})
    rng = np.random.RandomState(1)
    g = rng.randn(d, h, k) * np.array([1.0, 10.0, 100.0])[None, :, None]  # heads at very different scales
    u = _step_updates(module, {"q_proj": g}, lr=0.5)["q_proj"]
    want = np.stack([first_step_reference(g[:, i, :], d, k, 0.5) for i in range(h)], axis=1)
    np.testing.assert_allclose(u, want, rtol=1e-9, atol=1e-12)
    # Each head gets an update of the same size despite the 100x gradient scale spread...
    head_rms = np.sqrt((u ** 2).mean(axis=(0, 2)))
    assert head_rms.max() / head_rms.min() < 1.3
    # ...whereas whole-matrix Muon on [D, H*K] is dominated by the largest head.
    whole = first_step_reference(g.reshape(d, h * k), d, h * k, 0.5).reshape(d, h, k)
    assert np.abs(u - whole).max() > 0.1 * np.abs(u).max()
    whole_rms = np.sqrt((whole ** 2).mean(axis=(0, 2)))
    assert whole_rms[2] / whole_rms[0] > 2.5


@pytest.mark.usefixtures("x64")
def test_second_step_uses_nesterov_momentum_per_head():
    d, h, k = 12, 2, 6
    module = _Params({"kv_b_proj": ((d, h, k), ("kv_lora", "heads", "head_dim"))})
    g = np.random.RandomState(2).randn(d, h, k) * np.array([1.0, 50.0])[None, :, None]
    tx = opt_lib.make_optimizer(module, learning_rate=0.1, weight_decay=0.0)
    params = nnx.to_pure_dict(nnx.state(module, nnx.Param))
    g2 = -0.3 * g + np.random.RandomState(3).randn(d, h, k)
    state = tx.init(params)
    _, state = tx.update({"kv_b_proj": jnp.asarray(g)}, state, params)
    u, _ = tx.update({"kv_b_proj": jnp.asarray(g2)}, state, params)
    nesterov = nesterov_input([g, g2])
    want = np.stack([muon_reference(nesterov[:, i, :], d, k, 0.1) for i in range(h)], axis=1)
    np.testing.assert_allclose(np.asarray(u["kv_b_proj"]), want, rtol=1e-9, atol=1e-12)


@pytest.mark.usefixtures("x64")
@pytest.mark.parametrize("stacked", [False, True])
def test_per_expert_blocks(stacked):
    e, l, m = 4, 8, 12
    lead = (2,) if stacked else ()
    lead_axes = ("layers",) if stacked else ()
    module = _Params({
        "w1": (lead + (e, l, m), lead_axes + ("experts", "expert_latent", "expert_mlp")),
        "w2": (lead + (e, m, l), lead_axes + ("experts", "expert_mlp", "expert_latent")),
    })
    rng = np.random.RandomState(4)
    scale = np.array([1.0, 3.0, 30.0, 300.0])[:, None, None]
    g1 = rng.randn(*lead, e, l, m) * scale
    g2 = rng.randn(*lead, e, m, l) * scale
    u = _step_updates(module, {"w1": g1, "w2": g2}, lr=0.25)
    for name, g, (fi, fo) in (("w1", g1, (l, m)), ("w2", g2, (m, l))):
        blocks = g.reshape(-1, fi, fo)
        want = np.stack([first_step_reference(b, fi, fo, 0.25) for b in blocks]).reshape(g.shape)
        np.testing.assert_allclose(u[name], want, rtol=1e-9, atol=1e-12)
        # Changing one expert's gradient leaves every other expert's update untouched.
        g_alt = g.copy()
        g_alt[..., 1, :, :] = rng.randn(*g_alt[..., 1, :, :].shape)
        u_alt = _step_updates(module, {"w1": g_alt if name == "w1" else g1,
                                       "w2": g_alt if name == "w2" else g2}, lr=0.25)[name]
        others = [0, 2, 3]
        np.testing.assert_allclose(u_alt[..., others, :, :], u[name][..., others, :, :], rtol=1e-12, atol=1e-14)
        assert np.abs(u_alt[..., 1, :, :] - u[name][..., 1, :, :]).max() > 1e-3


@pytest.mark.usefixtures("x64")
def test_o_proj_is_one_matrix_and_scanned_layers_are_separate():
    l, h, k, d = 2, 3, 4, 20
    module = _Params({"o_proj": ((l, h, k, d), ("layers", "heads", "head_dim", "embed"))})
    g = np.random.RandomState(5).randn(l, h, k, d)
    u = _step_updates(module, {"o_proj": g}, lr=1.0)["o_proj"]
    want = np.stack([first_step_reference(g[i].reshape(h * k, d), h * k, d, 1.0).reshape(h, k, d) for i in range(l)])
    np.testing.assert_allclose(u, want, rtol=1e-9, atol=1e-12)


@pytest.mark.usefixtures("x64")
def test_update_rms_matches_moonlight_scale():
    """0.2·√max(fan_in, fan_out) per block makes every Muon block's update RMS ≈ 0.2·lr (AdamW-like), whatever the
    block shape; the factor itself is exactly the documented one."""
    specs = {
        "q_proj": ((64, 4, 16), ("embed", "heads", "head_dim")),  # 4 blocks [64, 16]
        "up_proj": ((32, 256), ("embed", "mlp")),  # [32, 256]
        "down_proj": ((256, 32), ("mlp", "embed")),  # [256, 32]
        "w1": ((3, 48, 24), ("experts", "expert_latent", "expert_mlp")),  # 3 blocks [48, 24]
        "o_proj": ((4, 16, 64), ("heads", "head_dim", "embed")),  # [64, 64]
    }
    module = _Params(specs)
    rng = np.random.RandomState(6)
    grads = {name: rng.randn(*shape) for name, (shape, _) in specs.items()}
    lr = 0.01
    u = _step_updates(module, grads, lr=lr)
    rows = {r.path: r for r in opt_lib.label_table(module)}
    for name, upd in u.items():
        row = rows[name]
        assert row.update_scale == pytest.approx(0.2 * math.sqrt(max(row.block)))
        rms = np.sqrt((upd ** 2).mean()) / lr
        assert 0.16 < rms < 0.23, (name, rms)


@pytest.mark.usefixtures("x64")
def test_adamw_leaves_and_weight_decay():
    specs = {
        "q_proj": ((8, 2, 4), ("embed", "kda_heads", "kda_head_dim")),
        "embed_tokens": ((10, 8), ("vocab", "embed")),
        "weight": ((3, 8), ("layers", "norm")),
        "dt_bias": ((2, 4), ("kda_heads", "kda_head_dim")),
        "q_conv1d": ((4, 8), ("conv_window", "kda_proj")),
    }
    module = _Params(specs)
    rng = np.random.RandomState(7)
    grads = {name: rng.randn(*shape) for name, (shape, _) in specs.items()}
    u = _step_updates(module, grads, lr=0.1)
    for name in ("embed_tokens", "weight", "dt_bias", "q_conv1d"):  # plain AdamW: first step is -lr·sign(g)
        np.testing.assert_allclose(u[name], -0.1 * np.sign(grads[name]), rtol=1e-6)
    # Zero gradients: only the decoupled weight decay moves anything, -lr·wd·p, on Muon and AdamW leaves alike.
    zeros = {name: np.zeros(shape) for name, (shape, _) in specs.items()}
    u = _step_updates(module, zeros, lr=0.1, weight_decay=0.1)
    for name in specs:
        np.testing.assert_allclose(u[name], -0.1 * 0.1 * np.asarray(getattr(module, name)[...]), rtol=1e-9,
                                   atol=1e-15)


def test_schedule_warmup_then_cosine():
    s = opt_lib.lr_schedule(2.0, 1000)
    assert float(s(0)) == 0.0
    assert float(s(5)) == pytest.approx(1.0)
    assert float(s(10)) == pytest.approx(2.0)
    assert float(s(505)) == pytest.approx(1.0, abs=1e-3)
    assert float(s(1000)) == pytest.approx(0.0, abs=1e-6)
    values = [float(s(i)) for i in range(10, 1001, 10)]
    assert all(a >= b for a, b in itertools.pairwise(values))


def test_every_tiny_param_is_labelled():
    model = nnx.eval_shape(lambda: K3Model(configs.get_config("tiny"), rngs=nnx.Rngs(0)))
    params = nnx.state(model, nnx.Param)
    rows = opt_lib.label_table(model)
    assert len(rows) == len(jax.tree.leaves(params)) > 0
    by_name: dict[str, set] = {}
    for r in rows:
        assert r.label in (opt_lib.MUON, opt_lib.ADAMW)
        core = [a for a in r.axes if a not in ("layers", "experts")]
        if len(core) < 2:
            assert r.label == opt_lib.ADAMW, r
        name = r.path.split("/")[-1] if not r.path.endswith("/weight") else r.path.split("/")[-2]
        by_name.setdefault(name, set()).add((r.label, r.block, r.num_blocks // max(1, _stack(r))))
    assert {lab for lab, *_ in by_name["embed_tokens"] | by_name["lm_head"]} == {opt_lib.ADAMW}
    for name in ("q_conv1d", "dt_bias", "A_log", "o_norm", "query", "norm_weight", "input_layernorm",
                 "routed_expert_norm", "kv_a_layernorm"):
        assert {lab for lab, *_ in by_name[name]} == {opt_lib.ADAMW}, name
    cfg = configs.get_config("tiny")
    hk, dk = cfg.kda_num_heads, cfg.kda_head_dim
    d, hm = cfg.hidden_size, cfg.num_attention_heads
    for name in ("q_proj", "k_proj", "v_proj"):  # KDA: per head [D, dk]
        assert by_name[name] == {(opt_lib.MUON, (d, dk), hk)}, name
    assert by_name["q_b_proj"] == {(opt_lib.MUON, (cfg.q_lora_rank, cfg.qk_nope_head_dim + cfg.qk_rope_head_dim),
                                    hm)}
    assert by_name["kv_b_proj"] == {(opt_lib.MUON, (cfg.kv_lora_rank, cfg.qk_nope_head_dim + cfg.v_head_dim), hm)}
    assert by_name["g_proj"] == {(opt_lib.MUON, (d, dk), hk), (opt_lib.MUON, (d, cfg.v_head_dim), hm)}
    assert by_name["o_proj"] == {(opt_lib.MUON, (hk * dk, d), 1), (opt_lib.MUON, (hm * cfg.v_head_dim, d), 1)}
    latent, mlp, e = cfg.routed_expert_hidden_size, cfg.moe_intermediate_size, cfg.num_experts
    assert by_name["w1"] == by_name["w3"] == {(opt_lib.MUON, (latent, mlp), e)}
    assert by_name["w2"] == {(opt_lib.MUON, (mlp, latent), e)}
    for name in ("router", "up_proj", "down_proj", "gate_proj", "f_a_proj", "q_a_proj", "kv_a_proj_with_mqa"):
        assert all(lab == opt_lib.MUON and nb == 1 for lab, _, nb in by_name[name]), name
    # The optimizer's own label function covers the same tree (abstractly: no arrays are made).
    tx = opt_lib.make_optimizer(model, learning_rate=1e-3, total_steps=100)
    state = jax.eval_shape(tx.init, params)
    assert state is not None
    assert "muon" in opt_lib.format_label_table(rows)


@pytest.mark.parametrize("name", ["tiny_kimi_linear", "k3"])
def test_other_configs_label_every_param(name):
    """Low-rank KDA output gate and plain MLA q_proj (Kimi-Linear) and the full K3 layout (abstractly)."""
    model = nnx.eval_shape(lambda: K3Model(configs.get_config(name), rngs=nnx.Rngs(0)))
    rows = {r.path: r for r in opt_lib.label_table(model)}
    assert len(rows) == len(jax.tree.leaves(nnx.state(model, nnx.Param)))
    per_head = [r for r in rows.values() if r.path.split("/")[-1] in opt_lib.PER_HEAD_PROJECTIONS]
    assert per_head and all(r.num_blocks == math.prod(r.shape) // math.prod(r.block) > 1 for r in per_head)
    if name == "k3":
        w1 = rows["groups/4/units/layers/0/mlp/w1"]
        assert (w1.num_blocks, w1.block) == (22 * 896, (3584, 3072))
        assert rows["groups/4/units/layers/3/self_attn/q_b_proj"].block == (1536, 192)


def _stack(row) -> int:
    return row.shape[0] if row.axes and row.axes[0] == "layers" else 1


@pytest.mark.slow
def test_tiny_model_training_steps_lower_the_loss():
    # `tiny` cut to one scanned (KDA, MLA) x 2 group — KDA, MLA, MoE and stacked parameters — on the recurrent KDA
    # path without remat, so building and compiling stay within the test budget on 2 CPU cores.
    cfg = configs.get_config("tiny", ["num_hidden_layers=4", "full_attn_layers=(2,4)", "first_k_dense_replace=0",
                                      "kda_impl=recurrent", "remat=False"])
    assert [(g.start, len(g.pattern), g.num_repeats) for g in cfg.layer_groups()] == [(0, 2, 2)]
    model = K3Model(cfg, rngs=nnx.Rngs(0))
    assert any(r.axes[0] == "layers" for r in opt_lib.label_table(model))  # stacked params are present
    steps = 10
    optimizer = nnx.Optimizer(model, opt_lib.make_optimizer(model, learning_rate=2e-2, total_steps=steps),
                              wrt=nnx.Param)
    batch = jnp.asarray(np.random.RandomState(0).randint(0, cfg.vocab_size, (2, 17)), jnp.int32)

    step = make_train_step()

    losses = [float(step(model, optimizer, batch)) for _ in range(steps)]
    assert all(np.isfinite(losses))
    assert min(losses[-3:]) < losses[0] - 0.5, losses


@pytest.mark.usefixtures("x64")
def test_stacked_layers_are_orthogonalised_one_slice_at_a_time_with_the_same_result():
    """`orthogonalize_blocks` maps over the scan-stacking axis (bounded memory) and equals per-block NS."""
    from optax.contrib import MuonDimensionNumbers

    rng = np.random.RandomState(3)
    x = rng.randn(3, 4, 6, 5)  # [layers, experts, in, out]
    dn = MuonDimensionNumbers(reduction_axis=(2,), output_axis=(3,))
    mapped = np.asarray(opt_lib.orthogonalize_blocks(jnp.asarray(x), dn, map_axes=(0,)))
    whole = np.asarray(opt_lib.orthogonalize_blocks(jnp.asarray(x), dn))
    want = np.stack([np.stack([ns_reference(x[l, e]) for e in range(4)]) for l in range(3)])
    np.testing.assert_allclose(mapped, want, rtol=1e-9, atol=1e-12)
    np.testing.assert_allclose(whole, want, rtol=1e-9, atol=1e-12)
    text = jax.jit(lambda v: opt_lib.orthogonalize_blocks(v, dn, map_axes=(0,))).lower(jnp.asarray(x)).as_text()
    assert "while" in text  # a loop over the 3 layer slices, not one batched computation
