"""The MoE routing-plan kernel (`pallas_kernels.moe.route_plan`) through the Pallas interpreter equals a NumPy
oracle (top-k of sigmoid + bias with ties to the lower expert, stable expert-sorted rows, bincount) for token and
expert counts that are not powers of two, k = 1 and k = E; bad inputs are refused by name; it lowers for CUDA; a tiny
model decoding with moe_route_impl="pallas" routes every MoE layer through it and gives the logits of "xla", while a
300-token prefill keeps the XLA routing."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.cuda_lowering import triton_kernels
from pallas_kernels.moe import route_plan


def _oracle(scores, k):
    """NumPy: top-k by a stable descending sort (ties: lower expert first; NaN ranks as -inf), then a stable sort
    of the flat assignments by expert gives each assignment's row."""
    x = np.asarray(scores, np.float64)
    x = np.where(np.isnan(x), -np.inf, x)
    experts = np.argsort(-x, axis=1, kind="stable")[:, :k]
    flat = experts.reshape(-1)
    order = np.argsort(flat, kind="stable")
    rows = np.empty_like(order)
    rows[order] = np.arange(flat.size)
    return experts, rows.reshape(experts.shape), np.bincount(flat, minlength=x.shape[1])


@pytest.mark.parametrize("n,e,k", [(10, 20, 4), (1, 64, 8), (64, 64, 8), (37, 5, 5), (3, 17, 1)])
def test_route_plan_equals_numpy_oracle(n, e, k):
    rng = np.random.default_rng(n * 1000 + e)
    logits = rng.standard_normal((n, e)) * 2
    scores = jnp.asarray(1 / (1 + np.exp(-logits)) + 0.3 * rng.standard_normal(e), jnp.float32)
    plan = route_plan(scores, k, backend="interpret")
    experts, rows, sizes = _oracle(scores, k)
    np.testing.assert_array_equal(np.asarray(plan.experts_nk), experts)
    np.testing.assert_array_equal(np.asarray(plan.rows_nk), rows)
    np.testing.assert_array_equal(np.asarray(plan.group_sizes_e), sizes)
    inverse = np.empty(n * k, np.int64)
    inverse[rows.reshape(-1)] = np.arange(n * k) // k
    np.testing.assert_array_equal(np.asarray(plan.token_of_row_a), inverse)


def test_ties_go_to_the_lower_expert_as_in_lax_top_k():
    scores = jnp.zeros((4, 8), jnp.float32).at[:, 5].set(1.0)
    plan = route_plan(scores, 3, backend="interpret")
    want = np.asarray(jax.lax.top_k(scores, 3)[1])
    np.testing.assert_array_equal(np.asarray(plan.experts_nk), want)
    np.testing.assert_array_equal(want[0], [5, 0, 1])


def test_nan_and_minus_inf_scores_stay_inside_their_token():
    """A NaN ranks as -inf and a token whose remaining scores are all -inf still gets distinct experts, so the
    rows stay a permutation of 0 .. N*k-1 and the other tokens' plan is the NaN-free one."""
    rng = np.random.default_rng(5)
    scores = rng.standard_normal((5, 8)).astype(np.float32)
    scores[1, 3] = np.nan
    scores[3, :] = -np.inf
    scores[3, 6] = 0.5
    plan = route_plan(jnp.asarray(scores), 3, backend="interpret")
    experts, rows, sizes = _oracle(scores, 3)
    np.testing.assert_array_equal(np.asarray(plan.experts_nk), experts)
    np.testing.assert_array_equal(np.asarray(plan.rows_nk), rows)
    np.testing.assert_array_equal(np.asarray(plan.group_sizes_e), sizes)
    assert sorted(np.asarray(plan.rows_nk).ravel().tolist()) == list(range(15))
    assert len(set(np.asarray(plan.experts_nk)[3].tolist())) == 3 and np.asarray(plan.experts_nk)[3, 0] == 6


def test_bad_inputs_are_refused_by_name():
    scores = jnp.zeros((4, 8), jnp.float32)
    with pytest.raises(ValueError, match="expected selection scores"):
        route_plan(scores[0], 2, backend="interpret")
    with pytest.raises(ValueError, match="k=9"):
        route_plan(scores, 9, backend="interpret")
    with pytest.raises(ValueError, match="decode sizes only"):
        route_plan(jnp.zeros((300, 8), jnp.float32), 2, backend="interpret")
    with pytest.raises(ValueError, match="unknown backend"):
        route_plan(scores, 2, backend="tpu")


