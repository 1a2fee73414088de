"""The dropless MoE combine (`k3jax.layers.moe.experts_dropless`) equals every expert on every token weighted by the
routing (`experts_dense`), and gathers its output rows instead of scatter-adding them: a GPU scatter-add adds with
atomics in a run-dependent order, which made greedy decoding of identical k3_gpu runs differ (RESULTS.md)."""

import jax
import jax.numpy as jnp
import numpy as np

import configs
from k3jax.layers import moe
from k3jax.ops import moe as moe_ops
from k3jax.ops.gmm import DECODE_TILING
from tests.conftest import jaxpr_eqns, moe_problem


def _inputs(n=7, seed=0):
    p = moe_problem(n, seed)
    return p.cfg, p.z, p.weights, p.experts, p.w1, p.w3, p.w2


def _float_scatter_adds(jaxpr) -> list:
    """The floating-point scatter-adds of a jaxpr and its sub-jaxprs (an integer one, bincount's, is exact)."""
    return [eqn for eqn in jaxpr_eqns(jaxpr)
            if eqn.primitive.name == "scatter-add" and jnp.issubdtype(eqn.outvars[0].aval.dtype, jnp.floating)]


def test_dropless_combine_equals_every_expert_on_every_token():
    cfg, z, weights, experts, w1, w3, w2 = _inputs()
    got = moe.experts_dropless(z, weights, experts, w1, w3, w2, cfg)
    want = moe.experts_dense(z, weights, experts, w1, w3, w2, cfg)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=2e-5, atol=2e-5 * float(jnp.max(jnp.abs(want))))


def test_dropless_combine_gathers_instead_of_scatter_adding():
    cfg, z, weights, experts, w1, w3, w2 = _inputs()
    jaxpr = jax.make_jaxpr(lambda *a: moe.experts_dropless(*a, cfg))(z, weights, experts, w1, w3, w2)
    assert not _float_scatter_adds(jaxpr.jaxpr)
    # the test can fail: the previous combine, a weighted scatter-add of the expert-sorted rows, is caught
    rows = jnp.ones((14, 32), jnp.float32)
    old = jax.make_jaxpr(lambda r, t: jnp.zeros((7, 32), r.dtype).at[t].add(r))(rows, jnp.arange(14) // 2)
    assert len(_float_scatter_adds(old.jaxpr)) == 1


def test_dropless_gradients_equal_every_expert_and_gather_instead_of_scatter_adding():
    """The backward of the two row permutations is a gather too (a scatter-add adds with atomics on GPU), and the
    gradients w.r.t. the inputs, routing weights and expert weights equal every-expert-on-every-token's."""
    cfg, z, weights, experts, w1, w3, w2 = _inputs()

    def loss(fn):
        return lambda z, wts, w1, w3, w2: jnp.sum(jnp.sin(fn(z, wts, experts, w1, w3, w2, cfg)))

    args = (z, weights, w1, w3, w2)
    got = jax.grad(loss(moe.experts_dropless), argnums=range(5))(*args)
    want = jax.grad(loss(moe.experts_dense), argnums=range(5))(*args)
    for name, g, w in zip(("z", "weights", "w1", "w3", "w2"), got, want):
        scale = float(jnp.max(jnp.abs(w)))
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=2e-5, atol=2e-5 * scale, err_msg=name)
    grad_jaxpr = jax.make_jaxpr(jax.grad(loss(moe.experts_dropless), argnums=range(5)))(*args)
    assert not _float_scatter_adds(grad_jaxpr.jaxpr)
    # the test can fail: autodiff of the plain row gather transposes it into a float scatter-add
    plain = jax.make_jaxpr(jax.grad(lambda x: jnp.sum(x[jnp.arange(14) // 2])))(jnp.ones((7, 32)))
    assert _float_scatter_adds(plain.jaxpr)


def test_tall_decode_tiles_with_xla_routing_equal_the_default_tiles_and_every_expert(monkeypatch):
    """32-row decode tiles (`moe_decode_row_tile=32`) on the XLA routing: the GPU kernels (the interpreter here) give
    the default tiles' result and every-expert-on-every-token's."""
    from k3jax.ops import backend as backend_lib

    cfg, z, weights, experts, w1, w3, w2 = _inputs(n=6, seed=3)
    monkeypatch.setattr(backend_lib, "kernel_backend_here", lambda: "interpret")
    tiles = moe.experts_dropless(z, weights, experts, w1, w3, w2, cfg)
    tall = moe.experts_dropless(z, weights, experts, w1, w3, w2, cfg, decode_tiling=DECODE_TILING._replace(tm=32))
    want = moe.experts_dense(z, weights, experts, w1, w3, w2, cfg)
    scale = float(jnp.max(jnp.abs(want)))
    np.testing.assert_allclose(np.asarray(tall), np.asarray(tiles), rtol=1e-5, atol=1e-5 * scale)
    np.testing.assert_allclose(np.asarray(tall), np.asarray(want), rtol=2e-5, atol=2e-5 * scale)


def test_latent_moe_takes_a_decode_tiling_only_when_configured_in_decode_steps_on_the_gpu_kernel_family(
        monkeypatch):
    from k3jax.ops import backend as backend_lib

    tall = DECODE_TILING._replace(tm=32)
    for sets, backend, want in (([], "gpu", None), (["moe_decode_row_tile=32"], "gpu", tall),
                                (["moe_decode_row_tile=32"], "interpret", tall),
                                (["moe_decode_row_tile=32"], "tpu", None), (["moe_decode_row_tile=32"], None, None)):
        cfg = configs.get_config("tiny", sets)
        monkeypatch.setattr(backend_lib, "kernel_backend_here", lambda b=backend: b)
        assert moe_ops.decode_tiling(cfg, 1) == want, (sets, backend)
        assert moe_ops.decode_tiling(cfg, 7) is None  # prefill / training: the kernels' own tiling


def _numpy_plan(experts_nk: np.ndarray, num_experts: int):
    """Independent reference: walk the experts in order, and each expert's assignments in flat order."""
    n, k = experts_nk.shape
    flat = experts_nk.reshape(-1)
    rows = np.zeros(n * k, np.int64)
    token_of_row = np.zeros(n * k, np.int64)
    row = 0
    for e in range(num_experts):
        for a in range(n * k):
            if flat[a] == e:
                rows[a], token_of_row[row] = row, a // k
                row += 1
    return rows.reshape(n, k), np.bincount(flat, minlength=num_experts), token_of_row


def test_plan_equals_a_numpy_walk_of_the_assignments():
    rng = np.random.default_rng(3)
    for n, k, e, distinct in [(1, 1, 4, True), (7, 3, 5, False), (64, 8, 64, True), (33, 4, 9, False)]:
        if distinct:
            experts = np.stack([rng.choice(e, size=k, replace=False) for _ in range(n)])
        else:  # repeated experts within a token: the plan still orders by flat index
            experts = rng.integers(0, e, size=(n, k))
        want_rows, want_sizes, want_tokens = _numpy_plan(experts, e)
        plan = jax.jit(lambda x: moe_ops.plan_from_experts(x, e))(jnp.asarray(experts, jnp.int32))
        np.testing.assert_array_equal(np.asarray(plan.rows_nk), want_rows, err_msg=f"{n}x{k} E={e}")
        np.testing.assert_array_equal(np.asarray(plan.group_sizes_e), want_sizes)
        np.testing.assert_array_equal(np.asarray(plan.token_of_row_a), want_tokens)