def test_kernel_lowers_for_cuda():
    s = jax.ShapeDtypeStruct
    for n, e, k in ((64, 64, 8), (256, 256, 8), (1, 64, 8)):
        count, names = triton_kernels(lambda a: route_plan(a, k), s((n, e), jnp.float32),
                                      name_pattern=r"k3_[a-z_]+")
        assert count == 1 and names == ["k3_moe_route_plan"]


@pytest.mark.slow  # the default suite decodes a whole model with it in test_decode_fusions.py (with the others)
def test_model_decode_with_the_routing_plan_equals_xla(monkeypatch):
    import configs

    import pallas_kernels.moe as moe_kernels
    from tests.conftest import DecodeHarness, max_rel_err

    base = configs.get_config("tiny", ["param_dtype=float32", "dtype=float32"]).replace(
        scan_layers=False, num_hidden_layers=4, full_attn_layers=(3,))  # dense layer 0, KDA, MLA, 3 MoE layers
    model = DecodeHarness(base, seed=4)
    calls = []
    real = moe_kernels.route_plan
    monkeypatch.setattr(moe_kernels, "route_plan", lambda *a, **kw: calls.append(a[0].shape) or real(*a, **kw))
    ids, cache, valid = model.ids(3, 1), model.cache(3, 320), jnp.asarray([1, 1, 1])
    want, _ = model.step(moe_route_impl="xla")(model.params, ids, cache, valid)
    got, _ = model.step(moe_route_impl="pallas")(model.params, ids, cache, valid)
    moe_layers = base.num_hidden_layers - base.first_k_dense_replace
    assert len(calls) == moe_layers and all(shape == (3, base.num_experts) for shape in calls)
    assert max_rel_err(got, want) < 1e-5
    calls.clear()
    prefill = model.step(moe_route_impl="pallas")  # 3 x 100 = 300 tokens > MAX_TOKENS
    prefill(model.params, model.ids(3, 100), cache, jnp.asarray([100, 100, 100]))
    assert not calls


def test_planned_experts_on_the_kernels_equal_the_dropless_xla_path(monkeypatch):
    """`experts_planned` with the kernel backend (the interpreter standing in for the GPU: fused GLU and down gmm,
    both walking expert groups) equals `experts_dropless` on `jax.lax.ragged_dot`, for the same routing."""
    from tests.conftest import moe_problem
    from k3jax.layers import moe
    from k3jax.ops import gmm as gmm_ops
    from pallas_kernels.gmm import DECODE_GROUP_WALK

    p = moe_problem(6, seed=9)
    cfg, x, router, bias, z, w1, w3, w2 = p.cfg, p.x, p.router, p.bias, p.z, p.w1, p.w3, p.w2
    weights, experts = p.weights, p.experts
    want = moe.experts_dropless(z, weights, experts, w1, w3, w2, cfg)
    p_weights, plan = moe.route_planned(x, router, bias, cfg, "interpret")
    np.testing.assert_array_equal(np.asarray(plan.experts_nk), np.asarray(experts))
    np.testing.assert_allclose(np.asarray(p_weights), np.asarray(weights), rtol=1e-6)
    monkeypatch.setattr(gmm_ops, "_kernel_backend_here", lambda: "interpret")
    got = moe.experts_planned(z, p_weights, plan, w1, w3, w2, cfg, decode_tiling=DECODE_GROUP_WALK)
    err = float(jnp.max(jnp.abs(got - want)) / jnp.max(jnp.abs(want)))
    assert err < 1e-5, err


def test_planned_routing_weights_have_the_xla_routes_gradients():
    """The plan's integer outputs carry no gradient; the combine weights (a gather of the sigmoid scores) give
    `route`'s gradients with respect to the tokens and the router."""
    import configs

    from k3jax.layers import moe

    cfg = configs.get_config("tiny", ["param_dtype=float32", "dtype=float32"])
    rng = np.random.default_rng(10)
    x = jnp.asarray(rng.standard_normal((5, cfg.hidden_size)), jnp.float32)
    router = jnp.asarray(rng.standard_normal((cfg.hidden_size, cfg.num_experts)) * 0.1, jnp.float32)
    bias = jnp.asarray(0.1 * rng.standard_normal(cfg.num_experts), jnp.float32)
    w = jnp.asarray(rng.standard_normal((5, cfg.num_experts_per_token)), jnp.float32)

    def loss_xla(x, r):
        return jnp.sum(moe.route(x, r, bias, cfg)[0] * w)

    def loss_planned(x, r):
        return jnp.sum(moe.route_planned(x, r, bias, cfg, "interpret")[0] * w)

    np.testing.assert_allclose(loss_planned(x, router), loss_xla(x, router), rtol=1e-6)
    for got, want in zip(jax.grad(loss_planned, argnums=(0, 1))(x, router),
                         jax.grad(loss_xla, argnums=(0, 1))(x, router)):
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-7)
